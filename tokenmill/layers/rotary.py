"""Rotary position embeddings (rotate-half layout, as in Hugging Face's Llama/Qwen2/Gemma)."""

from __future__ import annotations

import torch

RopeTables = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [T, 1, head_dim]


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
        self.sin = emb.sin().to(dtype=dtype, device=device)

    def tables(self, positions: torch.Tensor) -> RopeTables:
        """cos/sin for `positions` [T], shaped [T, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
