"""One replica as the gateway sees it: a base URL, its readiness, breaker, load and (local) process.

    STARTING ──first 200 from /ready──▶ SERVING ──drain (SIGTERM)──▶ DRAINING ──exit──▶ GONE
                                           │ process died / removed ──────────────────▶ GONE

A SERVING replica takes requests while its last /ready probe passed and its breaker allows.
Remote backends (`--backend URL`) start in SERVING: the probe alone decides when they are up.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from tokenmill.gateway.breaker import CircuitBreaker
from tokenmill.gateway.config import BreakerConfig
from tokenmill.gateway.local import LocalProcess


class Lifecycle(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    GONE = "gone"


@dataclass(slots=True)
class EngineLoad:
    """The replica's own view of its queue, scraped from its /metrics."""

    num_running: float = 0.0
    num_waiting: float = 0.0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0


_METRIC_FIELDS = {
    "tokenmill:num_requests_running": "num_running",
    "tokenmill:num_requests_waiting": "num_waiting",
    "tokenmill:prefix_cache_queries_total": "prefix_cache_queries",
    "tokenmill:prefix_cache_hits_total": "prefix_cache_hits",
}


def parse_engine_load(exposition: str) -> EngineLoad:
    """The few series the gateway needs, summed over labels; a line scan, not a full parser,
    because this runs once a second per replica on a body of hundreds of histogram lines."""
    load = EngineLoad()
    for line in exposition.splitlines():
        if not line.startswith("tokenmill:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        attr = _METRIC_FIELDS.get(name)
        if attr is not None:
            try:
                setattr(load, attr, getattr(load, attr) + float(line.rsplit(" ", 1)[1]))
            except (IndexError, ValueError):
                continue  # a malformed line is skipped, not fatal
    return load


class Replica:
    def __init__(self, url: str, breaker_config: BreakerConfig, *, process: LocalProcess | None = None) -> None:
        self.url = url.rstrip("/")
        parts = urlsplit(self.url)
        self.name = parts.netloc or self.url  # the metrics label: host:port
        self.process = process
        self.lifecycle = Lifecycle.STARTING if process is not None else Lifecycle.SERVING
        self.breaker = CircuitBreaker(breaker_config)
        self.is_ready = False  # no probe has passed yet
        self.num_outstanding = 0  # requests the gateway has in flight here
        self.engine_load = EngineLoad()
        self.created_at = time.monotonic()
        self.ready_after_s: float | None = None  # start-to-ready of a local replica

    @property
    def is_local(self) -> bool:
        return self.process is not None

    @property
    def is_routable(self) -> bool:
        return self.lifecycle is Lifecycle.SERVING and self.is_ready and self.breaker.can_route()

    @property
    def is_live(self) -> bool:
        """Counts towards the fleet: starting or serving, not on its way out."""
        return self.lifecycle in (Lifecycle.STARTING, Lifecycle.SERVING)

    def load(self) -> float:
        """Outstanding work for autoscaling: what the gateway sent, or what the replica reports
        when that is more (other clients, or requests the gateway already gave up on)."""
        return max(float(self.num_outstanding), self.engine_load.num_running + self.engine_load.num_waiting)

    def on_probe(self, is_ready: bool) -> bool:
        """Record a /ready probe; True when this was a local replica's first ready answer."""
        self.is_ready = is_ready
        if is_ready and self.lifecycle is Lifecycle.STARTING:
            self.lifecycle = Lifecycle.SERVING
            self.ready_after_s = time.monotonic() - self.created_at
            return True
        return False

    def has_died(self) -> bool:
        return self.process is not None and self.lifecycle is not Lifecycle.GONE and self.process.has_exited()

    def __repr__(self) -> str:
        return f"Replica({self.name}, {self.lifecycle.value}, ready={self.is_ready}, out={self.num_outstanding})"
