"""The native prefill attention (kernels/prefill_avx512.h) against plain attention math, and the layer's
choice between it and gather + SDPA."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.attention import decode_path, decode_threads, paged_attention_reference
from tokenmill import LLM, SamplingParams
from tokenmill.engine import model_input
from tokenmill.kernels import cpu_kernels
from tokenmill.layers.attention import AttentionMetadata, GroupMetadata, PagedAttention
from tokenmill.layers.kv_cache import DenseKVCache

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.wide_attention_built(),
                                reason="the native prefill attention needs an AVX-512 build of the CPU kernels")


def _reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
               lens: list[int], qlens: list[int], scale: float, window: int) -> torch.Tensor:
    """A query at position p is a decode over keys [0, p]: each row scored alone, in fp64."""
    rows, row_lens = [], []
    for s, (n, nq) in enumerate(zip(lens, qlens, strict=True)):
        rows += [s] * nq
        row_lens += list(range(n - nq + 1, n + 1))
    return paged_attention_reference(q, k_cache, v_cache, table[rows], torch.tensor(row_lens), scale, window, 0.0,
                                     dtype=torch.float64)


def _caches(num_blocks: int, block_size: int, kvh: int, hd: int, g: torch.Generator,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(num_blocks, block_size, kvh, hd, generator=g).to(dtype),
            torch.randn(num_blocks, block_size, kvh, hd, generator=g).to(dtype))


# Rows per register tile are 6 and queries per item 16: groups of 7 heads (Qwen2.5), 3, 8 and 1; head_dim
# 64, 128 (two value slices) and 80 (64 + 16); key blocks of 64 against cache blocks of 16 and 5.
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(14, 2, 64), (9, 3, 64), (16, 2, 128),
                                                                 (8, 1, 80), (4, 4, 32)])
@pytest.mark.parametrize(("lens", "qlens"), [([100], [100]), ([300, 50, 17], [40, 50, 1]), ([70, 129], [70, 65])])
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("block_size", [16, 5])
def test_matches_attention_over_each_query_s_visible_keys(num_heads: int, num_kv_heads: int, head_dim: int,
                                                         lens: list[int], qlens: list[int], window: int,
                                                         block_size: int) -> None:
    assert kernels is not None
    g = torch.Generator().manual_seed(sum(lens) + num_heads + window)
    width = -(-max(lens) // block_size)
    num_blocks = width * len(lens) + 2
    k_cache, v_cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, g, torch.float32)
    table = torch.randperm(num_blocks, generator=g)[:width * len(lens)].view(len(lens), width)
    q = torch.randn(sum(qlens), num_heads, head_dim, generator=g)
    out = kernels.paged_prefill_attention(q, k_cache, v_cache, table, torch.tensor(lens), torch.tensor(qlens),
                                          0.125, window)
    ref = _reference(q, k_cache, v_cache, table, lens, qlens, 0.125, window)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("q_dtype", "cache_dtype"), [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                                      (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_half_precision_caches_and_queries_at_any_thread_count(q_dtype: torch.dtype, cache_dtype: torch.dtype,
                                                               threads: int) -> None:
    assert kernels is not None
    g = torch.Generator().manual_seed(threads)
    k_cache, v_cache = _caches(40, 16, 2, 64, g, cache_dtype)
    table = torch.randperm(40, generator=g)[:36].view(2, 18)
    lens, qlens = [280, 200], [150, 33]
    q = torch.randn(sum(qlens), 14, 64, generator=g).to(q_dtype)
    with decode_threads(threads):
        out = kernels.paged_prefill_attention(q, k_cache, v_cache, table, torch.tensor(lens), torch.tensor(qlens),
                                              0.125, 0)
    assert out.dtype == q_dtype
    ref = _reference(q.float(), k_cache.float(), v_cache.float(), table, lens, qlens, 0.125, 0)
    tol = 1e-5 if q_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_bad_arguments_raise_instead_of_reading_out_of_bounds() -> None:
    assert kernels is not None
    cache = torch.zeros(4, 4, 2, 16)
    table = torch.zeros(1, 2, dtype=torch.int64)
    q = torch.zeros(3, 4, 16)

    def call(lens: list[int], qlens: list[int], tab: torch.Tensor = table, qq: torch.Tensor = q) -> None:
        kernels.paged_prefill_attention(qq, cache, cache, tab, torch.tensor(lens), torch.tensor(qlens), 1.0, 0)

    with pytest.raises(RuntimeError, match="outside its block table"):
        call([9], [3])
    with pytest.raises(RuntimeError, match="outside its block table"):
        call([2], [3])  # more queries than keys
    with pytest.raises(RuntimeError, match="block id out of range"):
        call([6], [3], table + 4)
    with pytest.raises(RuntimeError, match="every sequence's query rows"):
        call([6], [2])
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.paged_prefill_attention(torch.zeros(3, 4, 8), torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8),
                                        table, torch.tensor([6]), torch.tensor([3]), 1.0, 0)


@pytest.mark.parametrize("window", [None, 20])
def test_the_layer_takes_the_kernel_and_agrees_with_gather_and_sdpa(window: int | None) -> None:
    """A prefill chunk after cached context (queries at positions 30 .. 69 and 0 .. 24) through the layer:
    the native kernel where it runs, gather + SDPA with the wide kernels off; same answer."""
    g = torch.Generator().manual_seed(5)
    block_size, kvh, hd, heads = 16, 2, 64, 14
    k_cache, v_cache = _caches(12, block_size, kvh, hd, g, torch.float32)
    cache = DenseKVCache(k_cache, v_cache)
    tables = torch.tensor([[3, 7, 1, 9, 2], [5, 0, 0, 0, 0]])
    starts, qlens = [30, 0], [40, 25]
    lens = torch.tensor([s + n for s, n in zip(starts, qlens, strict=True)])
    lq, lk = max(qlens), tables.shape[1] * block_size
    key, query = torch.arange(lk)[None, None, :], torch.arange(lq)[None, :, None] + torch.tensor(starts)[:, None, None]
    mask = (key <= query).unsqueeze(1)
    sliding = None if window is None else (mask & (key > query - window).unsqueeze(1))
    pad_index = torch.cat([torch.arange(n) + s * lq for s, n in enumerate(qlens)])
    group = GroupMetadata(tables, lens, mask, sliding, 0, sum(qlens), lq, pad_index, torch.tensor(qlens))
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), None, group)
    attn = PagedAttention(heads, kvh, hd, 0.125, None, window, cpu_kernels())
    q = torch.randn(sum(qlens), heads, hd, generator=g)
    outs, took = {}, []
    native_prefill = cache.native_prefill

    def spy(*args: object) -> torch.Tensor | None:
        out = native_prefill(*args)  # type: ignore[arg-type]
        took.append(out is not None)
        return out

    cache.native_prefill = spy  # type: ignore[method-assign]
    for path in ("wide", "avx2"):
        with decode_path(path):
            outs[path] = attn(q, q[:, :kvh], q[:, :kvh], cache, meta, is_sliding=window is not None, written=True)
    assert took == [True, False]
    rows = [0] * qlens[0] + [1] * qlens[1]
    row_lens = torch.tensor([*range(31, 71), *range(1, 26)])
    ref = paged_attention_reference(q, k_cache, v_cache, tables[rows], row_lens, 0.125, window or 0, 0.0)
    torch.testing.assert_close(outs["wide"], ref.view(sum(qlens), -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["avx2"], ref.view(sum(qlens), -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_a_prefill_the_kernel_serves_never_builds_the_dense_mask(backend: str, tiny_hf_dir: Callable[[str], Path],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner defers a prefill group's [S, 1, Lq, Lk] mask to its first reader: with the native kernel
    no layer reads it (two chunked prompts and a decode in one step), with SDPA every prefill step builds it."""
    built: list[tuple[int, ...]] = []
    causal_masks = model_input._causal_masks

    def counting(*args: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        masks = causal_masks(*args)
        built.append(tuple(masks[0].shape))
        return masks

    monkeypatch.setattr(model_input, "_causal_masks", counting)
    llm = LLM(str(tiny_hf_dir("gemma3")), dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=256,
              attention_backend=backend, max_num_batched_tokens=48)
    outs = llm.generate([[5 + i % 200 for i in range(70)], [9 + i % 150 for i in range(30)]],
                        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    if backend == "auto":
        assert built == []
    else:
        assert built and all(len(shape) == 4 for shape in built)
