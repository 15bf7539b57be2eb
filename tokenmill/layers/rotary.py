"""Rotary position embeddings (rotate-half layout, as in Hugging Face's Llama/Qwen2/Gemma)."""

from __future__ import annotations

from types import ModuleType

import torch

RopeTables = tuple[torch.Tensor, torch.Tensor]  # (cos, signed sin), each [T, 1, head_dim]


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by absolute position.

    For position p and frequency f_i = theta^(-2i/d) / scale, the pair (x_i, x_{i+d/2}) is rotated
    by angle p·f_i. Tables are built in float32 and cast once to the model dtype.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling_factor: float,
                 dtype: torch.dtype, device: torch.device) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        inv_freq = inv_freq / scaling_factor
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((angles, angles), dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)
        # rotate_half(x) = cat(-x2, x1) = roll(x, d/2) * [-1…, +1…]: fold the signs into sin.
        sin = emb.sin()
        half = head_dim // 2
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(dtype=dtype, device=device)

    def tables(self, positions: torch.Tensor) -> RopeTables:
        """cos/sin for `positions` [T], shaped [T, 1, head_dim] to broadcast over heads."""
        # index_select: the same rows as cos[positions], in ~60% of advanced indexing's time here
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                 native: ModuleType | None = None) -> torch.Tensor:
    """x: [T, heads, head_dim] → x·cos + rotate_half(x)·sin: in three ATen ops, or with `native`
    (kernels/glue_kernels.cpp) in place, in one call, where x is float32 with contiguous heads."""
    if (native is not None and x.dtype == torch.float32 and cos.dtype == torch.float32 and x.stride(-1) == 1
            and x.stride(1) == x.shape[-1] and cos.is_contiguous() and signed_sin.is_contiguous()):
        native.rope_(x, cos, signed_sin)
        return x
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
