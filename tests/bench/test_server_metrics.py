"""Queue/prefill/decode from /metrics deltas: parsing, subtraction and PromQL-style quantiles."""

from __future__ import annotations

import asyncio

import httpx
import pytest

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
    assert breakdown is not None and breakdown["source"] == "tokenmill"
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
