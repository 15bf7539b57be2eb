"""One step's guess-by-guess decisions while a draft model drafts: keep a guess while what it is
expected to add pays for its verification row (the controller's plan decides whether to draft at all
and how far at most; controller.py)."""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

from tokenmill.engine.spec.step_times import StepTimePredictor

if TYPE_CHECKING:
    from tokenmill.engine.spec.controller import SpecController

# Bins of a draft guess's confidence (the draft's top-1 probability), and each bin's prior acceptance
# (its middle: a calibrated draft's guesses at p are accepted with probability about p).
CONFIDENCE_EDGES = (0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
CONFIDENCE_PRIORS = (0.15, 0.4, 0.55, 0.65, 0.75, 0.85, 0.925, 0.975)
# Before step times are measured over a spread of sizes, a draft guess is kept while its gain is at
# least this (on the Zen 3 host's measured costs the best fixed cut was 0.5-0.6, docs/speculative.md).
_KEEP_GAIN_UNFITTED = 0.5


def confidence_bin(confidence: float) -> int:
    """The bin of a draft guess made with top-1 probability `confidence` (0 .. len(CONFIDENCE_EDGES))."""
    return bisect.bisect_right(CONFIDENCE_EDGES, confidence)


class DraftGate:
    """One step's guess-by-guess decisions while a draft model drafts (ProposalGate): keep a guess
    while the tokens it is expected to add buy more than the time its verification row takes. With n
    requests decoding, `rows` guesses kept so far over the batch, `emitted` = n + their gains and S the
    time drafting has taken so far this step (spent whatever is decided), a guess of gain g is kept iff
        (emitted + g) / (T(n + rows + 1) + S)  >  emitted / (T(n + rows) + S)
    with T the controller's measured times of scoring that many rows; without measurements, iff
    g >= _KEEP_GAIN_UNFITTED. Whether to draft at all, and how far at most, is the plan's (which
    prices each draft forward at draft_forward_s)."""

    def __init__(self, controller: SpecController, num_decoding: int, predict: StepTimePredictor | None) -> None:
        self.started = time.monotonic()
        self.controller = controller
        self.predict = predict
        self.num_decoding = num_decoding
        self.rows = 0
        self.dropped = 0  # guesses not kept (each cost a draft forward, none is verified)
        self.emitted = float(num_decoding)
        self._gains: dict[str, float] = {}  # request → gain of its last kept guess

    def keep(self, request_id: str, confidence: float) -> bool:
        b = confidence_bin(confidence)
        gain = self._gains.get(request_id, 1.0) * self.controller.confidence_rate(b)
        if self.predict is None:
            worth = gain >= _KEEP_GAIN_UNFITTED
        else:  # the draft forwards so far are spent either way: the guess costs its row
            n, spent = self.num_decoding + self.rows, time.monotonic() - self.started
            worth = ((self.emitted + gain) / max(self.predict(n + 1) + spent, 1e-9)
                     > self.emitted / max(self.predict(n) + spent, 1e-9))
        if worth:
            self.rows += 1
            self.emitted += gain
            self._gains[request_id] = gain
            self.controller.note_kept(request_id, b)
        else:
            self.dropped += 1
        return worth
