"""Regressions found by a hunt for defects in feature combinations (tiny random models, fp32)."""

from __future__ import annotations

import pytest

from tests.engine.tiny import assert_all_free, make_core, random_prompts, tiny_model
from tokenmill.engine.core import EngineCore
from tokenmill.engine.request import SamplingParams, TokenLogprob


def _prompt_logprobs(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> list[list[TokenLogprob]]:
    """Each request's prompt logprobs, as its first output carries them."""
    for i, prompt in enumerate(prompts):
        core.add_request(str(i), prompt, params, ())
    got: dict[str, list[TokenLogprob]] = {}
    while core.has_unfinished:
        for out in core.step().outputs:
            if out.prompt_logprobs is not None:
                assert out.request_id not in got, "prompt logprobs come with the first token only"
                got[out.request_id] = list(out.prompt_logprobs)
    assert_all_free(core)
    return [got[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_prompt_logprobs_survive_preemption_mid_prefill(async_scheduling: str) -> None:
    """A request preempted while its prompt is prefilled in chunks recomputes the prompt from position 0:
    its prompt logprobs were appended again (30 prompt tokens gave 50 entries, the first chunks' twice)."""
    model = tiny_model("llama")
    prompts = random_prompts((17, 23, 30), seed=77)
    params = SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=2)
    expected = _prompt_logprobs(make_core(model), prompts, params)
    core = make_core(model, num_blocks=12, max_num_batched_tokens=5, async_scheduling=async_scheduling)
    got = _prompt_logprobs(core, prompts, params)
    assert core.scheduler.stats.num_preemptions > 0
    for prompt, want, have in zip(prompts, expected, got, strict=True):
        assert len(want) == len(prompt) - 1
        assert [e.token_id for e in have] == prompt[1:]
        assert [e.top[0][0] for e in have] == [e.top[0][0] for e in want]
        assert [e.logprob for e in have] == pytest.approx([e.logprob for e in want], abs=1e-4)
