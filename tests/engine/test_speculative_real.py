"""Slow: greedy output with speculation is token-identical to without, on real models
(Qwen2.5-Coder-0.5B with n-gram lookup; Qwen2.5-Coder-1.5B with the 0.5B as its draft)."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.errors import ModelNotInstalledError
from tokenmill.models.resolve import resolve_model

CODE = '''def merge_intervals(intervals):
    intervals.sort(key=lambda x: x[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
'''
MESSAGES = [
    [{"role": "user", "content": "Rewrite this function with type hints; change nothing else.\n\n" + CODE}],
    [{"role": "user", "content": "Add a docstring to this function.\n\n" + CODE}],
]


def _require(*models: str) -> None:
    for model in models:
        try:
            resolve_model(model)
        except ModelNotInstalledError:
            pytest.skip(f"{model} is not pulled")


def _with_and_without(llm: LLM, max_tokens: int, messages: list[list[dict[str, str]]]) -> tuple[list[list[int]], ...]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with_spec = [o.outputs[0].token_ids for o in llm.chat(messages, params)]
    speculator, llm.core.speculator = llm.core.speculator, None
    try:
        without = [o.outputs[0].token_ids for o in llm.chat(messages, params)]
    finally:
        llm.core.speculator = speculator
    return with_spec, without


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 15], ids=["default-k", "k15"])  # 15: 16-row verifications, still decode rows
def test_ngram_on_qwen_coder_05b_is_token_identical(k: int) -> None:
    _require("qwen2.5-coder-0.5b")
    llm = LLM("qwen2.5-coder-0.5b", num_kv_blocks=128, max_model_len=1024, speculative="ngram",
              num_speculative_tokens=k)
    with_spec, without = _with_and_without(llm, 64, MESSAGES)
    assert with_spec == without


@pytest.mark.slow
def test_draft_05b_for_15b_is_token_identical() -> None:
    _require("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    llm = LLM("qwen2.5-coder-1.5b", num_kv_blocks=64, max_model_len=1024, speculative="draft",
              draft_model="qwen2.5-coder-0.5b", num_speculative_tokens=3)
    with_spec, without = _with_and_without(llm, 24, MESSAGES[:1])
    assert with_spec == without
