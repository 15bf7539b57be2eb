"""The engine's opaque kernels as `torch.library` custom ops (namespace `tokenmill::`), for torch.compile.

Dynamo cannot trace into a pybind kernel (a QuantPlan, the skinny GEMM, the paged decode kernel):
called directly, each one breaks the graph. As custom ops with fake (shape-only) implementations
they stay single nodes of one graph, and Inductor fuses the ATen glue between them
(models/compiled.py).

    tokenmill::linear(x, handle) -> y                    one `Linear` (layers/linear.py), dense or
                                                          quantized, by its registry handle
    tokenmill::paged_attention(q, k, v, cache, slots,    PagedAttention over one layer's LayerKVCache,
                               handle, layer) -> out      KV write included: `cache` (the layer's
                                                          tensors, int8 scales too) is declared mutated

Why handles: a Linear's kernel is a Python object (a bound QuantPlan, a dense kernel picked per
row count), not something a schema can carry, and the attention call needs the step's
`AttentionMetadata` (masks, block tables, group bounds) that only the runner builds. So the graph
holds integer handles, constants baked into it, into registries that the owner (a
`models/compiled.CompiledStack`) fills at build time and empties when it is collected; the
step's metadata is set on the attention registry entry for the duration of one compiled call.
What an op reads or writes as tensors is in its signature: the input activations, and for
attention the cache tensors it mutates and the slot mapping of the write. Handles are allocated in
order, so a restart that builds the same model gets the same constants and the same FX-cache key.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.layers.attention import AttentionMetadata, PagedAttention
from tokenmill.layers.kv_cache import LayerKVCache
from tokenmill.layers.linear_layers import DenseLinear, Linear, QuantLinear

_handles = itertools.count(1)
_LINEARS: dict[int, Linear] = {}


@dataclass(slots=True)
class AttentionSite:
    """One model's attention, and the step its compiled call is running (set only during the call)."""

    attn: PagedAttention
    sliding: tuple[bool, ...]  # per layer: whether it takes the sliding-window mask
    kv_caches: list[LayerKVCache] | None = None
    meta: AttentionMetadata | None = None


_SITES: dict[int, AttentionSite] = {}


def register_linear(linear: Linear) -> int:
    handle = next(_handles)
    _LINEARS[handle] = linear
    return handle


def register_attention(site: AttentionSite) -> int:
    handle = next(_handles)
    _SITES[handle] = site
    return handle


def unregister(handles: Sequence[int]) -> None:
    for handle in handles:
        _LINEARS.pop(handle, None)
        _SITES.pop(handle, None)


def linear_out_dtype(linear: Linear) -> torch.dtype:
    if isinstance(linear, QuantLinear):
        return linear.dtype
    assert isinstance(linear, DenseLinear), f"no output dtype known for {type(linear).__name__}"
    return linear.weight.dtype


@torch.library.custom_op("tokenmill::linear", mutates_args=())
def linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    return _LINEARS[handle](x)


@linear.register_fake
def _(x: torch.Tensor, handle: int) -> torch.Tensor:
    lin = _LINEARS[handle]
    return x.new_empty((*x.shape[:-1], lin.out_features), dtype=linear_out_dtype(lin))


@torch.library.custom_op("tokenmill::paged_attention", mutates_args=("cache",))
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: list[torch.Tensor],
                    slot_mapping: torch.Tensor, handle: int, layer: int) -> torch.Tensor:
    """q [T, H, hd], k/v [T, KVH, hd] → [T, H * hd]; writes k and v into `cache` (the layer's
    `LayerKVCache.tensors()`) at `slot_mapping` first."""
    site = _SITES[handle]
    assert site.kv_caches is not None and site.meta is not None, "paged_attention outside a compiled step"
    kv, meta = site.kv_caches[layer], site.meta
    # Under Inductor these are the layer's own tensors (its reinplacing pass writes them in place); a
    # backend that functionalizes without reinplacing (aot_eager, opcheck) passes copies and copies
    # them back afterwards, so the write must land in what was passed, not in the layer's cache.
    if any(a is not b for a, b in zip(cache, kv.tensors(), strict=True)):
        kv = _over(kv, cache)
    if slot_mapping is not meta.slot_mapping:
        meta = dataclasses.replace(meta, slot_mapping=slot_mapping)
    return site.attn(q, k, v, kv, meta, site.sliding[layer])


def _over(kv: LayerKVCache, tensors: list[torch.Tensor]) -> LayerKVCache:
    """`kv` (its writer, its smoothing) over other tensors of the same layout, in `tensors()` order."""
    view = copy.copy(kv)
    for name, tensor in zip(("k", "v", "k_scale", "v_scale"), tensors, strict=False):
        setattr(view, name, tensor)
    assert all(a is b for a, b in zip(view.tensors(), tensors, strict=True))
    return view


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: list[torch.Tensor], slot_mapping: torch.Tensor,
      handle: int, layer: int) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))
