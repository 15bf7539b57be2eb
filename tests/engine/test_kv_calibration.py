"""The int8 KV cache's smoothing fitted at load (engine/kv_calibration.py): the calibration keys and values
are the model's own (keys after RoPE), every int8 layer cache gets its fit at load and the native stack
rebinds to it, nothing else is smoothed, and the calibration text shares nothing with the eval corpora."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.engine.tiny import ARCH_NAMES, ArchName, make_core, random_prompts, tiny_model
from tokenmill import LLM
from tokenmill.engine.kv_calibration import (
    SMOOTHING_ENV,
    calibrate_kv_smoothing,
    calibration_kv,
    calibration_sequences,
    calibration_text,
    smoothing_skipped,
)
from tokenmill.eval.texts import CORPORA, corpus
from tokenmill.layers.kv_cache import DenseKVCache, Int8KVCache, kv_cache_spec


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_calibration_keys_are_the_models_keys_after_rope(arch: ArchName) -> None:
    """Read back from the temporary cache, sequence after sequence (each from position 0, in one
    padded prefill): transformers' own cached keys, position by position."""
    model = tiny_model(arch)
    runner = make_core(model, num_blocks=32).runner
    sequences = random_prompts([45, 13, 30], seed=3)
    rows = calibration_kv(runner.model, sequences, runner.block_size)
    assert len(rows) == model.arch.num_layers
    start = 0
    for ids in sequences:
        with torch.no_grad():
            cache = model.hf(torch.tensor([ids]), use_cache=True).past_key_values
        for layer, (k, v) in enumerate(rows):
            ref_k = cache.layers[layer].keys[0].transpose(0, 1)  # [n, KVH, hd]; a sliding layer: its window
            ref_v = cache.layers[layer].values[0].transpose(0, 1)
            assert k.shape == v.shape == (sum(map(len, sequences)), model.arch.num_kv_heads, model.arch.head_dim)
            end = start + len(ids)
            torch.testing.assert_close(k[end - ref_k.shape[0]:end], ref_k, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v[end - ref_v.shape[0]:end], ref_v, rtol=1e-4, atol=1e-4)
        start += len(ids)


def test_calibration_sequences_cut_the_text() -> None:
    assert calibration_sequences(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert calibration_sequences(list(range(8)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_calibration_fits_each_int8_layer_and_rebinds() -> None:
    runner = make_core(tiny_model("qwen2"), num_blocks=32).runner
    runner.kv_spec = kv_cache_spec("int8", torch.float32)
    runner.allocate_kv_cache(32)
    assert smoothing_skipped(runner) is None
    fits = calibrate_kv_smoothing(runner, random_prompts([60, 20], seed=4))
    assert len(fits) == len(runner.kv_caches) == runner.arch.num_layers
    for cache, fit in zip(runner.kv_caches, fits, strict=True):
        assert isinstance(cache, Int8KVCache) and cache.smoothing is fit and fit.values is not None
        assert fit.keys.head_sigma.shape == fit.values.head_shift.shape == (runner.arch.num_heads,
                                                                           runner.arch.head_dim)
    assert all(f.values is None for f in calibrate_kv_smoothing(runner, random_prompts([30], seed=5), values=False))
    with pytest.raises(ValueError, match="calibration tokens"):
        calibrate_kv_smoothing(runner, [[]])


def _llm(path: Path, kv_cache_dtype: str) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=256,
               kv_cache_dtype=kv_cache_dtype)


def test_load_smooths_int8_caches_only(tiny_hf_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_hf_dir("llama")
    int8 = _llm(path, "int8").core.runner
    assert all(isinstance(c, Int8KVCache) and c.smoothing is not None and c.smoothing.values is not None
               for c in int8.kv_caches)
    assert all(isinstance(c, DenseKVCache) for c in _llm(path, "fp32").core.runner.kv_caches)
    monkeypatch.setenv(SMOOTHING_ENV, "keys")
    keys = _llm(path, "int8").core.runner
    assert all(isinstance(c, Int8KVCache) and c.smoothing is not None and c.smoothing.values is None
               for c in keys.kv_caches)
    monkeypatch.setenv(SMOOTHING_ENV, "0")
    off = _llm(path, "int8").core.runner
    assert smoothing_skipped(off) == f"{SMOOTHING_ENV}=0"
    assert all(isinstance(c, Int8KVCache) and c.smoothing is None for c in off.kv_caches)


def test_the_fit_is_cached_on_disk(tiny_hf_dir: Callable[[str], Path], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The first load fits and writes the fit; the next reads the same fit back (no prefill); a
    damaged file is fitted again and rewritten, never a failed load."""
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    path = tiny_hf_dir("qwen2")
    first = _llm(path, "int8").core.runner
    files = list((tmp_path / "kv_smoothing").glob("*.pt"))
    assert len(files) == 1
    caplog.set_level(logging.INFO, logger="tokenmill.engine.kv_calibration")
    second = _llm(path, "int8").core.runner
    assert any("fit read from" in r.getMessage() for r in caplog.records)
    for a, b in zip(first.kv_caches, second.kv_caches, strict=True):
        assert isinstance(a, Int8KVCache) and isinstance(b, Int8KVCache)
        assert a.smoothing is not None and b.smoothing is not None and b.smoothing.values is not None
        assert a.smoothing.values is not None
        for x, y in ((a.smoothing.keys, b.smoothing.keys), (a.smoothing.values, b.smoothing.values)):
            assert all(torch.equal(getattr(x, f), getattr(y, f))
                       for f in ("shift", "sigma", "inv_sigma", "head_sigma", "head_shift"))
    files[0].write_bytes(b"garbage")
    caplog.clear()
    third = _llm(path, "int8").core.runner
    assert any("unreadable" in r.getMessage() for r in caplog.records)
    assert all(isinstance(c, Int8KVCache) and c.smoothing is not None for c in third.kv_caches)
    assert files[0].stat().st_size > 100  # rewritten
    stale = tmp_path / "kv_smoothing" / "gone-0.pt"
    torch.save({"model": str(tmp_path / "deleted.gguf")}, stale)
    monkeypatch.setenv("TOKENMILL_KV_SMOOTHING", "keys")  # another key: a new entry, written after a fit
    _llm(path, "int8")
    assert not stale.exists() and len(list((tmp_path / "kv_smoothing").glob("*.pt"))) == 2


def test_no_smoothing_under_a_logit_softcap(tiny_hf_dir: Callable[[str], Path]) -> None:
    runner = _llm(tiny_hf_dir("llama"), "int8").core.runner
    runner.model.attn.logit_softcap = 30.0  # cap · tanh(s / cap): a shift of s is no longer invisible
    assert smoothing_skipped(runner) == "attention logit softcap (not shift-invariant)"


def test_calibration_text_shares_no_passage_with_the_eval_corpora() -> None:
    """No 40-character run of the calibration text (whitespace folded) occurs in any eval corpus."""
    def fold(text: str) -> str:
        return " ".join(text.split())

    calibration = fold(calibration_text())
    assert len(calibration) > 4000
    shingles = {calibration[i:i + 40] for i in range(0, len(calibration) - 40, 7)}
    for name in CORPORA:
        text = fold(corpus(name))
        assert not [s for s in shingles if s in text], name
