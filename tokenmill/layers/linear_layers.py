"""The Linear objects: y = x Wᵀ + b for one (maybe row-fused) weight matrix, owning its storage and
its kernel. `DenseLinear`: a float matrix and dense_kernels.py's pick; `QuantLinear`: packed q8/q4/q5/q6/iq4
segments (quant_formats.py) and one native QuantPlan call for all of them. layers/linear.py chooses
and builds them (`build_linear`); models hold them.
"""

from __future__ import annotations

import copy
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from tokenmill.kernels import QUANT_ISAS
from tokenmill.layers import quant_formats as qf
from tokenmill.layers.dense_kernels import dense_kernel, kernel_name


class Linear(ABC):
    """y = x Wᵀ + b for one (maybe row-fused) weight matrix."""

    in_features: int
    out_features: int

    @abstractmethod
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    @abstractmethod
    def method(self) -> str:
        """What runs: "aten", "onednn", "native+onednn", "q4", "q8+q4", ..."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of weight storage one call reads."""

    @property
    @abstractmethod
    def storage(self) -> tuple[torch.Tensor, ...]:
        """The tensors holding the weights (to tell shared storage apart)."""

    @property
    def relocatable(self) -> tuple[torch.Tensor, ...]:
        """Tensors `relocate` may move (layers/weight_arena.py); none unless a layer opts in."""
        return ()

    def relocate(self, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Swap each relocatable tensor for `place(tensor)` (a copy elsewhere, same values)."""
        return None

    @abstractmethod
    def first_rows(self, rows: int) -> Linear:
        """The same layer computing output rows [0, rows) only, over views of this one's storage
        (a draft's lm_head over its most frequent tokens: engine/spec/draft.py). Row r of the result
        is row r here: bit for bit for the quantized kernels (each row is computed alone), to rounding
        for dense ones (BLAS blocks a narrower matrix differently)."""


class DenseLinear(Linear):
    __slots__ = ("bias", "fn", "in_features", "out_features", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, backend: str) -> None:
        self.weight = weight
        self.bias = bias
        self.fn = dense_kernel(weight, backend)
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.weight, self.bias)

    @property
    def method(self) -> str:
        return kernel_name(self.fn)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def first_rows(self, rows: int) -> DenseLinear:
        _check_rows(rows, self.out_features)
        out = copy.copy(self)  # the kernel choice stays: it takes the weight per call
        out.weight = self.weight[:rows]
        out.bias = None if self.bias is None else self.bias[:rows]
        out.out_features = rows
        return out

    @property
    def storage(self) -> tuple[torch.Tensor, ...]:
        return (self.weight,)


class QuantLinear(Linear):
    """Packed q8/q4 segments (row ranges of the output), one native call for all of them.

    `passes`: how the kernel rounds activations. 2 (linear.ACTIVATION_PASSES, the default): two int8 vectors
    per 32-block, x ≈ d·(254·q1 + q2) with q2 the first rounding's residual at a 254x finer step (a
    15-bit activation); the kernel multiplies both by each weight block while it is in registers.
    1: plain int8 (one rounding at max|x|/127), which moved SmolLM2's greedy top-1 on 3.5% of
    positions against the float path (docs/quantization.md).

    `bf16`: whether the amx path may take its bf16 tiles for prefill-sized calls (bf16 weights and
    activations; `--amx-bf16`, never the lm_head); False (the default) keeps the integer rounding at
    every M."""

    __slots__ = ("bf16", "bias", "dtype", "highs", "in_features", "isa", "module", "offsets", "out_features",
                 "passes", "plan", "qs", "rows", "scales", "segments", "supers")

    def __init__(self, segments: list[qf.QuantMatrix], bias: torch.Tensor | None, dtype: torch.dtype,
                 module: Any, isa: str, passes: int = 2, bf16: bool = False) -> None:
        _check_passes(passes)
        self.bf16 = bf16
        self.bias = None if bias is None else bias.float().contiguous()
        self.dtype = dtype
        self.module = module
        self.isa = QUANT_ISAS.index(isa)
        self.passes = passes
        self._set_segments(segments)
        self.in_features = segments[0].cols
        self.out_features = sum(s.rows for s in segments)

    def set_passes(self, passes: int) -> None:
        """Switch the activation rounding (the plan is rebuilt; a model's native stack must rebind)."""
        _check_passes(passes)
        self.passes = passes
        self._set_segments(self.segments)

    def set_path(self, isa: str, bf16: bool) -> None:
        """Switch the kernel path (A/B benchmarks; the plan is rebuilt, a native stack must rebind)."""
        self.isa = QUANT_ISAS.index(isa)
        self.bf16 = bf16
        self._set_segments(self.segments)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # The native plan does the whole call (reshape, float32 in, bias): Python here is one frame.
        y = self.plan(x)
        return y if self.dtype is torch.float32 else y.to(self.dtype)

    @property
    def method(self) -> str:
        return "+".join(s.fmt for s in self.segments) + ("(1-pass)" if self.passes == 1 else "")

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    @property
    def storage(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.qs)

    @property
    def relocatable(self) -> tuple[torch.Tensor, ...]:
        return (*self.qs, *self.scales, *self.offsets, *self.highs, *self.supers)

    def relocate(self, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._set_segments([dataclasses.replace(s, qs=place(s.qs), scale=place(s.scale), offset=place(s.offset),
                                                high=place(s.high), supers=place(s.supers)) for s in self.segments])

    def first_rows(self, rows: int) -> QuantLinear:
        """Whole 8-row groups of the interleaved layout are views; the group holding row `rows - 1`
        keeps its padding rows, which the kernel computes and drops (QuantMatrix.rows)."""
        _check_rows(rows, self.out_features)
        segments, left = [], rows
        for s in self.segments:
            if left <= 0:
                break
            take = min(s.rows, left)
            groups = -(-take // qf.ROW_GROUP)
            segments.append(dataclasses.replace(
                s, qs=s.qs[:groups], scale=s.scale[:groups], rows=take,
                offset=s.offset[:groups] if s.offset.numel() else s.offset,
                high=s.high[:groups] if s.high.numel() else s.high,
                supers=s.supers[:, :groups] if s.supers.numel() else s.supers))
            left -= take
        bias = None if self.bias is None else self.bias[:rows]
        return QuantLinear(segments, bias, self.dtype, self.module, QUANT_ISAS[self.isa], self.passes, self.bf16)

    def _set_segments(self, segments: list[qf.QuantMatrix]) -> None:
        """The segments and, per segment, the tensors and row counts the kernel call takes."""
        self.segments = segments
        self.qs = [s.qs for s in segments]
        self.scales = [s.scale for s in segments]
        self.offsets = [s.offset for s in segments]
        self.rows = [s.rows for s in segments]
        self.highs = [s.high for s in segments]
        self.supers = [s.supers for s in segments]
        self.plan = self.plan_from(self.module)

    def plan_from(self, module: Any, convert: Callable[[qf.QuantMatrix], qf.QuantMatrix] | None = None) -> Any:
        """This layer's kernel arguments bound by `module`'s QuantPlan (benchmarks/kernel_ab.py passes
        another build of the quant kernels, and `convert`, which repacks each segment for it: e.g.
        `legacy_segment` for a build that predates super lanes)."""
        segments = [convert(s) for s in self.segments] if convert is not None else self.segments
        args = ([s.qs for s in segments], [s.scale for s in segments], [s.offset for s in segments],
                [s.rows for s in segments], self.passes, self.isa, self.bias, [s.high for s in segments],
                -1 if self.bf16 else 0)
        if any(s.supers.numel() for s in segments):
            return module.QuantPlan(*args, supers=[s.supers for s in segments])
        return module.QuantPlan(*args)


def q6_as_q8(segment: qf.QuantMatrix) -> qf.QuantMatrix:
    """A q6 segment re-rounded to q8 (Q6_K's path before q6); others as they are."""
    return qf.quantize(segment.dequantize(), "q8") if segment.fmt == "q6" else segment


def q5_offsets_as_q8(segment: qf.QuantMatrix) -> qf.QuantMatrix:
    """A q5 segment with offset lanes (Q5_1, Q5_K) re-rounded to q8 (their path before q5 took offsets)."""
    return qf.quantize(segment.dequantize(), "q8") if segment.fmt == "q5" and segment.offset.numel() else segment


def iq4_as_q8(segment: qf.QuantMatrix) -> qf.QuantMatrix:
    """An iq4 segment unpacked to q8 through its table (exact: IQ4_NL / IQ4_XS's path before iq4)."""
    return qf.iq4_as_q8(segment) if segment.fmt == "iq4" else segment


def legacy_segment(segment: qf.QuantMatrix) -> qf.QuantMatrix:
    """A segment as loads before super lanes packed it: q6, q5 with offsets and iq4 as q8, two-level q4 lanes
    multiplied out into float32 ones (the same values)."""
    return qf.expand_lanes(q6_as_q8(q5_offsets_as_q8(iq4_as_q8(segment))))


def _check_rows(rows: int, out_features: int) -> None:
    if not 0 < rows <= out_features:
        raise ValueError(f"first_rows needs 1..{out_features} rows, not {rows}")


def _check_passes(passes: int) -> None:
    if passes not in (1, 2):
        raise ValueError(f"activation passes must be 1 or 2, not {passes}")
