"""Paged attention over the block KV cache, in plain PyTorch (SDPA), device-agnostic.

KV cache layout, per layer a `LayerKVCache` (layers/kv_cache.py): keys and values, plus their
scales when int8, all addressed by

    cache[num_blocks, block_size, num_kv_heads, head_dim]
    slot s = block_id * block_size + offset   (the flat view used for writes)

A step's tokens are flattened: first the decode group, then the prefill chunks back to back.
Attention runs once per group, never once per request:
  * decode group:  one row per query token with its own block-table row and length: a plain decode
                   is one row; a request verifying k proposals (or a draft model catching up) brings
                   1 + k rows over the same table with lengths p + 1 .. p + k + 1, i.e. causal
                   attention as k + 1 independent decodes (engine/model_input.py). The native CPU
                   kernel reads keys and values in place through the block table
                   (kernels/cpu_kernels.cpp); elsewhere q [D, H, 1, hd] against keys
                   gathered (and dequantized) through the block table [D, Lk]
  * prefill group: on CPU builds with AVX-512, flash attention over the keys read in place
                   (kernels/prefill_avx512.h); elsewhere q padded to [P, H, Lq_max, hd] against keys
                   gathered the same way
Masks are built at most once per step (by the runner, or on first use for a prefill group) and shared
by all layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from tokenmill.errors import TokenmillError
from tokenmill.kernels import ATTENTION_BACKENDS, cpu_kernels, triton_available
from tokenmill.layers.kv_cache import LayerKVCache, NativeDecodeKernels


@dataclass(slots=True)
class GroupMetadata:
    """One attention group (decode or prefill) of a step."""

    block_table: torch.Tensor  # [S, max_blocks] int64 block ids (padding rows point at block 0)
    seq_lens: torch.Tensor  # [S] int64 keys per sequence after this step (context + new tokens)
    mask: torch.Tensor | None  # [S, 1, Lq, Lk] bool: True where the query may attend the key (None: the
    # group is served by the paged decode kernel, which needs none)
    sliding_mask: torch.Tensor | None  # same with the sliding window applied (Gemma local layers)
    token_start: int  # first flat token index of the group
    num_tokens: int  # real tokens in the group
    max_query_len: int
    pad_index: torch.Tensor | None  # [num_tokens] position of each token in the padded [S*Lq] layout
    query_lens: torch.Tensor | None = None  # [S] int64 query tokens per sequence (prefill groups: the
    # native prefill kernel takes the group's rows as they are, no padding)
    build_masks: Callable[[], tuple[torch.Tensor, torch.Tensor | None]] | None = None  # (mask, sliding_mask)
    # built on first use: the runner leaves a prefill group's masks to this, since the native prefill
    # kernel never reads them

    @property
    def has_mask(self) -> bool:
        return self.mask is not None or self.build_masks is not None

    def dense_mask(self, is_sliding: bool) -> torch.Tensor:
        """The group's mask for SDPA (the sliding one on a local layer), built now if it is deferred."""
        if self.mask is None and self.build_masks is not None:
            self.mask, self.sliding_mask = self.build_masks()
            self.build_masks = None
        mask = self.sliding_mask if is_sliding and self.sliding_mask is not None else self.mask
        assert mask is not None, "the runner builds masks for every group the decode kernel does not serve"
        return mask


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64 cache slot of every token of the step
    decode: GroupMetadata | None
    prefill: GroupMetadata | None


def decode_kernel(backend: str, device: torch.device) -> NativeDecodeKernels | None:
    """The paged decode kernel for `backend` on `device`, or None for the SDPA path (gather + mask).

    "auto": the native kernel on CPU where it builds (2.1-2.6x faster than gather + SDPA at 64
    sequences, 1.6x at 16; see benchmarks/cpu_kernels.py), the Triton kernel on CUDA where Triton
    imports, else SDPA. "native" / "triton": required, an error where it cannot run (Triton on CPU
    only under its interpreter, for tests)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend '{backend}' is not supported: use {', '.join(ATTENTION_BACKENDS)}")
    if backend == "sdpa":
        return None
    if backend == "triton" or (backend == "auto" and device.type == "cuda"):
        return _triton_kernels(device, required=backend == "triton")
    if backend == "auto" and device.type != "cpu":
        return None
    module = cpu_kernels() if device.type == "cpu" else None
    if module is None:
        if backend == "native":
            raise TokenmillError("attention backend 'native' needs the CPU kernel, which cannot be built here "
                                 "(see the warning above); use --attention-backend sdpa")
        return None
    return cast(NativeDecodeKernels, module)


def _triton_kernels(device: torch.device, required: bool) -> NativeDecodeKernels | None:
    if not triton_available():
        if required:
            raise TokenmillError("attention backend 'triton' needs the triton package; use --attention-backend sdpa")
        return None
    from tokenmill.kernels.triton_attention import TritonDecodeKernels, interpreting

    if device.type != "cuda" and not interpreting():
        if required:
            raise TokenmillError("attention backend 'triton' runs on CUDA devices (on CPU only under "
                                 "TRITON_INTERPRET=1, for tests)")
        return None
    return TritonDecodeKernels()


class PagedAttention:
    """Stateless: the caches are passed in, so one instance serves every layer."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 logit_softcap: float | None, sliding_window: int | None = None,
                 decode_kernel: NativeDecodeKernels | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.logit_softcap = logit_softcap
        self.sliding_window = sliding_window
        self.decode_kernel = decode_kernel

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                 meta: AttentionMetadata, is_sliding: bool, written: bool = False) -> torch.Tensor:
        """q: [T, H, hd]; k, v: [T, KVH, hd]. Returns [T, H * hd]. `written`: k and v are already in
        the cache (the fused RoPE + KV write of kernels/triton_glue.py)."""
        if not written:
            cache.write(meta.slot_mapping, k, v)
        q = cache.queries(q)  # int8 key smoothing: q · σ against keys stored as (k − μ)·σ⁻¹ (kv_smoothing.py)
        groups = [g for g in (meta.decode, meta.prefill) if g is not None]
        if len(groups) == 1:  # all decodes or all prefill: no scatter into a shared output
            return cache.outputs(self._group(q, cache, groups[0], is_sliding)).reshape(q.shape[0], -1)
        out = torch.empty_like(q)
        for group in groups:
            sl = slice(group.token_start, group.token_start + group.num_tokens)
            out[sl] = self._group(q[sl], cache, group, is_sliding)
        return cache.outputs(out).view(q.shape[0], -1)  # int8 value smoothing: o · τ + ν

    def _group(self, q: torch.Tensor, cache: LayerKVCache, group: GroupMetadata, is_sliding: bool) -> torch.Tensor:
        window = self.sliding_window if is_sliding and self.sliding_window is not None else 0
        if self.decode_kernel is not None and group.max_query_len == 1:
            return cache.native_decode(self.decode_kernel, q, group.block_table, group.seq_lens, self.scale, window,
                                       self.logit_softcap or 0.0)
        if self.decode_kernel is not None and group.query_lens is not None and self.logit_softcap is None:
            out = cache.native_prefill(self.decode_kernel, q, group.block_table, group.seq_lens, group.query_lens,
                                       self.scale, window)
            if out is not None:
                return out
        num_seqs = group.block_table.shape[0]
        q_pad = _pad_queries(q, group, num_seqs).transpose(1, 2)  # [S, H, Lq, hd]
        keys, values = cache.gather(group.block_table, q.dtype)  # [S, KVH, Lk, hd]
        mask = group.dense_mask(is_sliding)
        if self.logit_softcap is None:
            out = F.scaled_dot_product_attention(q_pad, keys, values, attn_mask=mask, scale=self.scale,
                                                 enable_gqa=self.num_kv_heads != self.num_heads)
        else:
            out = self._softcapped(q_pad, keys, values, mask)
        out = out.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)
        return out if group.pad_index is None else out[group.pad_index]

    def _softcapped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
        # scores = cap * tanh(qk·scale / cap); SDPA has no hook for it, so do the math path.
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        assert self.logit_softcap is not None
        scores = torch.tanh(scores / self.logit_softcap) * self.logit_softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)


def _pad_queries(q: torch.Tensor, group: GroupMetadata, num_seqs: int) -> torch.Tensor:
    if group.pad_index is None:  # already [S * Lq] rows: one query per sequence, or a lone prefill
        return q.view(num_seqs, group.max_query_len, q.shape[1], q.shape[2])
    padded = q.new_zeros(num_seqs * group.max_query_len, q.shape[1], q.shape[2])
    padded[group.pad_index] = q
    return padded.view(num_seqs, group.max_query_len, q.shape[1], q.shape[2])

