"""Slow: the int8 KV cache on SmolLM2-135M's real weights costs under 1% of perplexity on local
text, against the model-dtype cache (prompt logprobs through the engine: every position attends to
keys and values read back from the cache it just wrote)."""

from __future__ import annotations

import math

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.bench.corpus import TextKind, corpus_text
from tokenmill.errors import ModelNotInstalledError
from tokenmill.models.resolve import resolve_model

MODEL = "smollm2-135m"
WINDOWS, WINDOW_TOKENS = 3, 768  # 2,301 scored positions per text


def perplexity(llm: LLM, windows: list[list[int]]) -> float:
    outs = llm.generate(windows, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    logprobs = [lp.logprob for o in outs for lp in (o.prompt_logprobs or [])[1:] if lp is not None]
    assert len(logprobs) == sum(len(w) - 1 for w in windows)
    return math.exp(-sum(logprobs) / len(logprobs))


@pytest.mark.slow
@pytest.mark.parametrize("kind", [TextKind.PROSE, TextKind.CODE])
def test_int8_kv_perplexity_within_one_percent(kind: TextKind) -> None:
    try:
        resolve_model(MODEL)
    except ModelNotInstalledError:
        pytest.skip(f"{MODEL} is not pulled")
    results = {}
    for kv in ("auto", "int8"):
        # 512-token steps: each window is prefilled in chunks, later chunks reading earlier ones' cache.
        llm = LLM(MODEL, device="cpu", max_model_len=1024, num_kv_blocks=WINDOWS * WINDOW_TOKENS // 16 + 16,
                  max_num_batched_tokens=512, kv_cache_dtype=kv)
        tokens = llm.tokenizer.encode(corpus_text(kind))
        windows = [tokens[i * WINDOW_TOKENS:(i + 1) * WINDOW_TOKENS] for i in range(WINDOWS)]
        results[kv] = perplexity(llm, windows)
    assert 1.0 < results["auto"] < 100.0  # the model reads this text at all
    assert results["int8"] <= results["auto"] * 1.01, results
    assert results["int8"] != results["auto"]  # the int8 cache was really used
