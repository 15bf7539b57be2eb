"""A decode step's decoder stack in one native call (kernels/stack_kernels.cpp), where every piece is native.

The Python layers of `models/llama.py` drive ten native calls per layer at batch 1; each call's
frame, pybind conversion and the views between them cost more than the small kernels themselves
(docs/performance.md). `NativeDecodeStack` binds the same kernels once (quantized-linear plans,
norm weights, KV caches) and runs all layers from C++, with the GIL released, giving bit-identical
results. It serves only steps whose every token is a decode row of the paged kernel; anything
else (a prefill chunk in the step, a cache layout without a native writer) returns None and the
caller runs the Python layers.

`build_native_stack(model)` says whether a model qualifies and why not (logged at debug level):
a Llama-family `DecoderLayer` (no q/k norms, SiLU), float32 activations on CPU, every layer linear a
quantized `QuantLinear` or a dense float32 one on the skinny kernel (then only steps of up to
SKINNY_MAX_ROWS rows: wider ones go to oneDNN/ATen in the Python layers), native norms, RoPE and
attention.
`TOKENMILL_NATIVE_STACK=0` turns it off.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.kernels import cpu_kernels, glue_kernels, quant_kernels, stack_kernels
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.dense_kernels import SKINNY_MAX_ROWS, skinny_path
from tokenmill.layers.kv_cache import DenseKVCache, Int8KVCache, LayerKVCache
from tokenmill.layers.linear_layers import DenseLinear, Linear, QuantLinear
from tokenmill.layers.norm import RMSNorm

if TYPE_CHECKING:
    from tokenmill.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

NATIVE_STACK_ENV = "TOKENMILL_NATIVE_STACK"


class NativeDecodeStack:
    """The bound native stack of one model; `__call__` runs a decode step or returns None."""

    def __init__(self, stack: Any, model: LlamaForCausalLM, max_rows: int | None) -> None:
        self.stack = stack
        self.model = model
        self.enabled = True  # benchmarks switch it off to A/B against the Python layers
        self.max_rows = max_rows  # dense weights: the skinny kernel's row limit (None: any)
        self._bound: list[LayerKVCache] | None = None
        # Called just before the native call, which holds no GIL (the engine's asynchronous scheduling
        # starts its host work there: engine/pipeline.py); None: nothing to tell.
        self.on_enter: Callable[[], None] | None = None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKVCache],
                 meta: AttentionMetadata) -> torch.Tensor | None:
        group = meta.decode
        if (not self.enabled or meta.prefill is not None or group is None or group.max_query_len != 1
                or x.dim() != 2 or x.dtype != torch.float32 or group.num_tokens != x.shape[0]
                or (self.max_rows is not None and x.shape[0] > self.max_rows)
                or (self._bound is not kv_caches and not self._bind(kv_caches))):
            self._enter()  # the Python layers run: they release the GIL op by op anyway
            return None
        cos, sin = self.model.rope_global.tables(positions)
        x = x.contiguous()
        self._enter()
        return self.stack(x, cos, sin, meta.slot_mapping, group.block_table, group.seq_lens)

    def _enter(self) -> None:
        if self.on_enter is not None:
            self.on_enter()

    def unbind(self) -> None:
        """The caches' key smoothing changed (engine/kv_calibration.py): bind them again on the next step."""
        self._bound = None

    def _bind(self, kv_caches: list[LayerKVCache]) -> bool:
        # Per layer (k, v, k_scale, v_scale, k_shift, k_inv_sigma, query_scale, v_shift, v_inv_sigma,
        # out_scale, out_shift): scales for int8, then its key and value smoothing (layers/kv_smoothing.py),
        # None where absent.
        caches: list[list[torch.Tensor | None]] = []
        for cache in kv_caches:
            if isinstance(cache, Int8KVCache) and cache.writer is not None:
                sm = cache.smoothing
                ks, vs = (sm.keys, sm.values) if sm is not None else (None, None)
                keys = [ks.shift, ks.inv_sigma, ks.head_sigma] if ks is not None else [None] * 3
                values = [vs.shift, vs.inv_sigma, vs.head_sigma, vs.head_shift] if vs is not None else [None] * 4
                caches.append([cache.k, cache.v, cache.k_scale, cache.v_scale, *keys, *values])
            elif (isinstance(cache, DenseKVCache) and cache.writer is not None
                  and cache.k.dtype in (torch.float32, torch.bfloat16, torch.float16)):
                caches.append([cache.k, cache.v, *([None] * 9)])
            else:
                log.debug("native stack off: a KV cache without a native write (%s)", type(cache).__name__)
                self.enabled = False
                return False
        self.stack.bind_caches(caches)
        self._bound = kv_caches
        return True


def build_native_stack(model: LlamaForCausalLM) -> NativeDecodeStack | None:
    """The native stack for `model`, or None where some piece is not native (the reason logged)."""
    why = _ineligible(model)
    if why is None:
        module = stack_kernels()
        modules = (glue_kernels(), cpu_kernels(), quant_kernels())
        if module is None or any(m is None or not hasattr(m, "c_api") for m in modules):
            why = "a native module did not build"
    if why is not None:
        log.debug("native decoder stack off: %s", why)
        return None
    assert module is not None
    glue, attention, quant = modules
    return stack_over(model, module, glue, attention, quant, _bound)


def stack_over(model: LlamaForCausalLM, stack_module: Any, glue: Any, attention: Any, quant: Any,
               bound: Callable[[Linear], Any]) -> NativeDecodeStack:
    """A native stack of `model` built by the given kernel modules (the model's own in build_native_stack;
    another build's in benchmarks/kernel_ab.py), each linear layer as `bound` hands it to the C++ stack."""
    from tokenmill.models.llama import DecoderLayer

    arch = model.arch
    layers = []
    dense = False
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        linears = list(layer.linears().values())  # qkv, o, gate_up, down: the order the C++ stack takes
        dense = dense or any(isinstance(lin, DenseLinear) for lin in linears)
        window = arch.sliding_window if layer.is_sliding and arch.sliding_window is not None else 0
        layers.append((*(bound(lin) for lin in linears), layer.input_layernorm.weight.data,
                       layer.post_attention_layernorm.weight.data, window))
    stack = stack_module.DecodeStack(layers, model.norm.weight.data, model.norm.eps, arch.num_heads,
                                     arch.num_kv_heads, arch.head_dim, model.attn.scale,
                                     float(arch.attn_logit_softcapping or 0.0), glue.c_api(), attention.c_api(),
                                     quant.c_api())
    return NativeDecodeStack(stack, model, SKINNY_MAX_ROWS if dense else None)


def _bound(linear: Linear) -> Any:
    """What the C++ stack takes for one linear layer: its QuantPlan, or (dense weight, bias)."""
    if isinstance(linear, QuantLinear):
        return linear.plan
    assert isinstance(linear, DenseLinear)
    return (linear.weight, linear.bias)


def _native_linear(linear: Linear) -> bool:
    if isinstance(linear, QuantLinear):
        return linear.dtype is torch.float32
    return (isinstance(linear, DenseLinear) and skinny_path(linear.fn) and linear.weight.dtype == torch.float32
            and linear.weight.is_contiguous() and (linear.bias is None or linear.bias.dtype == torch.float32))


def _ineligible(model: LlamaForCausalLM) -> str | None:
    """Why `model` cannot run the native stack, or None when it can."""
    from tokenmill.models.llama import DecoderLayer

    if os.environ.get(NATIVE_STACK_ENV, "").strip() == "0":
        return f"{NATIVE_STACK_ENV}=0"
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return "not float32 on CPU"
    if model.attn.decode_kernel is None:
        return "no native decode attention"
    if model.rope_local is not model.rope_global:
        return "two RoPE tables (local and global layers)"
    norms: list[RMSNorm] = [model.norm]
    for layer in model.layers:
        if type(layer) is not DecoderLayer or layer.has_qk_norm:
            return f"layer type {type(layer).__name__}"
        if layer.rope_kernel is None or layer.silu_mul_kernel is None or model.arch.hidden_act != "silu":
            return "no native RoPE or SwiGLU"
        for linear in layer.linears().values():
            if not _native_linear(linear):
                return f"a {linear.method} linear layer (neither quantized nor on the skinny kernel)"
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
    for norm in norms:
        if norm.native is None or norm.weight.dtype != torch.float32 or norm.offset:
            return "a norm without the native kernel"
    return None
