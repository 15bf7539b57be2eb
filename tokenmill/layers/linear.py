"""Linear layers: one object per weight matrix that owns its storage and its kernel.

    build_linear(tensors, names, bias_names, LinearConfig) → Linear        (models call only this)
        per part: choose_method(part, quantization) → a LinearMethod from LINEAR_METHODS
        "dense": a float matrix in the model dtype, multiplied by dense_kernel()'s pick
        "q8" / "q4": packed blocks (layers/quant_formats.py) and the native integer kernel
                     (kernels/quant_kernels.cpp); a fused matrix of mixed formats keeps one segment
                     per format, all written into one output in a single native call

Quantization modes (ModelConfig.quantization): "auto" keeps each GGUF tensor's own bit width
(8-bit types → q8, 4-bit types → q4, float tensors and safetensors stay dense); "none" dequantizes
everything to the model dtype (the reference path); "q8" / "q4" quantize every matrix to that
format at load, from GGUF blocks or from float. A GGUF type without a native mapping falls back to
dense with one warning naming it. Where the native module cannot build, quantized modes fall back
to dense (one warning).

Dense matrices take their kernel from layers/dense_kernels.py (oneDNN, ATen or the native skinny
kernel, picked once per weight at load). The Linear objects themselves live in layers/linear_layers.py
(re-exported here).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from tokenmill.kernels import GEMM_BACKENDS, QUANTIZATIONS, quant_isa, quant_kernels
from tokenmill.layers import gguf_quant as gq
from tokenmill.layers import quant_formats as qf
from tokenmill.layers.linear_layers import DenseLinear, Linear, QuantLinear
from tokenmill.layers.quant_formats import RawBlocks

log = logging.getLogger(__name__)

# Activation rounding passes of the quantized kernels (QuantLinear): two reach the release gate's 99%
# top-1 agreement with the float path where one int8 pass does not (docs/quantization.md).
ACTIVATION_PASSES = 2


@dataclass(frozen=True, slots=True)
class LinearConfig:
    """How a model's linear layers are built (from ModelConfig)."""

    dtype: torch.dtype
    device: torch.device
    gemm_backend: str = "auto"
    quantization: str = "auto"

    def __post_init__(self) -> None:
        if self.gemm_backend not in GEMM_BACKENDS:
            raise ValueError(f"gemm backend '{self.gemm_backend}' is not supported: use {', '.join(GEMM_BACKENDS)}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization '{self.quantization}' is not supported: use {', '.join(QUANTIZATIONS)}")


@runtime_checkable
class QuantizedSource(Protocol):
    """A tensor mapping that can also hand out stored quantized blocks (the GGUF loader's)."""

    def quantized(self, name: str) -> RawBlocks | None: ...


def raw_blocks(tensors: Mapping[str, torch.Tensor], name: str) -> RawBlocks | None:
    return tensors.quantized(name) if isinstance(tensors, QuantizedSource) else None


class RepackStore(Protocol):
    """Packed segments of quantized layers kept across processes, by checkpoint names and methods."""

    def load(self, names: Sequence[str], methods: Sequence[str]) -> list[qf.QuantMatrix] | None: ...

    def store(self, names: Sequence[str], methods: Sequence[str], segments: Sequence[qf.QuantMatrix]) -> None: ...


def repack_store(tensors: Mapping[str, torch.Tensor], config: LinearConfig) -> RepackStore | None:
    """The tensor mapping's repack cache for this quantization mode (the GGUF/safetensors loader's), if any."""
    opener = getattr(tensors, "repack_cache", None)
    return None if opener is None else opener(config.quantization)


# ---- methods and their registry ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WeightPart:
    """One checkpoint matrix that becomes (part of) a linear layer."""

    name: str
    tensors: Mapping[str, torch.Tensor]
    raw: RawBlocks | None
    dense: torch.Tensor | None = None  # already loaded (a tied lm_head shares the embedding's)

    def float_weight(self) -> torch.Tensor:
        return self.dense if self.dense is not None else self.tensors[self.name]


class LinearMethod(ABC):
    """One way to store a weight and multiply by it."""

    name: str

    @abstractmethod
    def build(self, parts: Sequence[WeightPart], bias: torch.Tensor | None, config: LinearConfig,
              precise: bool = False) -> Linear: ...


class DenseMethod(LinearMethod):
    name = "dense"

    def build(self, parts: Sequence[WeightPart], bias: torch.Tensor | None, config: LinearConfig,
              precise: bool = False) -> Linear:
        weights = [p.float_weight().to(device=config.device, dtype=config.dtype) for p in parts]
        weight = weights[0].contiguous() if len(weights) == 1 else torch.cat(weights).contiguous()
        if bias is not None:
            bias = bias.to(device=config.device, dtype=config.dtype).contiguous()
        return DenseLinear(weight, bias, config.gemm_backend)


class QuantMethod(LinearMethod):
    def __init__(self, fmt: qf.QuantFormat) -> None:
        self.name = fmt
        self.fmt: qf.QuantFormat = fmt

    def pack(self, part: WeightPart) -> qf.QuantMatrix:
        if part.raw is not None:
            return gq.from_gguf(part.raw.data, part.raw.ggml_type, part.raw.shape[1], self.fmt)
        return qf.quantize(part.float_weight(), self.fmt)

    def build(self, parts: Sequence[WeightPart], bias: torch.Tensor | None, config: LinearConfig,
              precise: bool = False) -> Linear:
        return quant_linear(qf.concat([self.pack(p) for p in parts]), bias, config, precise)


LINEAR_METHODS: dict[str, LinearMethod] = {"dense": DenseMethod(), **{f: QuantMethod(f) for f in qf.PACKED_FORMATS}}
_warned: set[str] = set()


def choose_method(part: WeightPart, shape: tuple[int, ...], config: LinearConfig) -> str:
    """The LINEAR_METHODS key for one part under config.quantization."""
    mode = config.quantization
    if mode == "none" or config.device.type != "cpu" or shape[-1] % qf.BLOCK:
        return "dense"
    if mode in qf.QUANT_FORMATS:
        return mode
    if part.raw is None:  # auto: float tensors and safetensors stay dense
        return "dense"
    # The mapping of the path that will run (build_linear falls back to dense when no module built).
    mapped = gq.gguf_format(part.raw.ggml_type, quant_isa() if quant_kernels() is not None else "portable")
    if mapped is None:
        _warn_once(f"unsupported:{part.raw.ggml_type}",
                   "GGUF tensor type %s has no native quantized kernel: tensors of this type (first: %s) "
                   "are dequantized to dense", part.raw.ggml_type.name, part.name)
        return "dense"
    if part.raw.ggml_type in gq.GGUF_REROUNDED:
        _warn_once(f"rerounded:{part.raw.ggml_type}",
                   "GGUF tensor type %s has no native kernel at its bit width: tensors of this type (first: %s) "
                   "are re-rounded to q8 (1.125 bytes a weight; one more rounding, at most half an 8-bit step)",
                   part.raw.ggml_type.name, part.name)
    return mapped[0]


def build_linear(tensors: Mapping[str, torch.Tensor], names: Sequence[str], bias_names: Sequence[str] | None,
                 config: LinearConfig, *, dense: torch.Tensor | None = None, precise: bool = False) -> Linear:
    """The linear layer for the row concatenation of `names` (+ biases), as config.quantization says.

    `dense`: the float weight when the caller already holds it (one name only). `precise`: quantized
    kernels take two-pass activations even if ACTIVATION_PASSES were 1 (see QuantLinear)."""
    wants_raw = config.quantization != "none"
    parts = [WeightPart(name, tensors, raw_blocks(tensors, name) if wants_raw else None, dense) for name in names]
    shapes = [_shape(p) for p in parts]
    methods = [choose_method(p, s, config) for p, s in zip(parts, shapes, strict=True)]
    bias = None
    if bias_names:
        bias = torch.cat([tensors[name].float() for name in bias_names])
    if "dense" not in methods and not _quant_available():
        methods = ["dense"] * len(parts)
    if "dense" in methods:  # one dense matrix: a fused layer cannot mix float and packed rows
        return LINEAR_METHODS["dense"].build(parts, bias, config)
    # The loader's on-disk cache of packed layers (models/loading/repack_cache.py): a hit skips packing.
    cache = repack_store(tensors, config)
    if cache is not None and (cached := cache.load(names, methods)) is not None:
        return quant_linear(cached, bias, config, precise)
    linear = _build_quant(parts, methods, bias, config, precise)
    if cache is not None and isinstance(linear, QuantLinear):
        cache.store(names, methods, linear.segments)
    return linear


def _build_quant(parts: Sequence[WeightPart], methods: Sequence[str], bias: torch.Tensor | None,
                 config: LinearConfig, precise: bool) -> Linear:
    if len(set(methods)) == 1:
        return LINEAR_METHODS[methods[0]].build(parts, bias, config, precise)
    # Mixed formats (e.g. q/k Q4_K with v Q6_K): one segment per format run, one native call for all.
    packed = [_method(m).pack(p) for m, p in zip(methods, parts, strict=True)]
    return quant_linear(qf.concat(packed), bias, config, precise)


def quant_linear(segments: list[qf.QuantMatrix], bias: torch.Tensor | None, config: LinearConfig,
                 precise: bool) -> QuantLinear:
    """A QuantLinear on this CPU's quant path, on the integer rounding (ModelConfig.amx_bf16 opts the
    model into bf16 tiles after load); `precise` (the lm_head): two activation passes."""
    passes = 2 if precise else ACTIVATION_PASSES
    return QuantLinear(segments, bias, config.dtype, quant_kernels(), quant_isa(), passes)


def _shape(part: WeightPart) -> tuple[int, ...]:
    # Without reading the tensor where the mapping knows shapes (the loader's LazyTensors).
    if part.raw is not None:
        return tuple(part.raw.shape)
    shape_of = getattr(part.tensors, "shape_of", None)
    if part.dense is None and shape_of is not None:
        return tuple(shape_of(part.name))
    return tuple(part.float_weight().shape)


def _method(name: str) -> QuantMethod:
    method = LINEAR_METHODS[name]
    assert isinstance(method, QuantMethod)
    return method


def _quant_available() -> bool:
    if quant_kernels() is not None:
        quant_isa()  # a bad TOKENMILL_QUANT_ISA is an error, not a silent fallback
        return True
    _warn_once("no-module", "native quantized kernels unavailable: weights are dequantized to dense")
    return False


def _warn_once(key: str, message: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)
