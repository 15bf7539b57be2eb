"""What the target's own confidence says of a draft's chances, for a request the draft is not running.

A draft request's κ and α are measured only from its own drafts, so once a dip turned it off nothing
measured it again (a code edit whose guesses were 92% accepted sat out 332 of 382 steps). The signal
that is free while a request is off is the target's: each token it emits comes with its top-1
probability p_t (ModelRunner.track_confidence). `TargetConfidence` learns P(a draft's guess is the
target's token | bin of p_t at the row that checked it) from verified guesses (priors: the offline
table below), and keeps α̂ per request, a moving average over its recent tokens of their bins' rates.
Offline, 90% of a code edit's tokens had p_t >= 0.99 (every guess there accepted) against 10-30% of a
chat's (docs/speculative.md). The controller plans a request that sat out at α̂^j (controller.py).
"""

from __future__ import annotations

import bisect

from tokenmill.engine.spec.acceptance import AcceptanceModel, ewma

# Bins of the target's top-1 probability at the token it emitted, and each bin's prior chance that a
# draft's guess there equals the target's token (teacher-forced Qwen2.5-Coder-0.5B for the 1.5B over two
# code edits and three chats, 128 tokens each, docs/speculative.md: 0.21-0.28 below 0.5, 0.4-0.75 at
# 0.5-0.7, 0.78-0.86 at 0.7-0.8, 0.8-1.0 at 0.8-0.9, 0.87-1.0 at 0.9-0.99, 1.0 from 0.99).
TARGET_CONFIDENCE_EDGES = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
_TARGET_PRIORS = (0.25, 0.55, 0.8, 0.88, 0.93, 0.95, 0.99)
# Weight of the newest token in α̂: ~7 tokens of memory, so one confident token does not revive a chat
# (each revival pays the tokens the draft sat out, ~4.7 ms each for the q4 0.5B on Zen 3).
_TARGET_EWMA = 0.15


def target_confidence_bin(confidence: float) -> int:
    """The bin of a token the target emitted with top-1 probability `confidence`."""
    return bisect.bisect_right(TARGET_CONFIDENCE_EDGES, confidence)


class TargetConfidence:
    def __init__(self) -> None:
        self.model = AcceptanceModel(1)  # per bin of p_t, position-free: P(accepted | reached)
        self._estimates: dict[str, float] = {}  # α̂ per request

    def rate(self, bin_index: int) -> float:
        """The learned chance that a guess at a row of target confidence bin `bin_index` is accepted."""
        return self.model.gains(bin_index, 1, _TARGET_PRIORS[bin_index])[0]

    def record_verified(self, confidences: list[float], reached: int, accepted: int) -> None:
        """A verification whose guesses 1..`reached` were checked and 1..`accepted` accepted; its emitted
        token j came from the row that checked guess j + 1, at the target confidence confidences[j]."""
        for j, p in enumerate(confidences[:reached]):
            self.model.record(target_confidence_bin(p), 1, 1 if j < accepted else 0)

    def observe(self, request_id: str, confidences: list[float]) -> None:
        """The request emitted tokens at these target confidences: into its α̂."""
        for p in confidences:
            self._estimates[request_id] = ewma(self._estimates.get(request_id), self.rate(target_confidence_bin(p)),
                                               _TARGET_EWMA)

    def estimate(self, request_id: str) -> float | None:
        """α̂ of the request (None before it emitted a token the runner scored)."""
        return self._estimates.get(request_id)

    def forget(self, request_id: str) -> None:
        self._estimates.pop(request_id, None)
