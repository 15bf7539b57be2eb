"""ServerMetrics over synthetic engine stats: the exposition parses and the counters move."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tokenmill.config import ServiceClassConfig
from tokenmill.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.engine.request import FinishReason
from tokenmill.engine.stats import StepStats
from tokenmill.server.class_metrics import ClassMetrics
from tokenmill.server.metrics import ServerMetrics, build_1_2_5_buckets

MODEL = "tiny"
REPO_ROOT = Path(__file__).resolve().parents[2]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _samples(metrics: ServerMetrics) -> Samples:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    found: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"model_name": MODEL, **labels}.items())))]


def _stats(**overrides: object) -> StepStats:
    base: dict[str, object] = dict(num_running=3, num_waiting=2, num_scheduled_tokens=40, num_preempted=0,
                                   kv_usage=0.25, prefix_cache_queries=0, prefix_cache_hits=0, step_time_s=0.01)
    base.update(overrides)
    return StepStats(**base)  # type: ignore[arg-type]


def _finished(reason: FinishReason, num_prompt: int = 7, num_output: int = 5) -> RequestOutput:
    completion = CompletionOutput(0, "text", list(range(num_output)), None, reason)
    # arrival 100 → scheduled 100.5 (queue 0.5) → first token 101.5 (prefill 1) → finished 103.5 (decode 2)
    metrics = RequestMetrics(arrival=100.0, first_scheduled=100.5, first_token=101.5, finished=103.5)
    return RequestOutput("r", "p", list(range(num_prompt)), [completion], True, metrics)


def test_exposition_parses_with_every_series_before_traffic() -> None:
    samples = _samples(ServerMetrics(MODEL))
    assert _value(samples, "tokenmill:num_requests_running") == 0
    assert _value(samples, "tokenmill:prompt_tokens_total") == 0
    assert _value(samples, "tokenmill:request_success_total", finished_reason="stop") == 0
    assert _value(samples, "tokenmill:time_to_first_token_seconds_count") == 0
    assert _value(samples, "tokenmill:engine_restarts_total") == 0
    assert not any(name.endswith("_created") for name, _ in samples)


def test_gauges_and_token_counters_follow_steps() -> None:
    metrics = ServerMetrics(MODEL)
    metrics.on_step(_stats(num_prompt_tokens=30, num_generation_tokens=3, num_preempted=1), [])
    metrics.on_step(_stats(num_running=1, num_waiting=0, kv_usage=0.5, num_generation_tokens=4), [])
    samples = _samples(metrics)
    assert _value(samples, "tokenmill:num_requests_running") == 1
    assert _value(samples, "tokenmill:num_requests_waiting") == 0
    assert _value(samples, "tokenmill:kv_cache_usage_perc") == 0.5
    assert _value(samples, "tokenmill:prompt_tokens_total") == 30
    assert _value(samples, "tokenmill:generation_tokens_total") == 7
    assert _value(samples, "tokenmill:num_preemptions_total") == 1
    assert _value(samples, "tokenmill:iteration_tokens_total_count") == 2
    assert _value(samples, "tokenmill:iteration_tokens_total_bucket", le="32.0") == 0
    assert _value(samples, "tokenmill:iteration_tokens_total_bucket", le="64.0") == 2
    assert _value(samples, "tokenmill:cpu_threads") == 0  # no governor in these steps: left unset
    metrics.on_step(_stats(cpu_threads=1, cpu_other_cores=0.75), [])
    samples = _samples(metrics)
    assert _value(samples, "tokenmill:cpu_threads") == 1 and _value(samples, "tokenmill:cpu_other_cores") == 0.75


def test_prefix_cache_counters_add_deltas_of_cumulative_values() -> None:
    metrics = ServerMetrics(MODEL)
    for queries, hits in [(100, 40), (150, 40), (160, 50)]:
        metrics.on_step(_stats(prefix_cache_queries=queries, prefix_cache_hits=hits), [])
    samples = _samples(metrics)
    assert _value(samples, "tokenmill:prefix_cache_queries_total") == 160
    assert _value(samples, "tokenmill:prefix_cache_hits_total") == 50


def test_engine_counters_that_restart_from_zero_are_added_whole() -> None:
    metrics = ServerMetrics(MODEL)
    metrics.on_step(_stats(prefix_cache_queries=100, prefix_cache_hits=40), [])
    metrics.on_step(_stats(prefix_cache_queries=10, prefix_cache_hits=5), [])  # a fresh engine
    samples = _samples(metrics)
    assert _value(samples, "tokenmill:prefix_cache_queries_total") == 110
    assert _value(samples, "tokenmill:prefix_cache_hits_total") == 45


def test_latency_histograms_observe_per_token_stats() -> None:
    metrics = ServerMetrics(MODEL)
    metrics.on_step(_stats(ttfts_s=[0.03, 0.3], inter_token_latencies_s=[0.02, 0.02, 0.2]), [])
    samples = _samples(metrics)
    assert _value(samples, "tokenmill:time_to_first_token_seconds_count") == 2
    assert _value(samples, "tokenmill:time_to_first_token_seconds_bucket", le="0.04") == 1
    assert _value(samples, "tokenmill:inter_token_latency_seconds_count") == 3
    assert _value(samples, "tokenmill:inter_token_latency_seconds_bucket", le="0.025") == 2
    assert _value(samples, "tokenmill:time_per_output_token_seconds_count") == 3


def test_finished_requests_record_success_lengths_and_timeline() -> None:
    metrics = ServerMetrics(MODEL)
    done = [_finished(FinishReason.STOP), _finished(FinishReason.LENGTH, num_output=16)]
    metrics.on_step(_stats(), done)
    metrics.on_step(_stats(), [_finished(FinishReason.STOP)])
    samples = _samples(metrics)
    assert _value(samples, "tokenmill:request_success_total", finished_reason="stop") == 2
    assert _value(samples, "tokenmill:request_success_total", finished_reason="length") == 1
    assert _value(samples, "tokenmill:request_success_total", finished_reason="abort") == 0
    assert _value(samples, "tokenmill:request_prompt_tokens_sum") == 21
    assert _value(samples, "tokenmill:request_generation_tokens_sum") == 26
    assert _value(samples, "tokenmill:request_queue_time_seconds_sum") == 1.5
    assert _value(samples, "tokenmill:request_prefill_time_seconds_sum") == 3.0
    assert _value(samples, "tokenmill:request_decode_time_seconds_sum") == 6.0
    assert _value(samples, "tokenmill:request_inference_time_seconds_sum") == 9.0
    assert _value(samples, "tokenmill:e2e_request_latency_seconds_sum") == 10.5
    # decode 2 s over 4 tokens after the first; over 15 for the 16-token one
    assert abs(_value(samples, "tokenmill:request_time_per_output_token_seconds_sum") - (1.0 + 2 / 15)) < 1e-9


def test_timeline_of_a_stop_string_finish_uses_now() -> None:
    metrics = ServerMetrics(MODEL)
    output = _finished(FinishReason.STOP)
    assert output.metrics is not None
    output.metrics.finished = None  # the output processor ended it before the engine stamped it
    metrics.on_step(_stats(), [output])
    assert _value(_samples(metrics), "tokenmill:e2e_request_latency_seconds_count") == 1


def test_rejections_and_restarts_count() -> None:
    metrics = ServerMetrics(MODEL)
    metrics.on_rejected()
    metrics.on_rejected()
    metrics.on_restart()
    samples = _samples(metrics)
    assert _value(samples, "tokenmill:requests_rejected_total") == 2
    assert _value(samples, "tokenmill:engine_restarts_total") == 1


def test_instances_do_not_share_state() -> None:
    first, second = ServerMetrics(MODEL), ServerMetrics(MODEL)
    first.on_rejected()
    assert _value(_samples(second), "tokenmill:requests_rejected_total") == 0


def test_length_buckets_follow_1_2_5_up_to_the_context() -> None:
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(4096)[-1] == 2000


def _exposed_names() -> set[str]:
    metrics = ServerMetrics(MODEL)
    ClassMetrics(metrics.registry, MODEL, ServiceClassConfig())  # a server registers both (state.py)
    body, _ = metrics.render()
    return {sample.name for family in text_string_to_metric_families(body.decode()) for sample in family.samples}


def test_every_metric_is_documented() -> None:
    docs = (REPO_ROOT / "docs" / "metrics.md").read_text()
    suffixes = re.compile(r"_(bucket|sum|count)$")
    for name in _exposed_names():
        assert f"`{suffixes.sub('', name)}`" in docs, f"{name} is missing from docs/metrics.md"


def test_dashboard_queries_only_exposed_metrics() -> None:
    dashboard = json.loads((REPO_ROOT / "deploy" / "grafana" / "tokenmill.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    used = {name for expr in exprs for name in re.findall(r"tokenmill:[a-z0-9_]+", expr)}
    assert used <= _exposed_names()
    assert len(used) >= 15
