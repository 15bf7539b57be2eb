"""Each choice's exact phase times for the client: the `tokenmill` extension of a response.

The server's Prometheus histograms give the same phases only as bucket counts, too coarse to
tell 0.1 ms from 150 ms; `tokenmill bench` reads these instead. The definitions match the
histograms' (server/metrics.py): engine arrival → first scheduled → first token → finish.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenmill.engine.outputs import RequestMetrics
from tokenmill.server.fanout import ChoiceUpdate
from tokenmill.server.response_bodies import PhaseTimes, TokenmillExtension


@dataclass(slots=True)
class Timings:
    """Gathers the finishing update of each choice; `extension()` is None until one has finished."""

    by_index: dict[int, PhaseTimes] = field(default_factory=dict)

    @classmethod
    def of(cls, updates: Iterable[ChoiceUpdate]) -> Timings:
        timings = cls()
        for update in updates:
            timings.note(update)
        return timings

    def note(self, update: ChoiceUpdate) -> None:
        if update.metrics is not None:
            self.by_index[update.child.index] = phase_times(update.child.index, update.metrics)

    def extension(self) -> TokenmillExtension | None:
        if not self.by_index:
            return None
        return TokenmillExtension(timings=[self.by_index[i] for i in sorted(self.by_index)])


def phase_times(index: int, m: RequestMetrics, now: float | None = None) -> PhaseTimes:
    # A stop-string finish is decided after the engine step, before the engine stamps `finished`:
    # the moment the server sees it is its finish (as the histograms take it).
    finished = m.finished if m.finished is not None else (now if now is not None else time.monotonic())
    return PhaseTimes(index=index, queue_s=m.queue_s, prefill_s=m.prefill_s,
                      decode_s=None if m.first_token is None else finished - m.first_token,
                      ttft_s=m.ttft_s, e2e_s=finished - m.arrival)
