"""The real packaged GGUF files load into exactly the tensors transformers' GGUF loader produces.

Slow (transformers takes 30-80 s per model on 2 cores); models that are not pulled are skipped.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tokenmill.models.arch import ArchConfig
from tokenmill.models.loading.weights import load_checkpoint
from tokenmill.models.resolve import installed_models

pytestmark = pytest.mark.slow


def _installed(name: str) -> Path:
    path = installed_models().get(name)
    if path is None:
        pytest.skip(f"{name} is not pulled: run `tokenmill pull {name}`")
    return path


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_real_gguf_matches_transformers(name: str) -> None:
    from transformers import AutoModelForCausalLM

    path = _installed(name)
    started = time.perf_counter()
    checkpoint = load_checkpoint(path, "gguf")
    header_s = time.perf_counter() - started
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    _assert_same_config(checkpoint.arch, reference.config)
    state = reference.state_dict()
    started = time.perf_counter()
    for tensor_name in checkpoint.tensors:
        assert torch.equal(checkpoint.tensors[tensor_name].float(), state[tensor_name]), tensor_name
    print(f"{name}: header + config {header_s:.2f} s, every tensor {time.perf_counter() - started:.1f} s")


def _assert_same_config(arch: ArchConfig, config: Any) -> None:
    shapes = (arch.vocab_size, arch.hidden_size, arch.num_layers, arch.num_heads, arch.num_kv_heads)
    assert shapes == (
        config.vocab_size,
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
    )
    assert arch.intermediate_size == config.intermediate_size
    assert arch.head_dim == (getattr(config, "head_dim", None) or arch.hidden_size // arch.num_heads)
    assert math.isclose(arch.rms_norm_eps, config.rms_norm_eps, rel_tol=1e-6)
    assert arch.tie_word_embeddings == config.tie_word_embeddings
    if arch.architecture == "gemma3":
        assert arch.layer_is_sliding == tuple(kind == "sliding_attention" for kind in config.layer_types)
        assert arch.sliding_window == config.sliding_window
        assert arch.query_pre_attn_scalar == config.query_pre_attn_scalar
