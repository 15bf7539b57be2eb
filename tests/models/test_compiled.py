"""The torch.compile'd decoder stack (models/compiled.py) and its custom ops (layers/custom_ops.py).

Engines over the tiny random models: compiled and eager must pick the same greedy tokens through
prefill, chunked prefill mixed with decodes, and many decode steps (the native decode stack is
switched off so decodes go through the compiled graph too), their logits must agree to fp32
rounding (the ATen glue sums in another order than the native glue kernels), and decode steps
replayed from the eager "graph" buffers (engine/cuda_graphs.py) must match as well.

The first compile of each model takes ~30-50 s on a 2-core CPU; Inductor's cache
($TOKENMILL_HOME/inductor) makes later runs a few seconds.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.engine.tiny import ArchName, greedy, random_prompts, run_to_completion, tiny_model
from tests.fixtures.engine_logits import core_prompt_logits
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, compile_mode
from tokenmill.engine.core import EngineCore
from tokenmill.engine.interfaces import ScheduledRequest, SchedulerOutput
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.errors import TokenmillError
from tokenmill.layers import custom_ops
from tokenmill.layers.linear import DenseLinear
from tokenmill.models.compiled import CompiledStack, compile_enabled

# 16-token steps: the 30- and 17-token prompts are chunked while the short ones already decode.
PROMPTS = random_prompts([3, 9, 17, 30], seed=7)
PARAMS = [greedy(n) for n in (12, 6, 9, 5)]
LOGIT_PROMPT = random_prompts([23], seed=3)[0]


def _core(arch: ArchName, compile: str, kv_cache_dtype: str = "auto") -> EngineCore:
    model = tiny_model(arch)
    config = EngineConfig(
        ModelConfig("tiny", dtype="float32", device="cpu", compile=compile),
        # No prefix cache: enable_decode_graphs reallocates the KV cache under a core that already ran.
        CacheConfig(block_size=4, num_blocks=256, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False),
        SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8),
    )
    core = EngineCore(config, model.arch, model.state_dict)
    core.runner.model.native_stack = None  # decode steps through the compiled graph as well
    return core


def _compiled(core: EngineCore) -> CompiledStack:
    compiled = core.runner.model.compiled
    assert compiled is not None
    return compiled


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_compiled_matches_eager_and_graph_replay(arch: ArchName) -> None:
    eager = _core(arch, "off")
    assert eager.runner.model.compiled is None
    expected = run_to_completion(eager, PROMPTS, PARAMS)
    core = _core(arch, "on")
    compiled = _compiled(core)
    assert run_to_completion(core, PROMPTS, PARAMS) == expected
    assert compiled.calls > 0 and not compiled.failed
    torch.testing.assert_close(core_prompt_logits(core, LOGIT_PROMPT), core_prompt_logits(eager, LOGIT_PROMPT),
                               rtol=1e-4, atol=1e-4)
    # Decode steps replayed from the static graph buffers, through the same compiled stack.
    core.runner.enable_decode_graphs("eager", width_step_tokens=16)
    calls = compiled.calls
    assert run_to_completion(core, PROMPTS, PARAMS) == expected
    graphs = core.runner.graphs
    assert graphs is not None and graphs.replays > 0
    assert compiled.calls > calls and not compiled.failed


def test_compiled_int8_kv_cache() -> None:
    expected = run_to_completion(_core("llama", "off", "int8"), PROMPTS, PARAMS)
    core = _core("llama", "on", "int8")
    assert run_to_completion(core, PROMPTS, PARAMS) == expected
    assert _compiled(core).calls > 0 and not _compiled(core).failed


def test_compile_failure_falls_back_to_eager(caplog: pytest.LogCaptureFixture) -> None:
    expected = run_to_completion(_core("llama", "off"), PROMPTS, PARAMS)
    core = _core("llama", "on")
    compiled = _compiled(core)
    attempts = []

    def broken(*args: object) -> torch.Tensor:
        attempts.append(1)
        raise RuntimeError("inductor exploded")

    compiled._fn = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="tokenmill.models.compiled"):
        assert run_to_completion(core, PROMPTS, PARAMS) == expected
    assert compiled.failed and compiled.calls == 0
    assert len(attempts) == 1  # declined for good after the first failure: one warning, no retries
    assert [r.message for r in caplog.records].count(
        "torch.compile of the decoder stack failed (RuntimeError: inductor exploded); "
        "the model runs eagerly from now on") == 1


def test_linear_op_opcheck() -> None:
    torch.manual_seed(0)
    linear = DenseLinear(torch.randn(24, 32), torch.randn(24), "auto")
    handle = custom_ops.register_linear(linear)
    try:
        for rows in (1, 7):
            x = torch.randn(rows, 32)
            torch.library.opcheck(custom_ops.linear, (x, handle))
            torch.testing.assert_close(custom_ops.linear(x, handle), linear(x))
    finally:
        custom_ops.unregister([handle])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_paged_attention_op_opcheck(kv_cache_dtype: str) -> None:
    core = _core("llama", "off", kv_cache_dtype)
    runner, arch = core.runner, core.runner.arch
    request = Request("r", LOGIT_PROMPT, SamplingParams(max_tokens=1))
    assert core.kv.allocate(request, len(LOGIT_PROMPT))
    inp = runner._input(SchedulerOutput([ScheduledRequest(request, 0, len(LOGIT_PROMPT),
                                                          core.kv.block_tables["r"])]))
    site = custom_ops.AttentionSite(runner.model.attn, (False,) * arch.num_layers, runner.kv_caches, inp.meta)
    handle = custom_ops.register_attention(site)
    try:
        n = len(LOGIT_PROMPT)
        q = torch.randn(n, arch.num_heads, arch.head_dim)
        k, v = torch.randn(2, n, arch.num_kv_heads, arch.head_dim).unbind(0)
        cache = runner.kv_caches[0].tensors()
        torch.library.opcheck(custom_ops.paged_attention, (q, k, v, cache, inp.meta.slot_mapping, handle, 0))
        out = custom_ops.paged_attention(q, k, v, cache, inp.meta.slot_mapping, handle, 0)
        reference = runner.model.attn(q, k, v, runner.kv_caches[0], inp.meta, False)
        torch.testing.assert_close(out, reference)
    finally:
        custom_ops.unregister([handle])


def test_compile_modes() -> None:
    cpu = torch.device("cpu")
    assert compile_enabled("on", cpu) and not compile_enabled("off", cpu)
    assert not compile_enabled("auto", cpu)  # measured no faster on CPU (docs/performance.md)
    with pytest.raises(TokenmillError, match="compile 'yes' is not supported"):
        ModelConfig("m", compile="yes")
    assert [compile_mode(c) for c in (None, True, False)] == ["auto", "on", "off"]
    assert [compile_mode(c) for c in (True, False, "auto")] == ["on", "off", "auto"]  # LLM(compile=...)
