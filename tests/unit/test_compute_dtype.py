"""dtype=auto for a quantized GGUF on a bf16-capable CPU resolves to float32 activations and KV cache
(engine/loader.py: the quantized kernels and the native decode stack are float32, and a bf16 cache
failed Qwen2.5's quality gate)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig
from tokenmill.engine import loader
from tokenmill.kernels import quant_kernels
from tokenmill.layers import kv_cache

pytestmark = pytest.mark.skipif(quant_kernels() is None, reason="native quantized kernels cannot be built here")


def _config(**model: str) -> EngineConfig:
    return EngineConfig(model=ModelConfig("m", device="cpu", **model), cache=CacheConfig())


@pytest.fixture
def bf16_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "auto_dtype", lambda device: torch.bfloat16)


def test_quantized_gguf_on_a_bf16_host_runs_float32_with_a_float32_kv_cache(bf16_host: None) -> None:
    resolved = loader.resolve_compute_dtype(_config(), "gguf")
    assert resolved.model.dtype == "float32" and resolved.model.torch_dtype() == torch.float32
    # "auto" keeps the model's dtype: float32 (kv_cache.py)
    assert resolved.cache.kv_cache_dtype == "auto"
    assert kv_cache.kv_cache_spec(resolved.cache.kv_cache_dtype, resolved.model.torch_dtype()).name == "fp32"


@pytest.mark.parametrize(("model", "fmt"), [({"dtype": "bfloat16"}, "gguf"), ({"quantization": "none"}, "gguf"),
                                            ({}, "hf")])
def test_explicit_dtype_dense_weights_and_safetensors_keep_auto(bf16_host: None, model: dict[str, str],
                                                                fmt: str) -> None:
    config = _config(**model)
    assert loader.resolve_compute_dtype(config, fmt) == config


def test_an_explicit_kv_cache_dtype_is_kept(bf16_host: None) -> None:
    config = EngineConfig(model=ModelConfig("m", device="cpu"), cache=CacheConfig(kv_cache_dtype="int8"))
    assert loader.resolve_compute_dtype(config, "gguf").cache.kv_cache_dtype == "int8"


def test_a_float32_host_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "auto_dtype", lambda device: torch.float32)
    config = _config()
    assert loader.resolve_compute_dtype(config, "gguf") == config
