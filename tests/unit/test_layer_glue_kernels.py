"""The KV write and SwiGLU glue of kernels/cpu_kernels.cpp against the ATen ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import cpu_kernels
from tokenmill.layers.kv_cache import DenseKVCache, kv_cache_spec

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="native CPU kernels cannot be built here")

KVH, HD, H = 3, 64, 9


def _fused_heads(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v as the model hands them over: strided views into the fused q/k/v projection."""
    heads = torch.randn(tokens, H + 2 * KVH, HD).to(dtype)
    return heads[:, H:H + KVH], heads[:, H + KVH:]


@pytest.mark.parametrize(("act", "cache"), [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                             (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16),
                                             (torch.float16, torch.float32)])
def test_kv_write_equals_index_copy_for_every_dtype_pair(act: torch.dtype, cache: torch.dtype) -> None:
    k, v = _fused_heads(5, act)
    slots = torch.tensor([3, 17, 0, 31, 12])
    native = kv_cache_spec("auto", cache).allocate(8, 4, KVH, HD, torch.device("cpu"))
    assert isinstance(native, DenseKVCache) and native.writer is not None
    reference = DenseKVCache(torch.zeros_like(native.k), torch.zeros_like(native.v))  # no writer: index_copy_
    native.write(slots, k, v)
    reference.write(slots, k, v)
    assert torch.equal(native.k, reference.k) and torch.equal(native.v, reference.v)
    assert native.k.view(-1, KVH, HD)[17].float().abs().sum() > 0  # something was written where asked


def test_kv_write_checks_every_slot_before_writing() -> None:
    assert kernels is not None
    k_cache, v_cache = torch.zeros(2, 4, KVH, HD), torch.zeros(2, 4, KVH, HD)
    k, v = _fused_heads(2, torch.float32)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.kv_write(k_cache, v_cache, torch.tensor([1, 8]), k, v)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.kv_write(k_cache, v_cache, torch.tensor([-1, 0]), k, v)
    assert k_cache.abs().sum() == 0  # the valid first slot was not written either
    with pytest.raises(RuntimeError, match="contiguous heads"):
        kernels.kv_write(k_cache, v_cache, torch.tensor([0, 1]), k.transpose(1, 2).contiguous().transpose(1, 2), v)


@pytest.mark.parametrize("shape", [(1, 2 * 1536), (7, 2 * 13), (2, 3, 2 * 64)])
def test_silu_mul_matches_aten(shape: tuple[int, ...]) -> None:
    assert kernels is not None
    gate_up = torch.randn(*shape) * 4
    gate_up.view(-1)[:6] = torch.tensor([-120.0, -88.0, -20.0, 0.0, 30.0, 100.0])  # the exp's clamped range
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


def test_silu_mul_rejects_odd_widths_and_other_dtypes() -> None:
    assert kernels is not None
    with pytest.raises(RuntimeError, match="silu_mul"):
        kernels.silu_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="silu_mul"):
        kernels.silu_mul(torch.randn(2, 8, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(1, 151936), (3, 49152), (2, 7), (5, 40), (1, 1)])
def test_argmax_rows_equals_torch_argmax(shape: tuple[int, int]) -> None:
    assert kernels is not None
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[1]))
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))


def test_argmax_rows_breaks_ties_and_meets_nan_and_inf_as_torch_does() -> None:
    assert kernels is not None
    x = torch.zeros(6, 70)
    x[0, [9, 40, 65]] = 3.0  # ties: the first maximum, in the vector part and in the tail
    x[1, [66, 69]] = 2.0  # only in the scalar tail (70 = 2 * 32 + 6)
    x[2] = float("-inf")  # every value -inf: index 0
    x[3, 50] = float("nan")
    x[3, 10] = 5.0  # a NaN anywhere wins over any number
    x[4, [67, 68]] = float("nan")  # NaN in the tail only
    x[5, 33] = float("inf")
    assert kernels.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [9, 66, 0, 50, 67, 33]
    with pytest.raises(RuntimeError, match="argmax_rows"):
        kernels.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
