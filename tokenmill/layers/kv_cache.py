"""KV cache storage of one layer: how keys and values sit in the block pool, are written and read.

Every layout keeps the same addressing: slot = block_id * block_size + offset, and writes go
through the flat [slots, ...] view with `index_copy_`.

    dense (fp32, bf16, fp16)   k, v              [num_blocks, block_size, KVH, hd]   cache dtype
    int8                       k, v              [num_blocks, block_size, KVH, hd]   int8
                               k_scale, v_scale  [num_blocks, block_size, KVH]       fp16

int8 is symmetric per (token, kv head), quantized once when the token is written:
    scale = max_d |x_d| / 127,   q_d = round(x_d / scale) in [-127, 127],   x_d ≈ q_d * scale.
The scale is fp16 (11-bit mantissa, range to 65504): an fp32 scale would cost 4 bytes per 64-wide
head instead of 2, and bf16 → int8 would no longer reach 1.9x the tokens (128 / 68 = 1.88; with
fp16, 128 / 66 = 1.94). A zero row has scale 0 and q 0.

Readers: the native CPU decode kernel reads either layout in place (kernels/cpu_kernels.cpp); the
SDPA path gathers a group's blocks and gets them back dequantized in the compute dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np
import torch

from tokenmill.kernels import cpu_kernels
from tokenmill.layers import KV_CACHE_DTYPES
from tokenmill.layers.kv_smoothing import KVSmoothing

_FP16_MAX = 65504.0


class NativeDecodeKernels(Protocol):
    """The compiled decode-attention entry points (kernels/cpu_kernels.cpp)."""

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int,
                               softcap: float) -> torch.Tensor: ...

    def paged_decode_attention_int8(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                    k_scale: torch.Tensor, v_scale: torch.Tensor, block_table: torch.Tensor,
                                    seq_lens: torch.Tensor, scale: float, window: int,
                                    softcap: float) -> torch.Tensor: ...


class NativeKVWriter(Protocol):
    """The compiled KV write (kernels/cpu_kernels.cpp): k, v [T, KVH, hd] into the caches at slots [T]."""

    def kv_write(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None: ...

    def kv_write_int8(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                      v_scale: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_shift: torch.Tensor | None = None, k_inv_sigma: torch.Tensor | None = None,
                      v_shift: torch.Tensor | None = None, v_inv_sigma: torch.Tensor | None = None) -> None: ...


class LayerKVCache(ABC):
    """Keys and values of one layer for every block of the pool."""

    k: torch.Tensor  # [num_blocks, block_size, KVH, hd]
    v: torch.Tensor

    @abstractmethod
    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, KVH, hd] of the step's tokens at `slots` [T]."""

    @abstractmethod
    def gather(self, block_table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the blocks in `block_table` [S, nb] as [S, KVH, nb * bs, hd] in `dtype`."""

    @abstractmethod
    def native_decode(self, kernels: NativeDecodeKernels, q: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, window: int, softcap: float) -> torch.Tensor:
        """One query per sequence [S, H, hd] against its keys, read in place. Returns [S, H, hd] in q's dtype."""

    def native_prefill(self, kernels: NativeDecodeKernels, q: torch.Tensor, block_table: torch.Tensor,
                       seq_lens: torch.Tensor, query_lens: torch.Tensor, scale: float,
                       window: int) -> torch.Tensor | None:
        """Causal attention of each sequence's last query_lens positions (q [T, H, hd], sequences back to
        back) over its keys read in place, [T, H, hd]; None where `kernels` has no prefill kernel for this
        cache (the caller gathers and runs SDPA instead)."""
        return None

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the layer's cache holds (for byte accounting), each indexed [block, row, ...]."""

    def copy_rows(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        """Rows (tokens, as flat indices block * block_size + row) `src_rows` into `dst_rows`, in every tensor
        (keys, values and any scales: the same bytes, so the copied tokens read as they did where they came
        from). One gather and one scatter a tensor for all of a step's copies: a beam search's step copies a
        partial block for most of its beams, and a slice copy per block and tensor was a fifth of its step."""
        for tensor in self.tensors():
            flat = tensor.view(-1, *tensor.shape[2:])
            flat.index_copy_(0, dst_rows, flat.index_select(0, src_rows))

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """The queries [T, H, hd] as every reader of this cache must see them (key smoothing scales them)."""
        return q

    def outputs(self, o: torch.Tensor) -> torch.Tensor:
        """The attention output [T, H, hd] of any reader mapped back (value smoothing scales and shifts it)."""
        return o

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class DenseKVCache(LayerKVCache):
    """`writer`: the native KV write (CPU), one call for both rows of every token, reading the fused
    projection's strided k/v views as they are; else two `index_copy_` of contiguous copies."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, writer: NativeKVWriter | None = None) -> None:
        self.k, self.v = k, v
        self.writer = writer

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.writer is not None:
            self.writer.kv_write(self.k, self.v, slots, k, v)
            return
        kv_dim = self.k.shape[2] * self.k.shape[3]
        self.k.view(-1, kv_dim).index_copy_(0, slots, k.reshape(-1, kv_dim).to(self.k.dtype))
        self.v.view(-1, kv_dim).index_copy_(0, slots, v.reshape(-1, kv_dim).to(self.v.dtype))

    def gather(self, block_table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return _gather(self.k, block_table).to(dtype), _gather(self.v, block_table).to(dtype)

    def native_decode(self, kernels: NativeDecodeKernels, q: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, window: int, softcap: float) -> torch.Tensor:
        return kernels.paged_decode_attention(q, self.k, self.v, block_table, seq_lens, scale, window, softcap)

    def native_prefill(self, kernels: NativeDecodeKernels, q: torch.Tensor, block_table: torch.Tensor,
                       seq_lens: torch.Tensor, query_lens: torch.Tensor, scale: float,
                       window: int) -> torch.Tensor | None:
        return _native_prefill(kernels, q, self.k, self.v, block_table, seq_lens, query_lens, scale, window)

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]


class Int8KVCache(LayerKVCache):
    """`writer`: the native int8 write (CPU), quantizing each (token, head) row straight from the fused
    projection's views into its slot, the same bytes as `quantize_int8`; else that plus `index_copy_`."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                 writer: NativeKVWriter | None = None) -> None:
        self.k, self.v, self.k_scale, self.v_scale = k, v, k_scale, v_scale
        self.writer = writer
        # Keys stored as (k − μ)·σ⁻¹ with queries scaled by σ, values as (v − ν)·τ⁻¹ with outputs mapped
        # back (layers/kv_smoothing.py). Set once, before the cache holds any token (engine/kv_calibration.py):
        # rows written before would mean other keys and values.
        self.smoothing: KVSmoothing | None = None

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        ks = self.smoothing.keys if self.smoothing is not None else None
        vs = self.smoothing.values if self.smoothing is not None else None
        if self.writer is not None:
            self.writer.kv_write_int8(self.k, self.v, self.k_scale, self.v_scale, slots, k, v,
                                      *((ks.shift, ks.inv_sigma) if ks is not None else (None, None)),
                                      *((vs.shift, vs.inv_sigma) if vs is not None else (None, None)))
            return
        kvh, hd = self.k.shape[2], self.k.shape[3]
        for x, cache, scales in ((k if ks is None else ks.normalize(k), self.k, self.k_scale),
                                 (v if vs is None else vs.normalize(v), self.v, self.v_scale)):
            q, s = quantize_int8(x)
            cache.view(-1, kvh * hd).index_copy_(0, slots, q.reshape(-1, kvh * hd))
            scales.view(-1, kvh).index_copy_(0, slots, s.reshape(-1, kvh))

    def gather(self, block_table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return (_gather_int8(self.k, self.k_scale, block_table, dtype),
                _gather_int8(self.v, self.v_scale, block_table, dtype))

    def native_decode(self, kernels: NativeDecodeKernels, q: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, window: int, softcap: float) -> torch.Tensor:
        return kernels.paged_decode_attention_int8(q, self.k, self.v, self.k_scale, self.v_scale, block_table,
                                                   seq_lens, scale, window, softcap)

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.k_scale, self.v_scale]

    def native_prefill(self, kernels: NativeDecodeKernels, q: torch.Tensor, block_table: torch.Tensor,
                       seq_lens: torch.Tensor, query_lens: torch.Tensor, scale: float,
                       window: int) -> torch.Tensor | None:
        return _native_prefill(kernels, q, self.k, self.v, block_table, seq_lens, query_lens, scale, window,
                               self.k_scale, self.v_scale)

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        return q if self.smoothing is None else self.smoothing.keys.scale_queries(q)

    def outputs(self, o: torch.Tensor) -> torch.Tensor:
        values = self.smoothing.values if self.smoothing is not None else None
        return o if values is None else values.restore_outputs(o)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """What one cache element is: the storage dtype of keys and values, and of their scales if quantized."""

    name: str  # one of KV_CACHE_DTYPES, "auto" resolved
    dtype: torch.dtype
    scale_dtype: torch.dtype | None = None

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> int:
        """Keys and values (and scales) of one token in one layer."""
        per_tensor = num_kv_heads * head_dim * _itemsize(self.dtype)
        if self.scale_dtype is not None:
            per_tensor += num_kv_heads * _itemsize(self.scale_dtype)
        return 2 * per_tensor

    def allocate(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 device: torch.device) -> LayerKVCache:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k, v = zeros(shape, self.dtype, device), zeros(shape, self.dtype, device)
        writer = cast(NativeKVWriter | None, cpu_kernels()) if device.type == "cpu" else None
        if self.scale_dtype is None:
            return DenseKVCache(k, v, writer)
        scale_shape = shape[:3]
        return Int8KVCache(k, v, zeros(scale_shape, self.scale_dtype, device),
                           zeros(scale_shape, self.scale_dtype, device), writer)

    def describe(self) -> str:
        if self.scale_dtype is None:
            return self.name
        return f"{self.name} (fp16 scale per token and kv head)"


_SPECS = {
    "fp32": KVCacheSpec("fp32", torch.float32),
    "bf16": KVCacheSpec("bf16", torch.bfloat16),
    "fp16": KVCacheSpec("fp16", torch.float16),
    "int8": KVCacheSpec("int8", torch.int8, torch.float16),
}
_BY_DTYPE = {spec.dtype: spec for spec in _SPECS.values() if spec.scale_dtype is None}
assert set(_SPECS) | {"auto"} == set(KV_CACHE_DTYPES)


def kv_cache_spec(name: str, model_dtype: torch.dtype) -> KVCacheSpec:
    """The cache element type for `--kv-cache-dtype name`; "auto" keeps the model's dtype."""
    if name == "auto":
        if model_dtype not in _BY_DTYPE:
            raise ValueError(f"no KV cache type for model dtype {model_dtype}")
        return _BY_DTYPE[model_dtype]
    if name not in _SPECS:
        raise ValueError(f"KV cache dtype '{name}' is not supported: use {', '.join(KV_CACHE_DTYPES)}")
    return _SPECS[name]


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., hd] → (int8 [..., hd], fp16 scale [...]) with x ≈ q * scale, symmetric over the last dim.

    q is computed against the fp16-rounded scale, so q * scale is the value every reader sees."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / 127.0).clamp(max=_FP16_MAX).to(torch.float16)
    inv = 1.0 / scale.float().clamp(min=2.0**-24)  # zero rows: scale 0, so q is irrelevant (0 * anything)
    q = torch.round(xf * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., hd] and scale [...] → [..., hd] in `dtype`; the product is exact in fp32 (7 x 11 bits)."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, KVH, hd] gathered by [S, nb] → [S, KVH, nb * bs, hd]."""
    num_seqs, num_blocks = block_table.shape
    blocks = cache.index_select(0, block_table.view(-1))  # [S * nb, bs, KVH, hd]; faster than cache[table]
    return blocks.view(num_seqs, num_blocks * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


def _gather_int8(cache: torch.Tensor, scales: torch.Tensor, block_table: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    num_seqs, num_blocks = block_table.shape
    index = block_table.view(-1)
    blocks = dequantize_int8(cache.index_select(0, index), scales.index_select(0, index), dtype)
    return blocks.view(num_seqs, num_blocks * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


_SAME_SIZE_INT = {1: np.int8, 2: np.int16, 4: np.int32}


def _native_prefill(kernels: NativeDecodeKernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, query_lens: torch.Tensor, scale: float,
                    window: int, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """The CPU module's prefill kernel (kernels/prefill_avx512.h), built only where -march=native has
    AVX-512 and on unless TOKENMILL_WIDE_ATTENTION=0; None elsewhere (the Triton kernels have none)."""
    prefill = getattr(kernels, "paged_prefill_attention", None)
    available = getattr(kernels, "prefill_attention_available", None)
    if prefill is None or available is None or not available() or q.shape[-1] % 16 != 0:
        return None
    return cast(torch.Tensor, prefill(q, k, v, block_table, seq_lens, query_lens, scale, window, k_scale, v_scale))


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV tensor. Zero matters: masked-out keys still meet `0 * V` in attention, and
    stale memory could hold NaN. On CPU numpy's calloc hands out lazily zeroed pages, so the
    cache counts towards resident memory only as blocks are first written."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(shape, dtype=_SAME_SIZE_INT[_itemsize(dtype)])).view(dtype)
