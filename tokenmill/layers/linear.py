"""Dense GEMM dispatch: y = x Wᵀ + b through the faster of the kernels the device has.

Why this exists: on CPU, `F.linear` goes to MKL's sgemm, which on AVX2 hosts is slow for the
wide matrices of a decoder (measured on a 2-core EPYC, fp32, `benchmarks/gemm_backends.py`):
oneDNN's inner-product kernel runs the lm_head 1.8-2.9x faster at 1-64 rows and the MLP
up-projection 1.3-2.2x faster, while small square matrices are a tie either way. So each weight
gets a kernel once, at load, from its size; the per-call cost is one attribute lookup.

Both kernels compute the same fp32 dot products in a different summation order, so outputs differ
by rounding only (parity tests hold them to 1e-4 of transformers either way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

GemmBackend = Literal["auto", "aten", "onednn"]
GEMM_BACKENDS: tuple[str, ...] = ("auto", "aten", "onednn")

LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

# Weights at least this large (elements) go to oneDNN under "auto": from about 6 MB of fp32 the
# matrix leaves the caches and MKL's AVX2 sgemm loses to oneDNN at every batch size measured;
# below it the two tie within noise and aten keeps the simpler path.
ONEDNN_MIN_NUMEL = 1_500_000


def onednn_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _aten(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def linear_kernel(weight: torch.Tensor, backend: str = "auto") -> LinearFn:
    """The kernel that will multiply by `weight` ([out, in], on its final device and dtype)."""
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"gemm backend '{backend}' is not supported: use {', '.join(GEMM_BACKENDS)}")
    if backend == "aten" or not onednn_supported(weight.device, weight.dtype):
        return _aten
    if backend == "onednn" or weight.numel() >= ONEDNN_MIN_NUMEL:
        return _onednn
    return _aten


def kernel_name(fn: LinearFn) -> str:
    return "onednn" if fn is _onednn else "aten"
