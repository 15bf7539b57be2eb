"""Circuit breaker transitions on a fake clock: closed → open → half-open → closed/open."""

from __future__ import annotations

from tokenmill.gateway.breaker import BreakerState, CircuitBreaker
from tokenmill.gateway.config import BreakerConfig


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock) -> CircuitBreaker:
    return CircuitBreaker(BreakerConfig(failure_threshold=3, open_s=5.0, max_open_s=20.0), clock)


def test_opens_after_consecutive_failures_only() -> None:
    b = breaker(Clock())
    assert not b.on_failure() and not b.on_failure()
    b.on_success()  # a success in between resets the count
    assert not b.on_failure() and not b.on_failure()
    assert b.on_failure()  # third in a row: ejected
    assert b.state is BreakerState.OPEN and not b.can_route() and b.num_ejections == 1


def test_half_open_lets_one_trial_through_and_a_success_closes() -> None:
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.on_failure()
    clock.now = 4.9
    assert not b.can_route()
    clock.now = 5.0
    assert b.state is BreakerState.HALF_OPEN and b.can_route()
    b.on_routed()
    assert not b.can_route()  # the trial is in flight: nothing else
    b.on_success()
    assert b.state is BreakerState.CLOSED and b.can_route() and b.num_consecutive_failures == 0


def test_failed_trial_reopens_with_a_doubled_wait_capped() -> None:
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.on_failure()
    waits = []
    for _ in range(4):
        opened_at = clock.now
        while not b.can_route():
            clock.now += 0.5
        waits.append(clock.now - opened_at)
        b.on_routed()
        assert b.on_failure()  # the trial failed: open again
    assert waits == [5.0, 10.0, 20.0, 20.0]
    assert b.num_ejections == 5


def test_flapping_replica_recovers_each_time_it_comes_back() -> None:
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):  # down, up, down, up
        for _ in range(3):
            b.on_failure()
        assert b.state is BreakerState.OPEN
        clock.now += 5.0
        assert b.can_route()
        b.on_routed()
        b.on_success()
        assert b.state is BreakerState.CLOSED
    assert b.num_ejections == 3


def test_an_aborted_trial_frees_the_slot() -> None:
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.on_failure()
    clock.now = 5.0
    b.on_routed()
    b.on_aborted()  # the client left: no verdict, another trial may go
    assert b.state is BreakerState.HALF_OPEN and b.can_route()
