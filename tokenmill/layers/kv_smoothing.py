"""Calibrated per-channel smoothing for the int8 KV cache (docs/quantization.md, KV cache).

int8 keeps one scale per (token, kv head): scale = max_d |x_d| / 127. Some models' keys (Qwen2.5's
first layers above all) carry a few channels with large, nearly constant biases, so that one scale
is set by them and the other channels keep only a few levels. Smoothing stores instead

    x_d = (k_d − μ_d) · σ⁻¹_d          μ, σ per (layer, kv head, channel), fitted once at load

which centres every channel and brings them to a comparable spread before the per-row scale is
taken, and multiplies each query by σ (of its kv head, so the same σ over a GQA group):

    (q ⊙ σ) · x = q · (k − μ) = q · k − q · μ

q · μ is the same for every key a query attends, so each softmax row is unchanged: the attention is
exactly the unsmoothed one, up to the int8 rounding, which now falls on centred, equalised channels.
This holds for every reader, since every one computes q · dequantized(x): the native decode kernel
(scale times the int8 dot product), the one-call native stack, and the SDPA path over gathered,
dequantized blocks. It does not hold under a logit softcap (cap · tanh(s / cap) is not
shift-invariant), so models with one (Gemma 2) are never smoothed.

Values get the same treatment: y_d = (v_d − ν_d) · τ⁻¹_d is stored, and the attention output of each
query head is mapped back as o ⊙ τ + ν, exact because the softmax weights sum to one:
Σ_t p_t v_t = τ ⊙ Σ_t p_t y_t + ν.

σ and τ are rounded to powers of two: σ · σ⁻¹ is then exactly 1, the query and output multiplies and
the division they undo are exact in every float type (a bf16 query scaled by σ loses nothing), and
the channels' spreads still agree within a factor √2, which is all the shared scale needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A channel whose spread is this far below its head's widest one is scaled as if it were that
# small only: a dead (constant) channel must not get a huge 1/σ that would dominate the row's scale.
_DEAD_CHANNEL = 1e-2


@dataclass(frozen=True, slots=True)
class ChannelSmoothing:
    """One layer's smoothing of its keys or its values: the shift (μ or ν) and spread (σ or τ) [KVH, hd]
    and both per query head [H, hd] (a query head reads its kv head's), float32, contiguous, on the
    cache's device."""

    shift: torch.Tensor
    sigma: torch.Tensor  # powers of two
    inv_sigma: torch.Tensor  # exact
    head_sigma: torch.Tensor  # sigma.repeat_interleave(H // KVH, 0)
    head_shift: torch.Tensor  # shift.repeat_interleave(H // KVH, 0)

    @classmethod
    def from_moments(cls, mean: torch.Tensor, std: torch.Tensor, num_heads: int) -> ChannelSmoothing:
        """shift = mean; sigma = std [KVH, hd] floored at 1% of its head's widest channel, rounded to a
        power of two."""
        kvh = mean.shape[0]
        if num_heads % kvh:
            raise ValueError(f"{num_heads} query heads do not group over {kvh} kv heads")
        std = std.double().clamp(min=1e-6)
        std = torch.maximum(std, _DEAD_CHANNEL * std.amax(-1, keepdim=True))
        return cls.from_sigma(mean, torch.exp2(torch.round(torch.log2(std))), num_heads)

    @classmethod
    def from_sigma(cls, shift: torch.Tensor, sigma: torch.Tensor, num_heads: int) -> ChannelSmoothing:
        """The smoothing of a fitted shift and power-of-two sigma [KVH, hd] (as `from_moments` made them)."""
        kvh = shift.shape[0]
        if num_heads % kvh:
            raise ValueError(f"{num_heads} query heads do not group over {kvh} kv heads")
        shift, sigma, group = shift.float(), sigma.float(), num_heads // kvh
        return cls(shift.contiguous(), sigma.contiguous(), (1.0 / sigma).contiguous(),
                   sigma.repeat_interleave(group, 0).contiguous(), shift.repeat_interleave(group, 0).contiguous())

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """Rows [..., KVH, hd] → (x − shift) · sigma⁻¹ in float32: an fp32 subtract, then an fp32
        multiply (the native writer, kv_write_int8 in kernels/cpu_kernels.cpp, does the same two)."""
        return (x.float() - self.shift) * self.inv_sigma

    def restore(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of `normalize` (for simulations and tests; readers fold it into q and o instead)."""
        return x.float() * self.sigma + self.shift

    def scale_queries(self, q: torch.Tensor) -> torch.Tensor:
        """Keys' smoothing: queries [..., H, hd] times sigma of their kv head, in q's dtype (exact: a
        power of two). The native stack (kernels/stack_kernels.cpp) does the same float32 multiply."""
        return q * (self.head_sigma if q.dtype == torch.float32 else self.head_sigma.to(q.dtype))

    def restore_outputs(self, o: torch.Tensor) -> torch.Tensor:
        """Values' smoothing: attention outputs [..., H, hd] → o · sigma + shift of their kv head (a
        multiply, then an add: the native stack's two operations), in o's dtype."""
        if o.dtype == torch.float32:
            return o * self.head_sigma + self.head_shift
        return o * self.head_sigma.to(o.dtype) + self.head_shift.to(o.dtype)

    def to(self, device: torch.device) -> ChannelSmoothing:
        return ChannelSmoothing(*(t.to(device) for t in (self.shift, self.sigma, self.inv_sigma, self.head_sigma,
                                                         self.head_shift)))


@dataclass(frozen=True, slots=True)
class KVSmoothing:
    """One layer's int8 cache smoothing: keys always, values optionally."""

    keys: ChannelSmoothing
    values: ChannelSmoothing | None = None

    def to(self, device: torch.device) -> KVSmoothing:
        return KVSmoothing(self.keys.to(device), None if self.values is None else self.values.to(device))


class ChannelMoments:
    """Running per-channel sums of one layer's keys or values, on the CPU in float64 (E[k²] − μ² must not cancel
    away the spread of a channel whose mean is 30 times its standard deviation; some accelerators
    have no float64). `fit` returns CPU tensors: `ChannelSmoothing.to` moves them to the cache."""

    def __init__(self) -> None:
        self.count = 0
        self.total: torch.Tensor | None = None
        self.squares: torch.Tensor | None = None

    def add(self, x: torch.Tensor) -> None:
        """Rows [N, KVH, hd]."""
        kd = x.detach().to(device="cpu", dtype=torch.float64)
        total, squares = kd.sum(0), (kd * kd).sum(0)
        self.total = total if self.total is None else self.total + total
        self.squares = squares if self.squares is None else self.squares + squares
        self.count += x.shape[0]

    def fit(self, num_heads: int) -> ChannelSmoothing:
        if self.total is None or self.squares is None or self.count == 0:
            raise ValueError("no rows to fit a smoothing to")
        mean = self.total / self.count
        var = (self.squares / self.count - mean * mean).clamp(min=0.0)
        return ChannelSmoothing.from_moments(mean, var.sqrt(), num_heads)


def fit_smoothing(rows: torch.Tensor, num_heads: int) -> ChannelSmoothing:
    """The smoothing of one layer's keys or values from their calibration rows [N, KVH, hd], on their device."""
    moments = ChannelMoments()
    moments.add(rows)
    return moments.fit(num_heads).to(rows.device)
