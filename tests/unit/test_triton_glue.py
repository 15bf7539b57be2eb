"""The fused glue kernels for CUDA (kernels/triton_glue.py) against the ATen ops they replace.

Without a GPU they run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); with
one, on CUDA. The last test runs whole tiny models with the glue, the Triton attention and the
graph staging, token for token against the plain engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.engine.tiny import ARCH_NAMES, ArchName, make_core, random_prompts, run_to_completion, tiny_model
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.request import SamplingParams
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary

glue = pytest.importorskip("tokenmill.kernels.triton_glue")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g).to(dtype)
    w = torch.randn(96, generator=g)
    residual = torch.randn(5, 96, generator=g).to(dtype)
    expected_sum = (residual.float() + x.float()).to(dtype)
    source = expected_sum if with_residual else x
    ref = F.rms_norm(source.float(), (96,), w, 1e-6)
    res_dev = residual.to(DEVICE)
    out = glue.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6, res_dev if with_residual else None)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.cpu().float(), ref, atol=tol, rtol=tol)
    if with_residual:
        assert torch.equal(res_dev.cpu(), expected_sum)  # the residual stream updated in place
    else:
        assert torch.equal(res_dev.cpu(), residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_kv_write_equals_rotary_then_cache_write(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, head_dim, block_size = 6, 4, 2, 32, 4
    fused = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=g)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    q, k, v = fused[:, :heads], fused[:, heads:heads + kv_heads], fused[:, heads + kv_heads:]
    rope = RotaryEmbedding(head_dim, 64, 10000.0, 1.0, torch.float32, torch.device("cpu"))
    positions = torch.tensor([0, 5, 9, 17, 33, 63])
    cos, sin = rope.tables(positions)
    slots = torch.tensor([3, 8, 9, 22, 0, 31])
    k_cache = torch.zeros(8, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    dev = [t.to(DEVICE) for t in (q.to(dtype), k.to(dtype), v.to(dtype), cos, sin, k_cache, v_cache)]
    q_out = glue.rope_kv_write(*dev, slots.to(DEVICE))
    q, k, v = q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float()
    torch.testing.assert_close(q_out.cpu().float(), apply_rotary(q, cos, sin), atol=tol, rtol=tol)
    k_ref = torch.zeros(k_cache.shape)
    v_ref = torch.zeros(v_cache.shape)
    k_ref.view(-1, kv_heads, head_dim)[slots] = apply_rotary(k, cos, sin)
    v_ref.view(-1, kv_heads, head_dim)[slots] = v
    torch.testing.assert_close(dev[5].cpu().float(), k_ref, atol=tol, rtol=tol)
    assert torch.equal(dev[6].cpu().float(), v_ref)


@pytest.mark.parametrize("gelu", [False, True])
def test_act_mul(gelu: bool) -> None:
    gate_up = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(2))  # two column blocks
    gate, up = gate_up.chunk(2, dim=-1)
    ref = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    torch.testing.assert_close(glue.act_mul(gate_up.to(DEVICE), gelu).cpu(), ref, atol=1e-5, rtol=1e-5)


PROMPTS = random_prompts([3, 11, 20], seed=5)
PARAMS = [SamplingParams(max_tokens=n, temperature=0.0) for n in (6, 4, 5)]


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_models_with_triton_glue_and_graph_staging_are_token_identical(arch: ArchName) -> None:
    model = tiny_model(arch)
    config = EngineConfig(ModelConfig("tiny", dtype="float32", device=DEVICE, attention_backend="triton"),
                          CacheConfig(block_size=4, num_blocks=64), SchedulerConfig(max_num_seqs=4))
    core = EngineCore(config, model.arch, model.state_dict)
    core.runner.model.use_triton_glue(True)
    if DEVICE == "cpu":
        core.runner.enable_decode_graphs("eager", width_step_tokens=16)
    assert core.runner.graphs is not None
    assert run_to_completion(core, PROMPTS, PARAMS) == run_to_completion(make_core(model), PROMPTS, PARAMS)
    assert core.runner.graphs.replays > 0
