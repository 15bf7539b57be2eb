"""Paged decode attention for GPUs in Triton: one query row per sequence against its keys, read in
place through the block table (no gather of the context per layer).

Flash-decoding over the paged layout. The grid is (rows, kv heads, splits): a program owns one
row's GQA group of query heads (padded to 16 for `tl.dot`) and one partition of PARTITION keys,
walks it in tiles of BLOCK_N keys (each key's block id read from the table, so a tile may span
blocks), and keeps an online softmax:

    s = q·k * scale  (softcap: cap * tanh(s / cap))      m' = max(m, max s)
    l' = l * e^(m - m') + Σ e^(s - m')                    acc' = acc * e^(m - m') + Σ e^(s - m') v

With one partition the program writes acc / l; with several it writes (acc, m, l) and a second
kernel merges the partitions of each (row, head):  out = Σ_i e^(m_i - M) acc_i / Σ_i e^(m_i - M) l_i,
M = max_i m_i (an empty partition has m = -inf and weighs 0; the partition with the row's last key
is never empty). The number of partitions comes from the block table's width, a host-side shape, so
a CUDA graph captured for a table width replays with the same grid whatever the lengths are.

Keys past seq_len, and before seq_len - window for a sliding window, are never read. Scores,
softmax and the value sum run in float32 whatever the cache dtype (int8 caches multiply by their
per-(token, kv head) scales on load); with a bf16/fp16 cache the two dots take that dtype on the
tensor cores (q and the softmax weights rounded to it, as FlashAttention does), with a float32
cache they run in float32 ("ieee"). The same source runs on CPU under Triton's interpreter
(TRITON_INTERPRET=1, set by tests/conftest.py where there is no GPU): that is how the tests check
it on machines without one.
"""

import functools
import math
from typing import Any

import torch
import triton
import triton.language as tl

PARTITION = 512  # keys per program; a multiple of BLOCK_N
SMALL_PARTITION = 128  # when rows x kv heads alone cannot fill the GPU (batch 1): more programs per row
_FEW_PROGRAMS = 64
BLOCK_N = 64  # keys per tile
_MIN_GROUP = 16  # tl.dot needs M >= 16: a GQA group of 1-8 heads is padded


def _decode_partial(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, lens_ptr, out_ptr, acc_ptr, ml_ptr,
                    scale, softcap, window,
                    stride_qn, stride_qh, stride_kb, stride_kt, stride_kh, stride_sb, stride_st, stride_tn,
                    stride_on, stride_oh, num_splits,
                    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION: tl.constexpr,
                    INT8: tl.constexpr, LOWP: tl.constexpr, SOFTCAP: tl.constexpr, SINGLE: tl.constexpr):
    n = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + n).to(tl.int32)
    lo = split * PARTITION
    hi = tl.minimum(lo + PARTITION, seq_len)
    if window > 0:
        lo = tl.maximum(lo, seq_len - window)

    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HEAD_DIM_P)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + n.to(tl.int64) * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if LOWP:  # noqa: SIM108  (bf16/fp16 cache: tensor-core dots in its dtype, float32 accumulation)
        q = q.to(k_ptr.dtype.element_ty)
    else:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    # A constant trip count with a guard rather than range(lo, hi): the same code once compiled, and
    # Triton's interpreter (the CPU tests) cannot take tensor loop bounds under numpy 2.
    for t in range(0, PARTITION // BLOCK_N):
        if lo + t * BLOCK_N < hi:
            tok = lo + t * BLOCK_N + cols
            valid = tok < hi
            blk = tl.load(table_ptr + n.to(tl.int64) * stride_tn + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            within = (tok % BLOCK_SIZE).to(tl.int64)
            row = blk * stride_kb + within * stride_kt + kvh * stride_kh  # [BLOCK_N] element offsets
            kv_mask = valid[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if not LOWP:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            if INT8:
                srow = blk * stride_sb + within * stride_st + kvh
                k = k * tl.load(ks_ptr + srow, mask=valid, other=0.0).to(tl.float32)[:, None]
                v = v * tl.load(vs_ptr + srow, mask=valid, other=0.0).to(tl.float32)[:, None]
            if LOWP:  # noqa: SIM108  (Triton compiles if/else on a constexpr; keep the kernel plain)
                s = tl.dot(q, tl.trans(k)) * scale  # [GROUP_P, BLOCK_N]
            else:
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            if SOFTCAP:
                # tanh(x) = 1 - 2 / (e^{2x} + 1): no libdevice call, so the interpreter runs it too.
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if LOWP:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new

    out_mask = g_ok[:, None] & d_ok[None, :]
    if SINGLE:
        out = acc / l_i[:, None]
        tl.store(out_ptr + n.to(tl.int64) * stride_on + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials laid out [N, H, splits, HEAD_DIM_P] and [N, H, splits, 2] (m, l).
        base = (n.to(tl.int64) * GROUP * tl.num_programs(1) + heads) * num_splits + split  # [GROUP_P]
        tl.store(acc_ptr + base[:, None] * HEAD_DIM_P + d[None, :], acc, mask=out_mask)
        tl.store(ml_ptr + base * 2, m_i, mask=g_ok)
        tl.store(ml_ptr + base * 2 + 1, l_i, mask=g_ok)


def _decode_merge(acc_ptr, ml_ptr, out_ptr, stride_on, stride_oh, num_heads, num_splits,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, SPLITS_P: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_P)
    d = tl.arange(0, HEAD_DIM_P)
    s_ok = sp < num_splits
    base = (n.to(tl.int64) * num_heads + h) * num_splits + sp
    m = tl.load(ml_ptr + base * 2, mask=s_ok, other=float("-inf"))
    ls = tl.load(ml_ptr + base * 2 + 1, mask=s_ok, other=0.0)
    big = tl.max(m, 0)
    w = tl.exp(m - big)  # empty partitions: e^-inf = 0
    total = tl.sum(w * ls, 0)
    # Columns past HEAD_DIM were never stored by the partial kernel: masked, not read as garbage.
    acc = tl.load(acc_ptr + base[:, None] * HEAD_DIM_P + d[None, :], mask=s_ok[:, None] & (d[None, :] < HEAD_DIM),
                  other=0.0)
    out = tl.sum(acc * w[:, None], 0) / total
    tl.store(out_ptr + n.to(tl.int64) * stride_on + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def interpreting() -> bool:
    """Triton's interpreter is on (TRITON_INTERPRET=1 before triton was imported): kernels run on CPU
    tensors with numpy. It can't be switched on later: `tl`'s own helpers are decorated at import."""
    return bool(triton.knobs.runtime.interpret)


@functools.cache
def _compiled() -> tuple[Any, Any]:
    # Decorated at first use, not at import, so importing this module costs nothing.
    return triton.jit(_decode_partial), triton.jit(_decode_merge)


def _low_precision_dots(dtype: torch.dtype) -> bool:
    # The interpreter has no bf16 arithmetic (numpy): its bf16 dots come out garbage, so there a bf16
    # cache takes the float32 path; fp16 (which numpy has) tests the low-precision code on CPU.
    return dtype == torch.float16 or (dtype == torch.bfloat16 and not interpreting())


def _pow2(x: int, least: int = 1) -> int:
    return max(least, 1 << (x - 1).bit_length())


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int, softcap: float,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 partition: int | None = None, block_n: int = BLOCK_N) -> torch.Tensor:
    """q [N, H, hd] (last dim contiguous); caches [blocks, bs, KVH, hd] (int8 with scales
    [blocks, bs, KVH]); block_table [N, W]; seq_lens [N] (>= 1). Returns [N, H, hd] in q's dtype."""
    num_rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    if partition is None:  # a function of shapes only, so a captured graph keeps its grid
        partition = SMALL_PARTITION if num_rows * num_kv_heads < _FEW_PROGRAMS else PARTITION
    assert partition % block_n == 0
    group = num_heads // num_kv_heads
    out = torch.empty(num_rows, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_rows == 0:
        return out
    splits = max(1, math.ceil(block_table.shape[1] * block_size / partition))
    head_dim_p = _pow2(head_dim, 16)
    int8 = k_scale is not None
    ks = k_scale if k_scale is not None else k_cache
    vs = v_scale if v_scale is not None else v_cache
    partial, merge = _compiled()
    if splits > 1:
        acc = torch.empty(num_rows * num_heads * splits * head_dim_p, dtype=torch.float32, device=q.device)
        ml = torch.empty(num_rows * num_heads * splits * 2, dtype=torch.float32, device=q.device)
    else:
        acc = ml = out  # unused
    partial[(num_rows, num_kv_heads, splits)](
        q, k_cache, v_cache, ks, vs, block_table, seq_lens, out, acc, ml,
        float(scale), float(softcap) if softcap else 1.0, int(window),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks.stride(0) if int8 else 0, ks.stride(1) if int8 else 0, block_table.stride(0),
        out.stride(0), out.stride(1), splits,
        GROUP=group, GROUP_P=_pow2(group, _MIN_GROUP), HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, PARTITION=partition,
        INT8=int8, LOWP=_low_precision_dots(k_cache.dtype), SOFTCAP=bool(softcap),
        SINGLE=splits == 1)
    if splits > 1:
        merge[(num_rows, num_heads)](acc, ml, out, out.stride(0), out.stride(1), num_heads, splits,
                                     HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, SPLITS_P=_pow2(splits))
    return out


class TritonDecodeKernels:
    """The NativeDecodeKernels protocol (layers/kv_cache.py) on Triton: what `PagedAttention` calls for
    decode rows on a GPU (and on CPU under the interpreter, for tests)."""

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int,
                               softcap: float) -> torch.Tensor:
        return paged_decode(q, k_cache, v_cache, block_table, seq_lens, scale, window, softcap)

    def paged_decode_attention_int8(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                    k_scale: torch.Tensor, v_scale: torch.Tensor, block_table: torch.Tensor,
                                    seq_lens: torch.Tensor, scale: float, window: int,
                                    softcap: float) -> torch.Tensor:
        return paged_decode(q, k_cache, v_cache, block_table, seq_lens, scale, window, softcap, k_scale, v_scale)
