"""RMSNorm in the two conventions we load: Llama's `w * x̂` and Gemma's `(1 + w) * x̂`."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import glue_kernels


class RMSNorm(nn.Module):
    """x̂ = x / sqrt(mean(x²) + eps), computed in float32 as Hugging Face does, then scaled.

    Gemma stores the scale as an offset from one; we fold the `1 +` into the weight at load
    time (`offset=1.0`), so the hot path is the same multiply for every architecture.

    On CPU with float32 activations the native kernel (kernels/glue_kernels.cpp) does it in one
    call, and `add_forward` fuses the residual add in front; elsewhere the same math in ATen.
    """

    native: ModuleType | None = None
    triton_glue: ModuleType | None = None  # kernels/triton_glue.py on CUDA (LlamaForCausalLM.use_triton_glue)

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def load(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        # Gemma's `1 + w` is formed in float32 and kept there, as Hugging Face does.
        folded = weight.float() + self.offset
        self.weight.data = folded if self.offset else folded.to(dtype)
        self.native = glue_kernels() if weight.device.type == "cpu" and self.weight.dtype == torch.float32 else None

    def _native_ok(self, x: torch.Tensor) -> bool:
        return self.native is not None and x.dtype == torch.float32 and x.is_contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton_glue is not None and x.dim() == 2 and x.stride(-1) == 1:
            return self.triton_glue.rms_norm(x, self.weight, self.eps)
        if self._native_ok(x):
            assert self.native is not None
            return self.native.rms_norm(x, self.weight, self.eps)
        # One fused kernel instead of HF's six ops; in float32 the result is bit-identical.
        if self.offset:
            # Gemma multiplies by (1 + w) in float32 before the cast back; keep that order.
            return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x (in place: the caller's residual stream), then the norm of the sum."""
        if self.triton_glue is not None and x.dim() == 2 and x.stride(-1) == 1 and residual.stride(-1) == 1:
            return self.triton_glue.rms_norm(x, self.weight, self.eps, residual)
        if self._native_ok(x) and residual.dtype == torch.float32 and residual.is_contiguous():
            assert self.native is not None
            return self.native.add_rms_norm(x, residual, self.weight, self.eps)
        residual += x
        return self(residual)
