"""Dense float kernels of a Linear: each weight gets one once, at load, from its size.

On CPU, `F.linear` goes to MKL's sgemm, which on AVX2 hosts is slow for the wide
matrices of a decoder (measured on a 2-core EPYC, fp32, `benchmarks/cpu_kernels.py`): oneDNN's
inner-product kernel runs the lm_head 1.8-2.9x faster at 1-64 rows and the MLP up-projection
1.3-2.2x faster, while small square matrices are a tie either way. And for 1-4 rows (small-batch
decode, a pure stream over W) both libraries use one thread; the native kernel (tokenmill/kernels)
splits W over all threads and reads it ~1.7x faster. So each weight gets a kernel once, at load,
from its size; per call only the row count is checked. Both compute the same fp32 dot products in a
different summation order, so outputs differ by rounding only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill.kernels import GEMM_BACKENDS, cpu_kernels

LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

# Weights at least this large (elements) go to oneDNN under "auto": from about 6 MB of fp32 the
# matrix leaves the caches and MKL's AVX2 sgemm loses to oneDNN at every batch size measured;
# below it the two tie within noise and aten keeps the simpler path.
ONEDNN_MIN_NUMEL = 1_500_000
SKINNY_MAX_ROWS = 4


def onednn_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """bf16 only where oneDNN has bf16 kernels for this CPU (AVX512-BF16/AMX): on an AVX2 host its
    bf16 inner product has no primitive and every matmul of a `--dtype bfloat16` model raised."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available() \
            or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _aten(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def dense_kernel(weight: torch.Tensor, backend: str = "auto") -> LinearFn:
    """The kernel that will multiply by `weight` ([out, in], on its final device and dtype)."""
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"gemm backend '{backend}' is not supported: use {', '.join(GEMM_BACKENDS)}")
    if backend == "aten" or not onednn_supported(weight.device, weight.dtype):
        return _aten
    if backend == "onednn":
        return _onednn
    wide = _onednn if weight.numel() >= ONEDNN_MIN_NUMEL else _aten
    skinny = _skinny_kernel() if weight.dtype == torch.float32 and weight.is_contiguous() else None
    if skinny is None:
        return wide
    return _SkinnyOr(skinny, wide)


linear_kernel = dense_kernel  # the name tests and benchmarks/cpu_kernels.py use


class _SkinnyOr:
    """Up to SKINNY_MAX_ROWS rows (decode of a small batch): the native kernel that streams W on all
    threads (BLAS runs these on one thread: ~8 GB/s of W against ~15 GB/s here); else `wide`."""

    __slots__ = ("skinny", "wide")

    def __init__(self, skinny: LinearFn, wide: LinearFn) -> None:
        self.skinny = skinny
        self.wide = wide

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] <= SKINNY_MAX_ROWS:
            return self.skinny(x, weight, bias)
        return self.wide(x, weight, bias)


def skinny_path(fn: LinearFn) -> bool:
    """Whether `fn` sends 1-SKINNY_MAX_ROWS rows to the native skinny kernel."""
    return isinstance(fn, _SkinnyOr)


def _skinny_kernel() -> LinearFn | None:
    module = cpu_kernels()
    return None if module is None else module.skinny_linear


def kernel_name(fn: LinearFn) -> str:
    """"aten", "onednn", or "native+<wide>" where batches of up to SKINNY_MAX_ROWS rows go native."""
    if isinstance(fn, _SkinnyOr):
        return "native+" + kernel_name(fn.wide)
    return "onednn" if fn is _onednn else "aten"
