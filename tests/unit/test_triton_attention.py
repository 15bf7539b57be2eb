"""The Triton paged decode kernel (kernels/triton_attention.py) against plain attention math.

Without a GPU it runs under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), the
same kernel source the GPU compiles; with one, on CUDA. Small partitions force the split-and-merge
path that long contexts take on a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.attention import paged_attention_reference
from tokenmill.layers.kv_cache import dequantize_int8, quantize_int8

triton_attention = pytest.importorskip("tokenmill.kernels.triton_attention")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [  # heads, kv heads, head dim, lengths, window, softcap, partition, block_n
    (4, 2, 64, [1, 5, 40], 0, 0.0, 512, 64),  # one partition: the kernel writes the output itself
    (6, 2, 48, [70, 3, 129], 0, 0.0, 32, 16),  # head dim padded to 64; 5 partitions merged
    (3, 3, 64, [50, 100], 20, 30.0, 32, 16),  # sliding window and logit softcap (Gemma)
    (8, 1, 32, [33, 90, 16], 0, 0.0, 64, 32),  # a GQA group of 8
]


def _problem(heads: int, kv_heads: int, head_dim: int, lens: list[int], dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    block_size, num_blocks = 16, 40
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    width = max(-(-n // block_size) for n in lens) + 1  # wider than needed: the graph path's tables are
    table = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in lens])  # shuffled block ids
    # q a strided view, as the fused projection hands it over
    q = torch.randn(len(lens), heads + 2 * kv_heads, head_dim, generator=g).to(dtype)[:, :heads]
    return q, k, v, table, torch.tensor(lens)


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_float32(case: tuple) -> None:
    heads, kv_heads, head_dim, lens, window, softcap, partition, block_n = case
    q, k, v, table, seq_lens = _problem(heads, kv_heads, head_dim, lens, torch.float32)
    out = triton_attention.paged_decode(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), table.to(DEVICE),
                                        seq_lens.to(DEVICE), 0.125, window, softcap, partition=partition,
                                        block_n=block_n)
    ref = paged_attention_reference(q, k, v, table, seq_lens, 0.125, window, softcap, torch.float64)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_cache(dtype: torch.dtype) -> None:
    """Tensor-core dots in the cache's dtype (on CPU: fp16 only; the interpreter has no bf16 math)."""
    q, k, v, table, seq_lens = _problem(4, 2, 64, [7, 200, 64], dtype)
    out = triton_attention.paged_decode(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), table.to(DEVICE),
                                        seq_lens.to(DEVICE), 0.125, 0, 0.0, partition=64, block_n=32)
    ref = paged_attention_reference(q, k, v, table, seq_lens, 0.125, 0, 0.0, torch.float64)
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-2, rtol=1e-2)


def test_int8_cache_reads_scales() -> None:
    q, k, v, table, seq_lens = _problem(4, 2, 64, [9, 77], torch.float32)
    (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
    out = triton_attention.paged_decode(q.to(DEVICE), kq.to(DEVICE), vq.to(DEVICE), table.to(DEVICE),
                                        seq_lens.to(DEVICE), 0.125, 0, 0.0, ks.to(DEVICE), vs.to(DEVICE),
                                        partition=32, block_n=16)
    ref = paged_attention_reference(q, dequantize_int8(kq, ks, torch.float64), dequantize_int8(vq, vs, torch.float64),
                                    table, seq_lens, 0.125, 0, 0.0, torch.float64)
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-5, rtol=1e-5)


def test_keys_past_the_length_are_never_read() -> None:
    """NaN in every slot past each row's length (and in unused blocks) must not reach the output."""
    q, k, v, table, seq_lens = _problem(4, 2, 64, [3, 37], torch.float32)
    k_poisoned, v_poisoned = k.clone(), v.clone()
    block_size = k.shape[1]
    used = torch.zeros(k.shape[0] * block_size, dtype=torch.bool)
    for row, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n)
        used[table[row, pos // block_size] * block_size + pos % block_size] = True
    k_poisoned.view(-1, *k.shape[2:])[~used] = float("nan")
    v_poisoned.view(-1, *v.shape[2:])[~used] = float("nan")
    out = triton_attention.paged_decode(q.to(DEVICE), k_poisoned.to(DEVICE), v_poisoned.to(DEVICE),
                                        table.to(DEVICE), seq_lens.to(DEVICE), 0.125, 0, 0.0, partition=32,
                                        block_n=16)
    ref = paged_attention_reference(q, k, v, table, seq_lens, 0.125, 0, 0.0, torch.float64)
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-5, rtol=1e-5)


def test_backend_selection() -> None:
    from tokenmill.layers.attention import decode_kernel

    kernels = decode_kernel("triton", torch.device(DEVICE))
    assert isinstance(kernels, triton_attention.TritonDecodeKernels)
    assert decode_kernel("sdpa", torch.device(DEVICE)) is None
