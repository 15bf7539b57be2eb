"""Queue/prefill/decode: exact from the server's per-request times where it sends them, else from
/metrics deltas (parsing, subtraction, PromQL-style quantiles capped by the sum)."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from rich.console import Console

from tokenmill.bench.bench import RunResult, pooled_server
from tokenmill.bench.client import Target
from tokenmill.bench.metrics import SLO, compute_metrics
from tokenmill.bench.records import RequestRecord, failed
from tokenmill.bench.report import phase_table
from tokenmill.bench.server_metrics import (
    Histogram,
    finished_count,
    histogram,
    parse,
    phase_breakdown,
    scrape_settled,
)


def exposition(queue_counts: tuple[int, int, int], queue_sum: float, hits: int, queries: int) -> str:
    """Two label sets (models) whose buckets add up; bounds 0.3, 0.5, +Inf."""
    lines = ["# TYPE tokenmill:request_queue_time_seconds histogram"]
    for model in ("a", "b"):
        for le, count in zip(("0.3", "0.5", "+Inf"), queue_counts, strict=True):
            lines.append(f'tokenmill:request_queue_time_seconds_bucket{{le="{le}",model_name="{model}"}} {count}')
        lines.append(f'tokenmill:request_queue_time_seconds_sum{{model_name="{model}"}} {queue_sum}')
        lines.append(f'tokenmill:request_queue_time_seconds_count{{model_name="{model}"}} {queue_counts[-1]}')
    lines += ["# TYPE tokenmill:prefix_cache_hits counter", f"tokenmill:prefix_cache_hits_total {hits}",
              "# TYPE tokenmill:prefix_cache_queries counter", f"tokenmill:prefix_cache_queries_total {queries}"]
    return "\n".join(lines) + "\n"


def test_quantiles_interpolate_inside_buckets_as_promql() -> None:
    h = Histogram(((0.3, 2.0), (0.5, 6.0), (float("inf"), 8.0)), sum=3.0)
    assert h.quantile(0.25) == pytest.approx(0.3)  # rank 2: the top of the first bucket
    assert h.quantile(0.5) == pytest.approx(0.3 + 0.2 * (4 - 2) / (6 - 2))
    assert h.quantile(0.99) == pytest.approx(0.5)  # in +Inf: the highest finite bound
    assert h.quantile(0.1) == pytest.approx(0.3 * 0.8 / 2)  # the first bucket starts at 0
    assert Histogram(((1.0, 0.0), (float("inf"), 0.0)), 0.0).quantile(0.5) is None
    assert h.summary()["mean"] == pytest.approx(3.0 / 8)


def test_breakdown_is_the_difference_of_two_scrapes() -> None:
    before = parse(exposition((1, 1, 1), 0.1, hits=10, queries=40))
    after = parse(exposition((3, 5, 6), 1.6, hits=70, queries=160))
    queue = histogram(after, "tokenmill:request_queue_time_seconds")
    assert queue is not None and queue.count == 12  # two models of 6
    breakdown = phase_breakdown(before, after)
    assert breakdown is not None and (breakdown["source"], breakdown["method"]) == ("tokenmill", "buckets")
    stats = breakdown["phases_s"]["queue"]
    assert stats["count"] == 10  # (6 - 1) per model
    assert stats["mean"] == pytest.approx((1.6 - 0.1) * 2 / 10)
    assert stats["p50"] == pytest.approx(0.3 + 0.2 * (5 - 4) / (8 - 4))  # delta buckets 4, 8, 10
    assert breakdown["prefix_cache_hit_rate"] == pytest.approx(120 / 240)
    assert set(breakdown["phases_s"]) == {"queue"}


def test_no_breakdown_without_phase_metrics() -> None:
    other = parse("# TYPE up gauge\nup 1\n")
    assert phase_breakdown(other, other) is None
    assert phase_breakdown(None, None) is None


def test_scrape_waits_until_finished_requests_are_booked() -> None:
    """The second scrape still lacks the last request; the third has it, the fourth confirms."""
    counts = iter([4, 5, 6, 6, 6])

    def handler(request: httpx.Request) -> httpx.Response:
        n = next(counts)
        body = ("# TYPE tokenmill:e2e_request_latency_seconds histogram\n"
                f'tokenmill:e2e_request_latency_seconds_bucket{{le="+Inf"}} {n}\n'
                f"tokenmill:e2e_request_latency_seconds_count {n}\ntokenmill:e2e_request_latency_seconds_sum 1\n"
                "# TYPE tokenmill:request_queue_time_seconds histogram\n"
                'tokenmill:request_queue_time_seconds_bucket{le="+Inf"} 0\n')
        return httpx.Response(200, text=body)

    async def go() -> float | None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return finished_count(await scrape_settled(client, "http://x", min_finished=6))

    assert asyncio.run(go()) == 6


def test_quantiles_in_the_first_bucket_are_capped_by_the_sum() -> None:
    """The reported case: 100 queue times of about 0.1 ms, all under the first bound (0.3 s).
    Interpolation alone printed P50 150 ms and P99 297 ms; the k-th smallest of N non-negative
    values is at most sum / (N - k + 1)."""
    h = Histogram(((0.3, 100.0), (0.5, 100.0), (float("inf"), 100.0)), sum=0.01)
    assert h.interpolated_quantile(0.5) == pytest.approx(0.15) and h.interpolated_quantile(0.99) == pytest.approx(0.297)
    assert h.quantile(0.5) == pytest.approx(0.01 / 51) and h.quantile(0.99) == pytest.approx(0.01 / 2)
    assert h.summary()["mean"] == pytest.approx(0.0001)


def timed(queue_s: float, prefill_s: float, decode_s: float) -> RequestRecord:
    server_s = {"queue_s": queue_s, "prefill_s": prefill_s, "decode_s": decode_s, "ttft_s": queue_s + prefill_s,
                "e2e_s": queue_s + prefill_s + decode_s}
    return RequestRecord(0, 0, start_s=0.0, ttft_s=0.5, e2e_s=1.0, output_tokens=4, server_s=server_s)


def test_breakdown_is_exact_when_every_request_carries_the_servers_times() -> None:
    records = [timed(0.0001 * (i + 1), 0.05, 0.5 + i / 100) for i in range(20)] + [failed(1, 0, "timeout", "")]
    before = parse(exposition((1, 1, 1), 0.1, hits=10, queries=40))
    after = parse(exposition((3, 5, 6), 1.6, hits=70, queries=160))
    breakdown = phase_breakdown(before, after, records)
    assert breakdown is not None and breakdown["method"] == "exact"
    queue = breakdown["phases_s"]["queue"]
    values = [0.0001 * (i + 1) for i in range(20)]
    assert queue["count"] == 20 and queue["p50"] == pytest.approx(float(np.percentile(values, 50)))
    assert queue["p99"] == pytest.approx(float(np.percentile(values, 99))) and queue["max"] == pytest.approx(0.002)
    assert set(breakdown["phases_s"]) == {"queue", "prefill", "decode", "ttft", "e2e"}
    assert breakdown["prefix_cache_hit_rate"] == pytest.approx(120 / 240)  # still from the scrape
    assert phase_breakdown(None, None, records) == {**breakdown, "prefix_cache_hit_rate": None}


def test_one_request_without_the_servers_times_falls_back_to_the_buckets() -> None:
    records = [timed(0.001, 0.05, 0.5), RequestRecord(0, 1, start_s=0.0, ttft_s=0.5, e2e_s=1.0, output_tokens=4)]
    before = parse(exposition((1, 1, 1), 0.1, hits=10, queries=40))
    after = parse(exposition((3, 5, 6), 1.6, hits=70, queries=160))
    breakdown = phase_breakdown(before, after, records)
    assert breakdown is not None and breakdown["method"] == "buckets"
    assert phase_breakdown(None, None, records) is None


def test_rounds_pool_exact_times_but_not_buckets() -> None:
    records = [timed(0.001, 0.05, 0.5), timed(0.003, 0.05, 0.5)]
    one = phase_breakdown(None, None, records[:1])
    pooled = pooled_server([one, one], records)
    assert pooled is not None and pooled["phases_s"]["queue"]["count"] == 2
    assert pooled["phases_s"]["queue"]["mean"] == pytest.approx(0.002)
    buckets = {"method": "buckets", "phases_s": {}}
    assert pooled_server([buckets], records[:1]) is buckets
    assert pooled_server([buckets, buckets], [RequestRecord(0, 0, start_s=0.0, ttft_s=0.5, e2e_s=1.0)]) is None


@pytest.mark.parametrize(("method", "label"), [("exact", "tokenmill: exact, per request"),
                                               ("buckets", "vllm /metrics buckets: approximate")])
def test_the_phase_table_says_how_its_figures_were_obtained(method: str, label: str) -> None:
    records = [timed(0.001, 0.05, 0.5)]
    server = {"source": "tokenmill" if method == "exact" else "vllm", "method": method,
              "phases_s": {"queue": {"count": 1, "mean": 0.001, "p50": 0.001, "p90": 0.001, "p95": 0.001,
                                     "p99": 0.001}}, "prefix_cache_hit_rate": None}
    result = RunResult(Target("http://x", "m"), {}, compute_metrics(records, 1.0, SLO()), server, records, 0.0)
    table = phase_table(result)
    assert str(table.title).startswith(f"server-side phases ({label}), ms")
    console = Console(record=True, width=200)
    console.print(table)
    assert "│ queue │     1 │  1.0 │" in console.export_text()
