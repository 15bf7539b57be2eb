"""The gateway's Prometheus metrics, under `tokenmill:gateway_` (replicas keep their `tokenmill:` ones).

Outcomes of a client request (label `outcome`, one per request, on the replica that answered last):
    success          a 2xx answer (a stream that ended with [DONE])
    client_error     a 4xx the replica gave (bad request, auth): passed through, not retried
    failed           every attempt failed before anything reached the client: an error status
    midstream_error  the replica failed after tokens were streamed: ended with an SSE error event
    no_replica       nothing routable within the wait: 503
    client_closed    the client went away first
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from tokenmill.gateway.breaker import BreakerState
from tokenmill.gateway.replica import Lifecycle, Replica

PREFIX = "tokenmill:gateway_"
OUTCOMES = ("success", "client_error", "failed", "midstream_error", "no_replica", "client_closed")
NO_REPLICA = "none"  # the replica label of requests that never reached one

# vLLM's e2e boundaries (the replicas use them too), so gateway and replica latencies line up.
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                     40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
# As the server does (server/metrics.py): no `*_created` series, which no dashboard reads.
disable_created_metrics()

START_BUCKETS_S = (0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(PREFIX + "requests", "Client requests by the replica that answered last and "
                                "outcome.", ("replica", "outcome"), registry=r)
        self.attempts = Counter(PREFIX + "attempts", "Requests sent to a replica, first tries and retries.",
                                ("replica",), registry=r)
        self.retries = Counter(PREFIX + "retries", "Requests sent again to a replica after a failure that "
                               "reached no client, by the failure.", ("reason",), registry=r)
        self.ejections = Counter(PREFIX + "ejections", "Times a replica's circuit breaker opened.",
                                 ("replica",), registry=r)
        self.replicas = Gauge(PREFIX + "replicas", "Replicas by lifecycle state (serving ones by readiness).",
                              ("state",), registry=r)
        self.replacements = Counter(PREFIX + "replicas_replaced", "Local replicas found dead and replaced.",
                                    registry=r)
        self.scale_events = Counter(PREFIX + "scale_events", "Local replicas started or drained by the "
                                    "autoscaler.", ("direction",), registry=r)
        self.routing = Counter(PREFIX + "routing_decisions", "Routing decisions by policy and reason (affinity, "
                               "spill, ...).", ("policy", "reason"), registry=r)
        self.e2e_latency = Histogram(PREFIX + "e2e_request_latency_seconds", "Client request latency through "
                                     "the gateway, retries included.", ("stream",), buckets=LATENCY_BUCKETS_S,
                                     registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Streams: arrival to the first token "
                              "event sent to the client.", buckets=LATENCY_BUCKETS_S, registry=r)
        self.replica_start = Histogram(PREFIX + "replica_start_seconds", "Local replica start to first ready "
                                       "probe (cold start).", buckets=START_BUCKETS_S, registry=r)
        for outcome in OUTCOMES:  # every series from zero, so rate() and alerts have a first sample
            self.requests.labels(NO_REPLICA, outcome)

    def on_outcome(self, replica: Replica | None, outcome: str) -> None:
        self.requests.labels(replica.name if replica is not None else NO_REPLICA, outcome).inc()

    def total(self, outcome: str) -> float:
        """Requests with this outcome over all replicas (tests and reports)."""
        return sum(sample.value for metric in self.requests.collect() for sample in metric.samples
                   if sample.name.endswith("_total") and sample.labels.get("outcome") == outcome)

    def set_replica_counts(self, replicas: list[Replica]) -> None:
        counts = {"starting": 0, "ready": 0, "unready": 0, "ejected": 0, "draining": 0}
        for replica in replicas:
            counts[_state_label(replica)] += 1
        for state, num in counts.items():
            self.replicas.labels(state).set(num)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _state_label(replica: Replica) -> str:
    if replica.lifecycle is Lifecycle.STARTING:
        return "starting"
    if replica.lifecycle is not Lifecycle.SERVING:
        return "draining"
    if not replica.is_ready:
        return "unready"
    return "ejected" if replica.breaker.state is BreakerState.OPEN else "ready"
