"""The decoder stack under torch.compile: ATen glue fused by Inductor around opaque native ops.

`CompiledStack` re-states a model's decoder layers (Llama family and Gemma 3) in plain ATen ops —
RMSNorm, residual adds, RoPE, the gated activation — so Inductor can fuse them, while every GEMM
and the paged attention (its KV write included) stay single opaque nodes, the native kernels as
`tokenmill::` custom ops (layers/custom_ops.py). One graph covers the whole stack, final norm
included; the embedding and the lm_head stay outside. The token dimension is marked dynamic: one
graph serves every token count of two or more, and one more is traced for single-token steps
(Dynamo specializes sizes 0 and 1). `fullgraph=True`: a graph break is a failure, never a silent half-compiled stack.

Inductor's FX graph cache (and AOTAutograd's) lives under `$TOKENMILL_HOME/inductor` unless
`TORCHINDUCTOR_CACHE_DIR` is set, so a restart re-traces (Dynamo has no persistent cache) but does
not regenerate or recompile the C++ kernels.

It runs only for steps the native decode stack (models/native_stack.py) does not take: that stack
is one C++ call for a whole decode step, which no graph of Python-visible ops can beat. A compile
or a compiled call that raises logs one warning and leaves the model on its eager layers for good.

`ModelConfig.compile`: "on", "off", or "auto" = COMPILE_AUTO_DEFAULT, off on CPU, where the native
glue kernels already fuse the same ops and the compiled stack measured no faster
(benchmarks/compile_cpu.py, docs/performance.md).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from types import FunctionType, MethodType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tokenmill.layers import custom_ops
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.kv_cache import LayerKVCache
from tokenmill.layers.norm import RMSNorm

if TYPE_CHECKING:
    from tokenmill.models.llama import DecoderLayer, LlamaForCausalLM

log = logging.getLogger(__name__)

COMPILE_AUTO_DEFAULT = False  # what "auto" means on CPU (the only device the compiled stack serves)


def compile_enabled(mode: str, device: torch.device) -> bool:
    """Whether `mode` (ModelConfig.compile, validated there) asks for the compiled stack on `device`."""
    return mode == "on" or (mode == "auto" and device.type == "cpu" and COMPILE_AUTO_DEFAULT)


def inductor_cache_dir() -> str:
    """Where Inductor keeps its caches: `$TORCHINDUCTOR_CACHE_DIR`, else `$TOKENMILL_HOME/inductor`."""
    from tokenmill.models.pull import tokenmill_home

    # Set before the first compile of the process: Inductor reads it then and keeps it in the environment.
    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tokenmill_home() / "inductor"))


class CompiledStack:
    """The compiled decoder stack of one model; `__call__` runs a step or returns None (eager)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        from tokenmill.models.gemma3 import Gemma3DecoderLayer

        self.model = model
        self.gemma = [isinstance(layer, Gemma3DecoderLayer) for layer in model.layers]
        self.sliding = [bool(layer.is_sliding) for layer in model.layers]
        # Handles into the op registries, per layer (qkv, o, gate_up, down), then the attention site.
        self.linear_handles = [tuple(custom_ops.register_linear(lin) for lin in _layer(layer).linears().values())
                               for layer in model.layers]
        self.site = custom_ops.AttentionSite(model.attn, tuple(self.sliding))
        self.site_handle = custom_ops.register_attention(self.site)
        handles = [h for hs in self.linear_handles for h in hs] + [self.site_handle]
        weakref.finalize(self, custom_ops.unregister, handles)
        self.failed = False
        self.calls = 0  # compiled steps run (tests)
        inductor_cache_dir()
        # dynamic=False (the token dimension is marked dynamic per call): otherwise Dynamo's automatic
        # dynamic shapes turn the handle constants, which differ between two models' stacks, into
        # symbolic ints on a recompile, and the ops' fake implementations cannot look those up.
        self._fn = torch.compile(_own_code(self._stack), dynamic=False, fullgraph=True)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKVCache],
                 meta: AttentionMetadata) -> torch.Tensor | None:
        if self.failed:
            return None
        model = self.model
        tables = [model.rope_global.cos, model.rope_global.sin, model.rope_local.cos, model.rope_local.sin]
        self.site.kv_caches, self.site.meta = kv_caches, meta
        for t in (x, positions, meta.slot_mapping):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        try:
            hidden = self._fn(x, positions, [kv.tensors() for kv in kv_caches], meta.slot_mapping, tables)
        except Exception as e:  # a compiler or backend failure costs speed, not service
            log.warning("torch.compile of the decoder stack failed (%s: %s); the model runs eagerly from now on",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self.failed = True
            return None
        finally:
            self.site.kv_caches, self.site.meta = None, None
        self.calls += 1
        return hidden

    def _stack(self, x: torch.Tensor, positions: torch.Tensor, caches: list[list[torch.Tensor]],
               slot_mapping: torch.Tensor, tables: list[torch.Tensor]) -> torch.Tensor:
        cos_g, sin_g, cos_l, sin_l = (t.index_select(0, positions).unsqueeze(1) for t in tables)
        for i, layer in enumerate(self.model.layers):
            rope = (cos_l, sin_l) if self.sliding[i] else (cos_g, sin_g)
            x = self._layer(i, _layer(layer), x, rope, caches[i], slot_mapping)
        return _norm(self.model.norm, x)

    def _layer(self, i: int, layer: DecoderLayer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               cache: list[torch.Tensor], slot_mapping: torch.Tensor) -> torch.Tensor:
        h_qkv, h_o, h_gate_up, h_down = self.linear_handles[i]
        arch, norms = self.model.arch, layer.norms()
        heads = custom_ops.linear(_norm(norms["input_layernorm"], x), h_qkv)
        heads = heads.view(-1, arch.num_heads + 2 * arch.num_kv_heads, arch.head_dim)
        q = heads[:, :arch.num_heads]
        k = heads[:, arch.num_heads:arch.num_heads + arch.num_kv_heads]
        v = heads[:, arch.num_heads + arch.num_kv_heads:]
        if self.gemma[i]:
            q, k = _norm(norms["self_attn.q_norm"], q), _norm(norms["self_attn.k_norm"], k)
        q, k = _rope(q, *rope), _rope(k, *rope)
        attended = custom_ops.linear(
            custom_ops.paged_attention(q, k, v, cache, slot_mapping, self.site_handle, i), h_o)
        if self.gemma[i]:  # sandwich norms around attention and MLP (models/gemma3.py)
            h = x + _norm(norms["post_attention_layernorm"], attended)
            mlp = self._mlp(layer, _norm(norms["pre_feedforward_layernorm"], h), h_gate_up, h_down)
            return h + _norm(norms["post_feedforward_layernorm"], mlp)
        h = x + attended
        return h + self._mlp(layer, _norm(norms["post_attention_layernorm"], h), h_gate_up, h_down)

    def _mlp(self, layer: DecoderLayer, x: torch.Tensor, h_gate_up: int, h_down: int) -> torch.Tensor:
        gate, up = custom_ops.linear(x, h_gate_up).chunk(2, dim=-1)
        return custom_ops.linear(layer.act(gate) * up, h_down)  # the layer's own activation, traced


def _own_code(method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`method` bound over a private copy of its code object. Dynamo keeps compiled graphs, and counts
    recompiles against its limit of 8, per code object: shared by every model's stack (two models in
    a test session, a draft model beside its target) they would exhaust it and compile nothing more.
    A copy gives each stack its own graphs, collected with it."""
    assert isinstance(method, MethodType)
    fn = method.__func__
    copy = FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return MethodType(copy, method.__self__)


def _norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    # RMSNorm.forward's ATen branch (Gemma's folded 1 + w is float32: normalise in float32, cast back).
    if norm.offset:
        return F.rms_norm(x.float(), norm.weight.shape, norm.weight, norm.eps).to(x.dtype)
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _layer(layer: torch.nn.Module) -> DecoderLayer:
    return layer  # type: ignore[return-value]


def _ineligible(model: LlamaForCausalLM) -> str | None:
    from tokenmill.models.gemma3 import Gemma3DecoderLayer
    from tokenmill.models.llama import DecoderLayer

    if model.device.type != "cpu":
        return f"the compiled stack serves CPU only (device {model.device.type}; CUDA has graphs and Triton glue)"
    for layer in model.layers:
        if type(layer) not in (DecoderLayer, Gemma3DecoderLayer):
            return f"layer type {type(layer).__name__}"
        for lin in _layer(layer).linears().values():
            try:
                custom_ops.linear_out_dtype(lin)
            except AssertionError:
                return f"a {type(lin).__name__} linear layer"
    return None


def build_compiled_stack(model: LlamaForCausalLM, mode: str) -> CompiledStack | None:
    """The compiled stack where `mode` asks for it and the model qualifies; else None (eager, the
    reason logged: a warning when "on" was asked for explicitly)."""
    if not compile_enabled(mode, model.device):
        return None
    why = _ineligible(model)
    if why is not None:
        (log.warning if mode == "on" else log.info)("torch.compile off: %s; the model runs eagerly", why)
        return None
    return CompiledStack(model)
