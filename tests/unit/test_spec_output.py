"""Several tokens in one step (speculative decoding) end at a stop string exactly as one token
per step would: same text, same token ids, same finish."""

from __future__ import annotations

from tests.unit.test_output_processor import FakeTokenizer, process
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.request import EngineOutput, FinishReason, SamplingParams

PIECES = ["Hel", "lo ", "wor", "ld", "!", " ok"]


def _completion(steps: list[list[int]], params: SamplingParams) -> tuple[str, list[int], FinishReason | None, bool]:
    processor = OutputProcessor(FakeTokenizer(PIECES))
    processor.add("r", "prompt", [5, 6], params)
    completion, aborted = None, False
    for ids in steps:
        out = EngineOutput("r", ids, [], None, 2, 0)
        processed = process(processor, out)
        if processed is None:
            break
        completion, aborted = processed.output.outputs[0], processed.stopped_by_string
        if processed.output.finished:
            break
    assert completion is not None
    return completion.text, list(completion.token_ids), completion.finish_reason, aborted


def test_a_stop_string_inside_a_multi_token_step_drops_the_tokens_after_it() -> None:
    params = SamplingParams(stop=["o w"])
    one_per_step = _completion([[i] for i in range(1, 7)], params)
    assert one_per_step == ("Hell", [1, 2, 3], FinishReason.STOP, True)
    assert _completion([[1, 2, 3, 4, 5], [6]], params) == one_per_step
    assert _completion([[1], [2, 3, 4, 5, 6]], params) == one_per_step


def test_without_a_stop_string_a_multi_token_step_is_kept_whole() -> None:
    assert _completion([[1, 2, 3], [4, 5, 6]], SamplingParams()) == \
        ("Hello world! ok", [1, 2, 3, 4, 5, 6], None, False)
