"""Prometheus metrics for the server, named as vLLM names them but under a `tokenmill:` prefix.

The engine emits plain `StepStats` after every step plus the requests that finished in it;
`ServerMetrics.on_step` turns them into gauges, counters and histograms. This is the only module
that imports prometheus_client. Bucket boundaries are vLLM's, so dashboards and alerts port by
renaming `vllm:` to `tokenmill:`. Every metric is documented in docs/metrics.md.
"""

from __future__ import annotations

import threading
import time
from typing import TypeVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from tokenmill.engine.outputs import RequestMetrics, RequestOutput
from tokenmill.engine.request import FinishReason
from tokenmill.engine.stats import StepStats

PREFIX = "tokenmill:"
LABELS = ("model_name",)

# vLLM v1's boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                           10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                             120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_MAX_MODEL_LEN = 32768

# `*_created` timestamp series double the exposition and no vLLM dashboard reads them. The switch
# is process-wide, which is fine: this module is the process's only Prometheus user.
disable_created_metrics()

_MetricT = TypeVar("_MetricT", Gauge, Counter, Histogram)


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value, as vLLM sizes its token-count histograms."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class _CumulativeDelta:
    """Turns an engine's running total into increments for a Counter.

    A total that goes down means the engine (and its counters) restarted: the new total is
    all new work, so it is added whole rather than dropped or made negative.
    """

    def __init__(self) -> None:
        self.last = 0

    def delta(self, total: int) -> int:
        increment = total - self.last if total >= self.last else total
        self.last = total
        return increment


class ServerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, *,
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> None:
        # An own registry by default: tests (and several servers in one process) never collide.
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self._model_metrics: list[Gauge | Counter | Histogram] = []
        self._lock = threading.Lock()  # guards the delta trackers; prometheus_client locks itself
        self._queries = _CumulativeDelta()
        self._hits = _CumulativeDelta()
        self._build_scheduler_metrics()
        self._build_token_metrics(max_model_len)
        self._build_latency_metrics()
        self._build_server_metrics()
        self._build_spec_metrics()
        self._create_children()

    # ---------------------------------------------------------------- construction

    def _gauge(self, name: str, doc: str) -> Gauge:
        return self._keep(Gauge(PREFIX + name, doc, LABELS, registry=self.registry))

    def _counter(self, name: str, doc: str) -> Counter:
        return self._keep(Counter(PREFIX + name, doc, LABELS, registry=self.registry))

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return self._keep(Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=self.registry))

    def _keep(self, metric: _MetricT) -> _MetricT:
        self._model_metrics.append(metric)
        return metric

    def _create_children(self) -> None:
        """Expose every series at zero from the start: `rate()` and alerts need a first sample,
        and an absent counter reads as "no data" rather than "nothing happened"."""
        for metric in self._model_metrics:
            metric.labels(self.model_name)
        for reason in FinishReason:
            self.request_success.labels(self.model_name, reason.value)

    def _build_scheduler_metrics(self) -> None:
        self.num_requests_running = self._gauge(
            "num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = self._gauge(
            "num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = self._gauge(
            "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = self._counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = self._counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = self._counter(
            "num_preemptions", "Cumulative number of preemptions from the engine.")
        self.cpu_threads = self._gauge(
            "cpu_threads", "Compute threads a CPU engine runs now (fewer while other processes take its CPUs).")
        self.cpu_other_cores = self._gauge(
            "cpu_other_cores", "Cores of this engine's CPUs that other processes used over the last interval.")

    def _build_token_metrics(self, max_model_len: int) -> None:
        length_buckets = build_1_2_5_buckets(max_model_len)
        self.prompt_tokens = self._counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = self._counter("generation_tokens", "Number of generation tokens processed.")
        self.request_success = Counter(
            PREFIX + "request_success", "Count of finished requests by finish reason.",
            (*LABELS, "finished_reason"), registry=self.registry)
        self.request_prompt_tokens = self._histogram(
            "request_prompt_tokens", "Number of prompt tokens per request.", length_buckets)
        self.request_generation_tokens = self._histogram(
            "request_generation_tokens", "Number of generated tokens per completion.", length_buckets)
        self.iteration_tokens = self._histogram(
            "iteration_tokens_total", "Histogram of number of tokens per engine step.", ITERATION_TOKEN_BUCKETS)

    def _build_latency_metrics(self) -> None:
        self.time_to_first_token = self._histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS_S)
        self.inter_token_latency = self._histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS_S)
        # vLLM's older name for the same per-token observations; kept so old dashboards work unchanged.
        self.time_per_output_token = self._histogram(
            "time_per_output_token_seconds", "Histogram of time per output token in seconds (same observations "
            "as inter_token_latency_seconds).", TOKEN_LATENCY_BUCKETS_S)
        self.request_time_per_output_token = self._histogram(
            "request_time_per_output_token_seconds", "Histogram of each request's mean time per output token "
            "after the first, in seconds.", TOKEN_LATENCY_BUCKETS_S)
        self.e2e_request_latency = self._request_latency(
            "e2e_request_latency_seconds", "e2e request latency (arrival to finish)")
        self.request_queue_time = self._request_latency(
            "request_queue_time_seconds", "time spent waiting before first scheduled")
        self.request_prefill_time = self._request_latency(
            "request_prefill_time_seconds", "time from first scheduled to first token")
        self.request_decode_time = self._request_latency(
            "request_decode_time_seconds", "time from first token to finish")
        self.request_inference_time = self._request_latency(
            "request_inference_time_seconds", "time from first scheduled to finish")

    def _request_latency(self, name: str, what: str) -> Histogram:
        return self._histogram(name, f"Histogram of {what} in seconds.", REQUEST_LATENCY_BUCKETS_S)

    def _build_server_metrics(self) -> None:
        self.engine_restarts = self._counter(
            "engine_restarts", "Times the engine loop failed and restarted.")
        self.requests_rejected = self._counter(
            "requests_rejected", "Requests refused by admission control (HTTP 429).")

    def _build_spec_metrics(self) -> None:
        # vLLM's speculative-decoding counters; acceptance rate = accepted / draft tokens.
        self.spec_num_drafts = self._counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_num_draft_tokens = self._counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_num_accepted_tokens = self._counter(
            "spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.spec_accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
            (*LABELS, "position"), registry=self.registry)
        self.spec_num_gated_tokens = self._counter(
            "spec_decode_num_gated_tokens", "Draft tokens the confidence gate dropped before verification.")
        self.spec_enabled = self._gauge(
            "spec_decode_enabled", "1 while the speculation controller lets requests propose, else 0.")
        self.spec_num_forced_tokens = self._counter(
            "spec_decode_num_forced_tokens", "Draft tokens a request's grammar forced (structured outputs).")
        self.spec_cached_tokens = self._gauge(
            "spec_decode_suffix_cache_tokens", "Output tokens of finished requests the suffix proposer guesses from.")
        self.spec_prediction_tokens = Counter(
            PREFIX + "spec_decode_num_prediction_tokens", "Tokens of requests' predictions (predicted outputs) "
            "verified, by outcome: accepted or rejected.", (*LABELS, "outcome"), registry=self.registry)

    # ---------------------------------------------------------------- recording

    def on_step(self, stats: StepStats, finished: list[RequestOutput]) -> None:
        """Record one engine step; called from the engine thread after every step."""
        self._record_scheduler(stats)
        self._record_tokens(stats)
        self._record_spec(stats)
        for output in finished:
            self._record_finished(output)

    def on_rejected(self) -> None:
        self.requests_rejected.labels(self.model_name).inc()

    def on_restart(self) -> None:
        self.engine_restarts.labels(self.model_name).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type, for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _record_scheduler(self, stats: StepStats) -> None:
        model = self.model_name
        self.num_requests_running.labels(model).set(stats.num_running)
        self.num_requests_waiting.labels(model).set(stats.num_waiting)
        self.kv_cache_usage_perc.labels(model).set(stats.kv_usage)
        with self._lock:
            queries = self._queries.delta(stats.prefix_cache_queries)
            hits = self._hits.delta(stats.prefix_cache_hits)
        self.prefix_cache_queries.labels(model).inc(queries)
        self.prefix_cache_hits.labels(model).inc(hits)
        self.num_preemptions.labels(model).inc(stats.num_preempted)
        if stats.cpu_threads:
            self.cpu_threads.labels(model).set(stats.cpu_threads)
            self.cpu_other_cores.labels(model).set(stats.cpu_other_cores)

    def _record_spec(self, stats: StepStats) -> None:
        if stats.spec_is_on is None:
            return  # speculation not configured: the series stay at zero
        model = self.model_name
        self.spec_enabled.labels(model).set(1.0 if stats.spec_is_on else 0.0)
        self.spec_cached_tokens.labels(model).set(stats.spec_cached_tokens)
        self.spec_num_drafts.labels(model).inc(stats.spec_num_drafts)
        self.spec_num_draft_tokens.labels(model).inc(stats.spec_num_draft_tokens)
        self.spec_num_accepted_tokens.labels(model).inc(stats.spec_num_accepted_tokens)
        self.spec_num_gated_tokens.labels(model).inc(stats.spec_num_gated_tokens)
        self.spec_num_forced_tokens.labels(model).inc(stats.spec_num_forced_tokens)
        self.spec_prediction_tokens.labels(model, "accepted").inc(stats.spec_num_prediction_accepted)
        self.spec_prediction_tokens.labels(model, "rejected").inc(stats.spec_num_prediction_rejected)
        for position, count in enumerate(stats.spec_accepted_per_position):
            self.spec_accepted_per_pos.labels(model, str(position)).inc(count)

    def _record_tokens(self, stats: StepStats) -> None:
        model = self.model_name
        self.prompt_tokens.labels(model).inc(stats.num_prompt_tokens)
        self.generation_tokens.labels(model).inc(stats.num_generation_tokens)
        if stats.num_scheduled_tokens > 0:  # idle steps would only pile up in the first bucket
            self.iteration_tokens.labels(model).observe(stats.num_scheduled_tokens)
        for ttft_s in stats.ttfts_s:
            self.time_to_first_token.labels(model).observe(ttft_s)
        for latency_s in stats.inter_token_latencies_s:
            self.inter_token_latency.labels(model).observe(latency_s)
            self.time_per_output_token.labels(model).observe(latency_s)

    def _record_finished(self, output: RequestOutput) -> None:
        model = self.model_name
        num_generated = 0
        for completion in output.outputs:
            reason = completion.finish_reason.value if completion.finish_reason is not None else "unknown"
            self.request_success.labels(model, reason).inc()
            self.request_generation_tokens.labels(model).observe(len(completion.token_ids))
            num_generated = max(num_generated, len(completion.token_ids))
        self.request_prompt_tokens.labels(model).observe(len(output.prompt_token_ids))
        if output.metrics is not None:
            self._record_timeline(output.metrics, num_generated)

    def _record_timeline(self, m: RequestMetrics, num_generated: int) -> None:
        # A request ended by a stop string finishes in the output processor, before the engine
        # stamps `finished`: this step's end is then its finish time.
        finished = m.finished if m.finished is not None else time.monotonic()
        observations = [
            (self.e2e_request_latency, finished - m.arrival),
            (self.request_queue_time, m.queue_s),
            (self.request_prefill_time, m.prefill_s),
            (self.request_decode_time, None if m.first_token is None else finished - m.first_token),
            (self.request_inference_time, None if m.first_scheduled is None else finished - m.first_scheduled),
        ]
        if m.first_token is not None and num_generated > 1:
            observations.append((self.request_time_per_output_token,
                                 (finished - m.first_token) / (num_generated - 1)))
        for histogram, seconds in observations:
            if seconds is not None:
                histogram.labels(self.model_name).observe(max(0.0, seconds))

