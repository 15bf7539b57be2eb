"""The KV cache is sized from the memory left after the weights are loaded, not before."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine.tiny import tiny_model
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig
from tokenmill.engine import model_runner
from tokenmill.engine.core import EngineCore
from tokenmill.layers.kv_cache import kv_cache_spec
from tokenmill.models.llama import LlamaForCausalLM

TOTAL_BYTES = 64 << 20
WEIGHT_BYTES = 48 << 20  # what the fake weights take once loaded
MEMORY_FRACTION = 0.5


def test_kv_blocks_count_only_the_memory_left_after_the_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    in_use = {"bytes": 0}
    load_weights = LlamaForCausalLM.load_weights

    def loading(self: LlamaForCausalLM, *args: Any, **kwargs: Any) -> Any:
        result = load_weights(self, *args, **kwargs)
        in_use["bytes"] += WEIGHT_BYTES
        return result

    def probe(device: torch.device) -> int:  # a device whose free memory shrinks as weights land on it
        return TOTAL_BYTES - in_use["bytes"]

    monkeypatch.setattr(LlamaForCausalLM, "load_weights", loading)
    monkeypatch.setattr(model_runner, "available_memory_bytes", probe)
    model = tiny_model("llama")
    config = EngineConfig(ModelConfig("tiny", dtype="float32", device="cpu"),
                          CacheConfig(block_size=4, memory_fraction=MEMORY_FRACTION))
    core = EngineCore(config, model.arch, model.state_dict)
    per_block = model_runner.kv_bytes_per_block(model.arch, 4, kv_cache_spec("auto", torch.float32))
    expected = int((TOTAL_BYTES - WEIGHT_BYTES) * MEMORY_FRACTION) // per_block
    assert expected < int(TOTAL_BYTES * MEMORY_FRACTION) // per_block  # the two orders are told apart
    assert core.kv.num_blocks == expected
    assert core.runner.kv_caches[0].nbytes * model.arch.num_layers == expected * per_block
