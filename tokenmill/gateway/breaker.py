"""Circuit breaker: passive error counting that ejects a failing replica, then lets one trial through.

    CLOSED ──failure_threshold consecutive failures──▶ OPEN ──open_s elapsed──▶ HALF_OPEN
       ▲                                               ▲                          │ one trial request
       └───────────────── trial succeeds ──────────────┼──────────────────────────┤
                                                       └──── trial fails (wait doubles, ≤ max_open_s)

A flapping replica (up, down, up) is thus readmitted by its first good answer after the wait,
and one that keeps failing is tried ever more rarely instead of costing a retry per request.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

from tokenmill.gateway.config import BreakerConfig


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, config: BreakerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._state = BreakerState.CLOSED
        self.num_consecutive_failures = 0
        self.num_ejections = 0
        self._open_s = config.open_s
        self._opened_at = 0.0
        self._is_trial_in_flight = False

    @property
    def state(self) -> BreakerState:
        """The state now: an OPEN breaker whose wait is over reads HALF_OPEN."""
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self._open_s:
            self._state = BreakerState.HALF_OPEN
            self._is_trial_in_flight = False
        return self._state

    def can_route(self) -> bool:
        """May a request go this way now? Half-open admits exactly one trial at a time."""
        state = self.state
        if state is BreakerState.HALF_OPEN:
            return not self._is_trial_in_flight
        return state is BreakerState.CLOSED

    def on_routed(self) -> None:
        """A request was sent: in half-open it is the trial, and no other follows until it ends."""
        if self.state is BreakerState.HALF_OPEN:
            self._is_trial_in_flight = True

    def on_success(self) -> None:
        self.num_consecutive_failures = 0
        if self._state is not BreakerState.CLOSED:
            self._state = BreakerState.CLOSED
            self._open_s = self.config.open_s
        self._is_trial_in_flight = False

    def on_failure(self) -> bool:
        """Count one failure; True when it ejected the replica (the breaker opened just now)."""
        self.num_consecutive_failures += 1
        state = self.state
        if state is BreakerState.HALF_OPEN:
            self._open_s = min(self._open_s * 2, self.config.max_open_s)  # failed trial: back off
            return self._open()
        if state is BreakerState.CLOSED and self.num_consecutive_failures >= self.config.failure_threshold:
            return self._open()
        return False  # already open: requests in flight before the ejection are still failing

    def on_aborted(self) -> None:
        """The request ended without a verdict (client left): free the trial slot."""
        self._is_trial_in_flight = False

    def _open(self) -> bool:
        self._state = BreakerState.OPEN
        self._opened_at = self._clock()
        self._is_trial_in_flight = False
        self.num_ejections += 1
        return True
