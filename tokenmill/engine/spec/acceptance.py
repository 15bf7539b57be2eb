"""How far a proposal of a given kind is accepted, position by position, learned from verified drafts.

A proposer sorts each proposal into a bucket by what it knows of its quality (the n-gram proposer: the
length of the suffix it matched; a proposal from a 4-token match continues a copied span, one from a
1-token match is a guess). Measured on the code-edit bench (Qwen2.5-Coder-0.5B, docs/speculative.md):
4-token matches had 93% of their proposed tokens accepted, 1-token matches 15%. One acceptance rate
per request averages the two and proposes the same k for both.

Per bucket b and position j the model keeps decayed counts of drafts that reached position j and of
those whose token j was accepted, so a_{b,j} = P(token j accepted | tokens 1..j-1 were). A draft of
k tokens with `acc` accepted reached positions 1..min(k, acc + 1) and was accepted at 1..acc; the
positions after the first rejection are never scored, so they teach nothing. The expected gain of a
request's j-th proposal is the chance the verification gets that far and accepts it,

    gain(b, j) = a_{b,1} · a_{b,2} · … · a_{b,j}

and proposing k tokens emits 1 + gain(b, 1) + … + gain(b, k) tokens on average. Where a bucket and
position has few counts, a prior pulls it towards the position before it (towards the prior
acceptance for position 1), so an unseen bucket starts as plausible and a long tail inherits the
rate of the positions measured before it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

_PRIOR_WEIGHT = 2.0  # pseudo-drafts of the prior in each estimate
_DECAY = 0.98  # each new draft of a bucket ages its older counts: ~50 drafts of memory


@dataclass(slots=True)
class _Counts:
    reached: float = 0.0
    accepted: float = 0.0


def ewma(mean: float | None, sample: float, weight: float) -> float:
    """A moving average with the newest sample weighted `weight` (the first sample stands alone)."""
    return sample if mean is None else (1 - weight) * mean + weight * sample


class AcceptanceModel:
    def __init__(self, max_tokens: int, prior: float = 0.7) -> None:
        self.max_tokens = max_tokens
        self.prior = prior
        self._counts: dict[int, list[_Counts]] = {}

    def record(self, bucket: int, num_proposed: int, num_accepted: int) -> None:
        """One verified draft of `bucket`: num_accepted of its num_proposed tokens accepted."""
        if num_proposed <= 0:
            return
        counts = self._counts.setdefault(bucket, [_Counts() for _ in range(self.max_tokens)])
        for c in counts:
            c.reached *= _DECAY
            c.accepted *= _DECAY
        for j in range(min(num_proposed, num_accepted + 1, self.max_tokens)):
            counts[j].reached += 1.0
            counts[j].accepted += 1.0 if j < num_accepted else 0.0

    def gains(self, bucket: int, k: int, prior: float | None = None) -> list[float]:
        """gain(bucket, j) for j = 1..k: the chance that proposal j is verified and accepted.
        `prior`: this bucket's own prior at position 1 (default: the model's)."""
        counts = self._counts.get(bucket)
        out: list[float] = []
        survival, previous = 1.0, self.prior if prior is None else prior
        for j in range(min(k, self.max_tokens)):
            c = counts[j] if counts is not None else _Counts()
            rate = (c.accepted + _PRIOR_WEIGHT * previous) / (c.reached + _PRIOR_WEIGHT)
            survival *= rate
            out.append(survival)
            previous = rate
        return out

    def rates(self, prior_of: Callable[[int], float | None] | None = None) -> dict[int, list[float]]:
        """Per bucket, the acceptance estimate at each position (for logs and tests); `prior_of`:
        each bucket's position-1 prior, as the caller of gains() passes it."""
        out = {}
        for bucket in sorted(self._counts):
            gains = self.gains(bucket, self.max_tokens, None if prior_of is None else prior_of(bucket))
            out[bucket] = [g / p if p else 0.0 for g, p in zip(gains, [1.0, *gains], strict=False)]
        return out
