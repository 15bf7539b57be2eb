"""What a failed attempt means: is it worth another replica, what the breaker should hear, and how
long to wait before the next try (exponential backoff with jitter)."""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

import httpx

from tokenmill.gateway.config import RetryConfig


class Verdict(enum.Enum):
    """What an attempt says about the replica's health, for its circuit breaker."""

    HEALTHY = "healthy"  # it answered (even a 4xx: the request was at fault)
    BROKEN = "broken"  # transport error, timeout, 5xx, a stream cut before output
    NONE = "none"  # busy (429), not ready (503), or the client left: no verdict


@dataclass(slots=True)
class Failure:
    """An attempt that reached no client; retried while attempts are left, else answered."""

    reason: str  # label of the retries metric
    status: int  # what the client gets when this is the last attempt
    message: str
    verdict: Verdict = Verdict.BROKEN
    body: bytes | None = None  # the replica's own error body, passed on as-is when final
    headers: dict[str, str] = field(default_factory=dict)


def transport_failure(exc: httpx.HTTPError, replica_name: str) -> Failure:
    if isinstance(exc, httpx.TimeoutException):
        return Failure("timeout", 504, f"replica {replica_name} timed out ({type(exc).__name__})")
    if isinstance(exc, httpx.ConnectError):
        return Failure("connect_error", 502, f"replica {replica_name} refused the connection")
    return Failure("transport_error", 502, f"replica {replica_name} failed: {type(exc).__name__}: {exc}")


def status_failure(status: int, body: bytes, headers: httpx.Headers) -> Failure:
    # 429 and 503 say "not now" rather than "broken": another replica, but no breaker failure.
    verdict = Verdict.NONE if status in (429, 503) else Verdict.BROKEN
    passed = {name: headers[name] for name in ("content-type", "retry-after") if name in headers}
    return Failure(f"status_{status}", status, f"replica answered {status}", verdict, body, passed)


def backoff_s(num_failures: int, config: RetryConfig, rng: random.Random | None = None) -> float:
    """Wait before the retry after `num_failures` failed attempts: equal jitter over an exponential.

    base * 2**(k-1), capped, of which half is fixed and half uniform: retries of many requests
    that failed together (a replica died) spread out instead of arriving as one wave.
    """
    ceiling = min(config.backoff_max_s, config.backoff_base_s * 2 ** max(0, num_failures - 1))
    return ceiling / 2 + (rng or random).uniform(0, ceiling / 2)
