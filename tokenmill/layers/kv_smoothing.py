"""Calibrated per-channel key smoothing for the int8 KV cache (docs/quantization.md, KV cache).

int8 keeps one scale per (token, kv head): scale = max_d |k_d| / 127. Some models' keys (Qwen2.5's
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
shift-invariant), so models with one (Gemma) are never smoothed.

σ is rounded to a power of two: σ · σ⁻¹ is then exactly 1, the query multiply and the division it
undoes are exact in every float type (a bf16 query scaled by σ loses nothing), and the channels'
spreads still agree within a factor √2, which is all the shared scale needs.

Values are stored as they come: the simulation (benchmarks/kv_int8_schemes.py) measured centring
them too at no clear gain (Qwen2.5-Coder-0.5B top-1 0.986 vs 0.985, 1.5B 0.993 vs 0.996).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A channel whose spread is this far below its head's widest one is scaled as if it were that
# small only: a dead (constant) channel must not get a huge 1/σ that would dominate the row's scale.
_DEAD_CHANNEL = 1e-2


@dataclass(frozen=True, slots=True)
class KeySmoothing:
    """One layer's key smoothing: μ, σ and σ⁻¹ [KVH, hd] and σ per query head [H, hd], float32,
    contiguous, on the cache's device."""

    shift: torch.Tensor  # μ
    sigma: torch.Tensor  # σ, powers of two
    inv_sigma: torch.Tensor  # σ⁻¹, exact
    query_scale: torch.Tensor  # σ of each query head's kv head: sigma.repeat_interleave(H // KVH, 0)

    @classmethod
    def from_moments(cls, mean: torch.Tensor, std: torch.Tensor, num_heads: int) -> KeySmoothing:
        """μ = mean; σ = std [KVH, hd] floored at 1% of its head's widest channel, rounded to a power of two."""
        kvh = mean.shape[0]
        if num_heads % kvh:
            raise ValueError(f"{num_heads} query heads do not group over {kvh} kv heads")
        std = std.double().clamp(min=1e-6)
        std = torch.maximum(std, _DEAD_CHANNEL * std.amax(-1, keepdim=True))
        sigma = torch.exp2(torch.round(torch.log2(std))).float()
        return cls(mean.float().contiguous(), sigma.contiguous(), (1.0 / sigma).contiguous(),
                   sigma.repeat_interleave(num_heads // kvh, 0).contiguous())

    def normalize(self, k: torch.Tensor) -> torch.Tensor:
        """Keys [..., KVH, hd] → (k − μ) · σ⁻¹ in float32: an fp32 subtract, then an fp32 multiply
        (the native writer, kv_write_int8 in kernels/cpu_kernels.cpp, does the same two operations)."""
        return (k.float() - self.shift) * self.inv_sigma

    def restore(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of `normalize` (for simulations and tests; readers scale the queries instead)."""
        return x.float() * self.sigma + self.shift

    def scale_queries(self, q: torch.Tensor) -> torch.Tensor:
        """Queries [..., H, hd] times σ of their kv head, in q's dtype (exact: σ is a power of two).
        The native stack (kernels/stack_kernels.cpp) does the same float32 multiply."""
        scale = self.query_scale if q.dtype == torch.float32 else self.query_scale.to(q.dtype)
        return q * scale

    def to(self, device: torch.device) -> KeySmoothing:
        return KeySmoothing(*(t.to(device) for t in (self.shift, self.sigma, self.inv_sigma, self.query_scale)))


class KeyMoments:
    """Running per-channel sums of one layer's keys, on the CPU in float64 (E[k²] − μ² must not cancel
    away the spread of a channel whose mean is 30 times its standard deviation; some accelerators
    have no float64). `fit` returns CPU tensors: `KeySmoothing.to` moves them to the cache."""

    def __init__(self) -> None:
        self.count = 0
        self.total: torch.Tensor | None = None
        self.squares: torch.Tensor | None = None

    def add(self, k: torch.Tensor) -> None:
        """Keys [N, KVH, hd]."""
        kd = k.detach().to(device="cpu", dtype=torch.float64)
        total, squares = kd.sum(0), (kd * kd).sum(0)
        self.total = total if self.total is None else self.total + total
        self.squares = squares if self.squares is None else self.squares + squares
        self.count += k.shape[0]

    def fit(self, num_heads: int) -> KeySmoothing:
        if self.total is None or self.squares is None or self.count == 0:
            raise ValueError("no keys to fit a smoothing to")
        mean = self.total / self.count
        var = (self.squares / self.count - mean * mean).clamp(min=0.0)
        return KeySmoothing.from_moments(mean, var.sqrt(), num_heads)


def fit_key_smoothing(keys: torch.Tensor, num_heads: int) -> KeySmoothing:
    """The smoothing of one layer from its calibration keys [N, KVH, hd], on their device."""
    moments = KeyMoments()
    moments.add(keys)
    return moments.fit(num_heads).to(keys.device)
