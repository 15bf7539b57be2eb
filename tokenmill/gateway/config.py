"""The gateway's settings: one frozen dataclass per concern, each validating itself.

Kept apart from `tokenmill.config` on purpose: that module imports torch, and the gateway
process must start in a fraction of a second and never load the engine.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from tokenmill.errors import TokenmillError
from tokenmill.kernels import QUANTIZATIONS  # torch-free

# Statuses worth another replica: overloaded (429), loading or draining (503), or broken (5xx).
DEFAULT_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise TokenmillError(message)


@dataclass(frozen=True, slots=True)
class RetryConfig:
    max_attempts: int = 3  # tries per request, the first included
    backoff_base_s: float = 0.05  # attempt k waits about base * 2**k, jittered, capped at backoff_max_s
    backoff_max_s: float = 1.0
    retry_statuses: frozenset[int] = DEFAULT_RETRY_STATUSES
    # How long a request may wait for some replica to become routable (cold start, all ejected).
    wait_for_replica_s: float = 10.0

    def __post_init__(self) -> None:
        _require(self.max_attempts >= 1, "retry max_attempts must be >= 1")
        _require(0 <= self.backoff_base_s <= self.backoff_max_s, "need 0 <= backoff_base_s <= backoff_max_s")
        _require(self.wait_for_replica_s >= 0, "wait_for_replica_s must be >= 0")


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    failure_threshold: int = 3  # consecutive failures that eject a replica
    open_s: float = 5.0  # ejected this long before one trial request (half-open)
    max_open_s: float = 60.0  # each failed trial doubles the wait, up to this

    def __post_init__(self) -> None:
        _require(self.failure_threshold >= 1, "breaker failure_threshold must be >= 1")
        _require(0 < self.open_s <= self.max_open_s, "need 0 < breaker open_s <= max_open_s")


@dataclass(frozen=True, slots=True)
class HealthConfig:
    probe_interval_s: float = 1.0  # /ready and /metrics of every replica
    probe_timeout_s: float = 2.0
    connect_timeout_s: float = 2.0  # requests: a replica that does not accept is down
    read_timeout_s: float = 600.0  # requests: longest silence between bytes of a response

    def __post_init__(self) -> None:
        _require(self.probe_interval_s > 0 and self.probe_timeout_s > 0, "probe interval and timeout must be > 0")
        _require(self.connect_timeout_s > 0 and self.read_timeout_s > 0, "request timeouts must be > 0")


@dataclass(frozen=True, slots=True)
class LocalReplicaConfig:
    """Replicas the gateway runs itself: `tokenmill serve MODEL` subprocesses on 127.0.0.1."""

    model: str
    serve_args: tuple[str, ...] = ()  # extra `tokenmill serve` flags (--dtype, --threads, ...)
    python: str = sys.executable
    log_dir: str | None = None  # each replica's output goes to <log_dir>/replica-<port>.log; None: discarded
    drain_timeout_s: float = 30.0  # SIGTERM, then SIGKILL after this (plus a margin)
    quantization: str | None = None  # `tokenmill serve --quantization`; None: the server's default

    def __post_init__(self) -> None:
        _require(bool(self.model), "a local replica needs a model")
        _require(self.quantization is None or self.quantization in QUANTIZATIONS,
                 f"quantization '{self.quantization}' is not supported: use {', '.join(QUANTIZATIONS)}")
        _require(self.drain_timeout_s >= 0, "drain_timeout_s must be >= 0")


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    """Local replicas: max(ceil(load / target), min) busy ones plus `warm` idle ones, at most max."""

    min_replicas: int = 1
    max_replicas: int = 1
    warm_replicas: int = 0
    target_load_per_replica: float = 8.0  # outstanding (running + waiting) requests one replica should carry
    interval_s: float = 1.0
    scale_down_delay_s: float = 30.0  # load must stay low this long before a replica is drained

    def __post_init__(self) -> None:
        _require(0 <= self.min_replicas <= self.max_replicas, "need 0 <= min_replicas <= max_replicas")
        _require(self.max_replicas >= 1, "max_replicas must be >= 1")
        _require(self.warm_replicas >= 0, "warm_replicas must be >= 0")
        _require(self.target_load_per_replica > 0, "target_load_per_replica must be > 0")
        _require(self.interval_s > 0 and self.scale_down_delay_s >= 0, "autoscale intervals must be >= 0")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    backends: tuple[str, ...] = ()  # replicas someone else runs: base URLs like http://10.0.0.5:8000
    local: LocalReplicaConfig | None = None  # replicas the gateway runs; None: backends only
    initial_replicas: int = 0  # local replicas started at once (concurrently)
    policy: str = "least_outstanding"
    affinity_epsilon: float = 0.25  # prefix affinity spills when load > (1 + epsilon) x mean
    affinity_prefix_chars: int = 256  # how much of a prompt names its "prefix"
    retry: RetryConfig = field(default_factory=RetryConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    autoscale: AutoscaleConfig | None = None  # None: a fixed set (dead local replicas still get replaced)

    def __post_init__(self) -> None:
        _require(0 < self.port < 65536, "port must be in 1..65535")
        _require(bool(self.backends) or (self.local is not None and self.initial_replicas > 0),
                 "the gateway needs replicas: pass --replicas N --model M and/or --backend URL")
        _require(self.local is not None or self.initial_replicas == 0, "--replicas needs --model")
        _require(self.affinity_epsilon > 0, "affinity epsilon must be > 0")
        _require(self.affinity_prefix_chars > 0, "affinity prefix length must be > 0")
        for url in self.backends:
            _require(url.startswith(("http://", "https://")), f"backend '{url}' must be an http(s):// URL")
