"""Stop strings, hold-back and EOS text in the output processor, over a fake tokenizer.

The fake tokenizer decodes each id to a fixed string, so token boundaries are exactly where the
test puts them; id 0 is EOS ("</s>"), skipped only when the stream skips special tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.request import EngineOutput, FinishReason, SamplingParams, TokenLogprob

EOS = 0
SPECIAL = {EOS: "</s>"}


@dataclass
class FakeStream:
    vocab: list[str]
    skip_special_tokens: bool

    def step(self, token_id: int) -> str:
        if token_id in SPECIAL:
            return "" if self.skip_special_tokens else SPECIAL[token_id]
        return self.vocab[token_id]


@dataclass
class ProcessedOutput:
    output: RequestOutput
    stopped_by_string: bool  # came back in reqs_to_abort: the engine must still abort it


def process(processor: OutputProcessor, out: EngineOutput) -> ProcessedOutput | None:
    result = processor.process_outputs([out])
    if not result.outputs:
        return None
    assert len(result.outputs) == 1 and set(result.reqs_to_abort) <= {out.request_id}
    return ProcessedOutput(result.outputs[0], out.request_id in result.reqs_to_abort)


class FakeTokenizer:
    def __init__(self, pieces: list[str]) -> None:
        self.vocab = ["<eos>", *pieces]  # id i + 1 decodes to pieces[i]

    def new_decode_stream(self, skip_special_tokens: bool = True) -> FakeStream:
        return FakeStream(self.vocab, skip_special_tokens)


def _run(pieces: list[str], params: SamplingParams, finish: FinishReason = FinishReason.LENGTH,
         extra_last: int | None = None) -> tuple[list[ProcessedOutput], str]:
    """Feed pieces one token per step (the last step finishes with `finish`); return outputs and deltas."""
    tokenizer = FakeTokenizer(pieces)
    processor = OutputProcessor(tokenizer)
    processor.add("r", "prompt", [5, 6], params)
    ids = [i + 1 for i in range(len(pieces))] + ([extra_last] if extra_last is not None else [])
    outputs: list[ProcessedOutput] = []
    for n, token_id in enumerate(ids):
        is_last = n == len(ids) - 1
        engine_out = EngineOutput(request_id="r", new_token_ids=[token_id], new_logprobs=[],
                                  finish_reason=finish if is_last else None, num_prompt_tokens=2,
                                  num_cached_tokens=0)
        processed = process(processor, engine_out)
        if processed is None:
            break
        outputs.append(processed)
        if processed.output.finished:
            break
    deltas = "".join(o.output.outputs[0].text_delta for o in outputs)
    return outputs, deltas


def _final(outputs: list[ProcessedOutput]) -> tuple[str, FinishReason | None, str | int | None]:
    c = outputs[-1].output.outputs[0]
    return c.text, c.finish_reason, c.stop_reason


def test_without_stop_strings_every_piece_is_emitted_at_once() -> None:
    outputs, deltas = _run(["Hel", "lo", " world"], SamplingParams())
    assert [o.output.outputs[0].text_delta for o in outputs] == ["Hel", "lo", " world"]
    assert [o.output.outputs[0].text for o in outputs] == ["Hel", "Hello", "Hello world"]
    assert _final(outputs) == ("Hello world", FinishReason.LENGTH, None)
    assert deltas == "Hello world"
    assert outputs[-1].output.finished and not outputs[-1].stopped_by_string


def test_stop_string_across_token_boundaries_is_not_emitted() -> None:
    outputs, deltas = _run(["Hel", "lo ", "wor", "ld"], SamplingParams(stop=["o w"]))
    assert _final(outputs) == ("Hell", FinishReason.STOP, "o w")
    assert deltas == "Hell"
    assert len(outputs) == 3  # ended on "wor"; "ld" is never processed
    assert outputs[-1].stopped_by_string and outputs[-1].output.finished
    assert all("o w" not in o.output.outputs[0].text for o in outputs)


def test_include_stop_str_in_output_keeps_the_stop_string() -> None:
    outputs, deltas = _run(["Hel", "lo ", "wor", "ld"], SamplingParams(stop=["o w"], include_stop_str_in_output=True))
    assert _final(outputs) == ("Hello w", FinishReason.STOP, "o w")
    assert deltas == "Hello w"


def test_text_that_could_start_a_stop_string_is_held_back_and_released_at_the_end() -> None:
    outputs, deltas = _run(["ab", "cx", "y"], SamplingParams(stop=["xyz"]))
    assert [o.output.outputs[0].text_delta for o in outputs] == ["", "ab", "cxy"]
    assert _final(outputs) == ("abcxy", FinishReason.LENGTH, None)
    assert deltas == "abcxy"


def test_emitted_text_never_contains_a_stop_string_prefix_that_completes_later() -> None:
    pieces = ["a", "b", "S", "T", "O", "P", "c"]
    outputs, deltas = _run(pieces, SamplingParams(stop=["STOP"]))
    assert _final(outputs) == ("ab", FinishReason.STOP, "STOP")
    for o in outputs:
        assert "S" not in o.output.outputs[0].text
    assert deltas == "ab"


def test_earliest_stop_string_wins_when_several_match_in_one_step() -> None:
    outputs, _ = _run(["Hello world"], SamplingParams(stop=["world", "lo"]))
    assert _final(outputs) == ("Hel", FinishReason.STOP, "lo")
    outputs, _ = _run(["Hello world"], SamplingParams(stop=["wo", "o wor"]))
    assert _final(outputs) == ("Hell", FinishReason.STOP, "o wor")


def test_earliest_stop_string_wins_across_steps() -> None:
    outputs, deltas = _run(["xx", "ab", "cd"], SamplingParams(stop=["bcd", "cd"]))
    assert _final(outputs) == ("xxa", FinishReason.STOP, "bcd")
    assert deltas == "xxa"


def test_stop_string_beats_a_length_finish_on_the_same_token() -> None:
    outputs, _ = _run(["foo", "END"], SamplingParams(stop=["END"]), finish=FinishReason.LENGTH)
    assert _final(outputs) == ("foo", FinishReason.STOP, "END")
    assert not outputs[-1].stopped_by_string  # the engine already ended it: nothing to abort


def test_eos_text_is_not_emitted_even_when_special_tokens_are_decoded() -> None:
    params = SamplingParams(skip_special_tokens=False)
    outputs, deltas = _run(["a", "b"], params, finish=FinishReason.STOP, extra_last=EOS)
    assert _final(outputs) == ("ab", FinishReason.STOP, None)
    assert deltas == "ab"
    assert outputs[-1].output.outputs[0].token_ids == [1, 2, EOS]
    assert not outputs[-1].stopped_by_string


def test_eos_text_is_emitted_with_include_stop_str_in_output() -> None:
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    outputs, _ = _run(["a"], params, finish=FinishReason.STOP, extra_last=EOS)
    assert _final(outputs)[0] == "a</s>"


def test_stop_token_id_text_is_dropped_and_reported_as_the_stop_reason() -> None:
    params = SamplingParams(stop_token_ids=[3])
    outputs, deltas = _run(["a", "b", "!"], params, finish=FinishReason.STOP)
    assert _final(outputs) == ("ab", FinishReason.STOP, 3)
    assert deltas == "ab"


def test_stop_token_id_with_ignore_eos_is_still_reported() -> None:
    params = SamplingParams(stop_token_ids=[3], ignore_eos=True)
    outputs, _ = _run(["a", "b", "!"], params, finish=FinishReason.STOP)
    assert _final(outputs) == ("ab", FinishReason.STOP, 3)


def test_held_back_text_is_released_when_a_stop_token_ends_the_request() -> None:
    params = SamplingParams(stop=["zzz"], stop_token_ids=[3])
    outputs, deltas = _run(["hello", "z", "!"], params, finish=FinishReason.STOP)
    assert _final(outputs) == ("helloz", FinishReason.STOP, 3)
    assert deltas == "helloz"


def test_nothing_is_processed_after_the_finish_and_abort_drops_state() -> None:
    tokenizer = FakeTokenizer(["a"])
    processor = OutputProcessor(tokenizer)
    processor.add("r", None, [5], SamplingParams())
    done = EngineOutput(request_id="r", new_token_ids=[1], new_logprobs=[], finish_reason=FinishReason.LENGTH,
                        num_prompt_tokens=1, num_cached_tokens=0)
    assert process(processor, done) is not None
    assert process(processor, done) is None
    processor.add("s", None, [5], SamplingParams())
    processor.abort("s")
    assert processor.states == {}


def test_logprobs_accumulate_only_when_asked() -> None:
    tokenizer = FakeTokenizer(["a", "b"])
    processor = OutputProcessor(tokenizer)
    processor.add("with", None, [5], SamplingParams(logprobs=0))
    processor.add("without", None, [5], SamplingParams())
    lps = [TokenLogprob(1, -0.5, 1, []), TokenLogprob(2, -1.5, 2, [])]
    last = None
    for i, lp in enumerate(lps):
        for rid in ("with", "without"):
            out = EngineOutput(request_id=rid, new_token_ids=[i + 1], new_logprobs=[lp] if rid == "with" else [],
                               finish_reason=FinishReason.LENGTH if i == 1 else None, num_prompt_tokens=1,
                               num_cached_tokens=0)
            processed = process(processor, out)
            assert processed is not None
            if rid == "with":
                last = processed
            else:
                assert processed.output.outputs[0].logprobs is None
    assert last is not None
    completion = last.output.outputs[0]
    assert completion.logprobs == lps
    assert completion.cumulative_logprob == -2.0


def test_an_earlier_output_keeps_its_own_tokens_and_logprobs_after_later_steps() -> None:
    """A streaming handler may render update k after step k + 1 was processed (CI caught it as a
    fuzzed stream whose logprobs outnumbered its tokens): each output is a snapshot."""
    processor = OutputProcessor(FakeTokenizer(["a", "b"]))
    processor.add("r", None, [5], SamplingParams(logprobs=1))
    def step(token_id: int, finish: FinishReason | None) -> ProcessedOutput | None:
        return process(processor, EngineOutput(request_id="r", new_token_ids=[token_id],
                                               new_logprobs=[TokenLogprob(token_id, -0.5, 1, [])],
                                               finish_reason=finish, num_prompt_tokens=1, num_cached_tokens=0))

    first = step(1, None)
    step(2, FinishReason.LENGTH)
    assert first is not None
    completion = first.output.outputs[0]
    assert completion.token_ids == [1]
    assert completion.logprobs is not None and len(completion.logprobs) == 1
