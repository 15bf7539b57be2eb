"""Prometheus metrics of service classes (docs/metrics.md, docs/workload_classes.md), on the
server's registry next to the vLLM-named series of `metrics.py`.

Per request, labelled `service_class`, observed once when it finishes (stop or length; a request
whose client left is not counted), from the engine's timeline of that request, so exact: TTFT,
TPOT (the request's mean, decode time / (tokens - 1), as the bench defines it), queue time,
output tokens, and SLO attainment against the class's targets. Per engine step: inter-token
latencies, requests running / waiting and tokens scheduled by class, lower-class requests paused
for a protected class, the step-time budget, and the step-time model's current fit.
"""

from __future__ import annotations

import math
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenmill.config import ServiceClassConfig
from tokenmill.engine.outputs import RequestMetrics, RequestOutput
from tokenmill.engine.service_class import ServiceClass
from tokenmill.engine.stats import StepStats
from tokenmill.server.metrics import PREFIX, TOKEN_LATENCY_BUCKETS_S, TTFT_BUCKETS_S

CLASS_LABELS = ("model_name", "service_class")
SLO_KINDS = ("ttft", "tpot", "all")  # `all`: every target the class has was met
FIT_TERMS = ("base", "per_token", "per_seq")


class ClassMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, config: ServiceClassConfig) -> None:
        self.registry = registry
        self.model_name = model_name
        self.config = config
        self._build_request_metrics()
        self._build_step_metrics()
        self._create_children()

    # ---------------------------------------------------------------- construction

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(PREFIX + name, doc, CLASS_LABELS, buckets=buckets, registry=self.registry)

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = CLASS_LABELS) -> Counter:
        return Counter(PREFIX + name, doc, labels, registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = CLASS_LABELS) -> Gauge:
        return Gauge(PREFIX + name, doc, labels, registry=self.registry)

    def _build_request_metrics(self) -> None:
        self.ttft = self._histogram("service_class_time_to_first_token_seconds",
                                    "Time to first token per service class, in seconds.", TTFT_BUCKETS_S)
        self.tpot = self._histogram(
            "service_class_time_per_output_token_seconds",
            "Each request's mean time per output token after the first, per service class.", TOKEN_LATENCY_BUCKETS_S)
        # Queue waits in a healthy server are milliseconds: TTFT's fine buckets, not the 0.3 s+ ones.
        self.queue = self._histogram("service_class_queue_time_seconds",
                                     "Time from arrival to first scheduled per service class, in seconds.",
                                     TTFT_BUCKETS_S)
        self.requests = self._counter("service_class_requests", "Finished requests per service class.")
        self.generation_tokens = self._counter("service_class_generation_tokens",
                                               "Generated tokens of finished requests per service class.")
        self.rejected = self._counter("service_class_requests_rejected",
                                      "Requests refused with 429 per service class.")
        self.waiting = self._gauge("service_class_requests_waiting",
                                   "Admitted requests per service class waiting for their first token.")
        self.slo_requests = self._counter("slo_requests",
                                          "Finished requests of service classes that have SLO targets.")
        self.slo_met = self._counter(
            "slo_met", "Of those, requests that met the class's target (slo: ttft, tpot, all).", (*CLASS_LABELS, "slo"))
        self.slo_target = self._gauge("slo_target_seconds", "The SLO target of each service class (slo: ttft, tpot); "
                                      "absent where the class has none.", (*CLASS_LABELS, "slo"))

    def _build_step_metrics(self) -> None:
        self.inter_token_latency = self._histogram(
            "service_class_inter_token_latency_seconds", "Time between consecutive tokens of one request, per "
            "service class.", TOKEN_LATENCY_BUCKETS_S)
        self.num_running = self._gauge("service_class_num_requests_running",
                                       "Requests of each class in the running batch after the last step.")
        self.num_waiting = self._gauge("service_class_num_requests_waiting",
                                       "Requests of each class waiting in the engine (preempted included).")
        self.scheduled_tokens = self._counter("service_class_scheduled_tokens",
                                              "Tokens scheduled into engine steps per service class.")
        model = ("model_name",)
        self.num_deferred = self._counter(
            "service_class_deferred_requests", "Running lower-class requests paused for a step to keep a protected "
            "class within its TPOT target (they keep their KV blocks).", model)
        self.step_time_limit = self._gauge(
            "step_time_limit_seconds", "The last step's time budget (margin x the protected class's TPOT target); "
            "0 when no class was protected (the whole token budget).", model)
        self.step_time_predicted = self._gauge(
            "step_time_predicted_seconds", "The step-time model's prediction for the last step (0 before it fits).",
            model)
        self.step_time_measured = self._gauge("step_time_seconds", "The last engine step's measured time.", model)
        self.fit_coefficient = self._gauge(
            "step_time_model_coefficient_seconds", "The online step-time fit T = base + per_token x tokens + per_seq "
            "x seqs (term: base, per_token, per_seq); absent until the fit is trusted.", (*model, "term"))
        self.fit_samples = self._gauge("step_time_model_samples", "Steps the step-time fit has seen (set once it "
                                       "is trusted).", model)

    def _create_children(self) -> None:
        """Every series at zero from the start, for every class (fit coefficients wait for a fit)."""
        for service_class in ServiceClass:
            labels = (self.model_name, service_class.value)
            for metric in (self.ttft, self.tpot, self.queue, self.requests, self.generation_tokens, self.rejected,
                           self.waiting, self.slo_requests, self.inter_token_latency, self.num_running,
                           self.num_waiting, self.scheduled_tokens):
                metric.labels(*labels)
            for kind in SLO_KINDS:
                self.slo_met.labels(*labels, kind)
            target = self.config.target(service_class)
            for kind, seconds in (("ttft", target.ttft_s), ("tpot", target.tpot_s)):
                if seconds is not None:
                    self.slo_target.labels(*labels, kind).set(seconds)
        for metric in (self.num_deferred, self.step_time_limit, self.step_time_predicted, self.step_time_measured,
                       self.fit_samples):
            metric.labels(self.model_name)

    # ---------------------------------------------------------------- per request

    def on_rejected(self, service_class: ServiceClass) -> None:
        self.rejected.labels(self.model_name, service_class.value).inc()

    def set_waiting(self, waiting: dict[ServiceClass, int]) -> None:
        """The admission queue by class (read at scrape time)."""
        for service_class, count in waiting.items():
            self.waiting.labels(self.model_name, service_class.value).set(count)

    def on_finished(self, output: RequestOutput, service_class: ServiceClass) -> None:
        labels = (self.model_name, service_class.value)
        num_generated = max((len(c.token_ids) for c in output.outputs), default=0)
        self.requests.labels(*labels).inc()
        self.generation_tokens.labels(*labels).inc(sum(len(c.token_ids) for c in output.outputs))
        m = output.metrics
        if m is None:
            return
        ttft_s, tpot_s = m.ttft_s, request_tpot_s(m, num_generated)
        for histogram, seconds in ((self.ttft, ttft_s), (self.tpot, tpot_s), (self.queue, m.queue_s)):
            if seconds is not None:
                histogram.labels(*labels).observe(max(0.0, seconds))
        self._record_slo(labels, service_class, ttft_s, tpot_s)

    def _record_slo(self, labels: tuple[str, str], service_class: ServiceClass, ttft_s: float | None,
                    tpot_s: float | None) -> None:
        target = self.config.target(service_class)
        if target.ttft_s is None and target.tpot_s is None:
            return  # nothing to attain (batch by default): its slo_* series stay at zero
        self.slo_requests.labels(*labels).inc()
        # A request without a first token missed its TTFT; one with < 2 tokens has no TPOT to miss.
        ttft_ok = target.ttft_s is None or (ttft_s is not None and ttft_s <= target.ttft_s)
        tpot_ok = target.tpot_s is None or tpot_s is None or tpot_s <= target.tpot_s
        for kind, ok in (("ttft", ttft_ok), ("tpot", tpot_ok), ("all", ttft_ok and tpot_ok)):
            if ok:
                self.slo_met.labels(*labels, kind).inc()

    # ---------------------------------------------------------------- per step

    def on_step(self, stats: StepStats, finished: list[RequestOutput]) -> None:
        """A stats listener: called from the engine thread after every step (and after aborts)."""
        model = self.model_name
        for name, latencies in stats.class_inter_token_latencies_s.items():
            for latency_s in latencies:
                self.inter_token_latency.labels(model, name).observe(latency_s)
        for name, count in stats.class_num_running.items():
            self.num_running.labels(model, name).set(count)
        for name, count in stats.class_num_waiting.items():
            self.num_waiting.labels(model, name).set(count)
        decisions = stats.classes
        for name, num_tokens in decisions.scheduled_tokens.items():
            self.scheduled_tokens.labels(model, name).inc(num_tokens)
        if stats.num_scheduled_tokens == 0:
            return  # an idle publish (after aborts): no step to describe
        self.num_deferred.labels(model).inc(decisions.num_deferred)
        self.step_time_limit.labels(model).set(decisions.step_time_limit_s or 0.0)
        self.step_time_predicted.labels(model).set(decisions.predicted_step_time_s or 0.0)
        self.step_time_measured.labels(model).set(stats.step_time_s)
        fit = decisions.step_time_fit
        if fit is not None:
            self.fit_samples.labels(model).set(fit.num_samples)
            for term, seconds in zip(FIT_TERMS, (fit.base_s, fit.per_token_s, fit.per_seq_s), strict=True):
                if math.isfinite(seconds):
                    self.fit_coefficient.labels(model, term).set(seconds)


def request_tpot_s(m: RequestMetrics, num_generated: int) -> float | None:
    """Decode time / (tokens - 1); None with fewer than two tokens."""
    if m.first_token is None or num_generated < 2:
        return None
    finished = m.finished if m.finished is not None else time.monotonic()
    return max(0.0, finished - m.first_token) / (num_generated - 1)
