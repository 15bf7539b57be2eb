"""Every metric against values computed by hand on a small synthetic trace, plus edge cases."""

from __future__ import annotations

import pytest

from tokenmill.bench.metrics import SLO, compute_metrics, max_concurrency, usd_per_million_tokens
from tokenmill.bench.records import RequestRecord, failed
from tokenmill.bench.stats import summarize

DURATION_S = 10.0


def ok(session: int, start: float, ttft: float, e2e: float, out: int, prompt: int, itl: list[float]) -> RequestRecord:
    return RequestRecord(session, 0, start_s=start, ttft_s=ttft, e2e_s=e2e, itl_s=itl, prompt_tokens=prompt,
                         output_tokens=out)


def trace() -> list[RequestRecord]:
    """A: TPOT (2.5-0.5)/4 = 0.5; B: one token, no TPOT; C: TPOT (4.2-0.2)/10 = 0.4; D, E failed."""
    return [
        ok(0, 0.0, 0.5, 2.5, 5, 10, [0.5] * 4),
        ok(1, 1.0, 1.0, 2.0, 1, 20, []),
        ok(2, 2.0, 0.2, 4.2, 11, 30, [0.4] * 10),
        failed(3, 0, "http_500", "boom", start_s=3.0),
        failed(4, 0, "timeout", "slow", start_s=4.0),
    ]


def test_counts_and_throughputs_use_successful_requests_over_the_duration() -> None:
    m = compute_metrics(trace(), DURATION_S)
    assert (m.num_requests, m.num_completed, m.num_failed) == (5, 3, 2)
    assert (m.total_input_tokens, m.total_output_tokens) == (60, 17)
    assert m.request_throughput == pytest.approx(0.3)
    assert m.output_throughput == pytest.approx(1.7)
    assert m.total_token_throughput == pytest.approx(7.7)
    assert m.errors == {"http_500": 1, "timeout": 1}
    assert m.max_concurrency == 3  # A [0, 2.5], B [1, 3], C [2, 6.2] overlap at t = 2


def test_ttft_percentiles_are_numpy_linear() -> None:
    ttft = compute_metrics(trace(), DURATION_S).ttft  # sorted samples 0.2, 0.5, 1.0
    assert ttft.count == 3
    assert ttft.mean == pytest.approx(1.7 / 3)
    assert ttft.p50 == pytest.approx(0.5)
    assert ttft.p90 == pytest.approx(0.5 + 0.8 * 0.5)  # rank 0.9 * 2 = 1.8
    assert ttft.p95 == pytest.approx(0.5 + 0.9 * 0.5)
    assert ttft.p99 == pytest.approx(0.5 + 0.98 * 0.5)
    assert ttft.max == pytest.approx(1.0)


def test_tpot_skips_one_token_requests_and_itl_pools_gaps() -> None:
    m = compute_metrics(trace(), DURATION_S)
    assert m.tpot.count == 2
    assert (m.tpot.mean, m.tpot.p50, m.tpot.max) == (pytest.approx(0.45), pytest.approx(0.45), pytest.approx(0.5))
    assert m.itl.count == 14
    assert m.itl.mean == pytest.approx((4 * 0.5 + 10 * 0.4) / 14)
    assert m.itl.p50 == pytest.approx(0.4)
    assert (m.e2e.mean, m.e2e.max) == (pytest.approx(8.7 / 3), pytest.approx(4.2))
    assert (m.output_tokens.mean, m.output_tokens.p50) == (pytest.approx(17 / 3), pytest.approx(5.0))


def test_goodput_needs_every_slo_and_failures_miss() -> None:
    m = compute_metrics(trace(), DURATION_S, SLO(ttft_s=0.6, tpot_s=0.45))
    # A: TPOT 0.5 too slow; B: TTFT 1.0 too slow; C meets both; D, E failed.
    assert m.goodput == pytest.approx(1 / DURATION_S)
    assert m.slo_attainment == pytest.approx(1 / 5)


def test_goodput_counts_a_one_token_request_as_tpot_zero() -> None:
    m = compute_metrics(trace(), DURATION_S, SLO(tpot_s=0.45))
    assert m.goodput == pytest.approx(2 / DURATION_S)  # B (TPOT 0 as in vLLM) and C


def test_run_level_slo_check_at_the_percentile() -> None:
    records = trace()[:3]
    met = compute_metrics(records, DURATION_S, SLO(e2e_s=4.5, percentile=99))
    assert met.is_slo_met is True
    assert met.slo_checks[0].value_s == pytest.approx(2.5 + 0.98 * 1.7)
    missed = compute_metrics(records, DURATION_S, SLO(ttft_s=0.85, percentile=90))
    assert missed.is_slo_met is False  # P90 TTFT is 0.9
    with_failures = compute_metrics(trace(), DURATION_S, SLO(e2e_s=100.0))
    assert with_failures.is_slo_met is False  # 40% failed fills the 1% tail
    assert compute_metrics(records, DURATION_S).is_slo_met is None


def test_one_request() -> None:
    m = compute_metrics([ok(0, 0.0, 0.25, 1.25, 3, 7, [0.5, 0.5])], 2.0, SLO(ttft_s=0.3))
    for summary in (m.ttft, m.e2e):
        assert summary.count == 1 and summary.p50 == summary.p99 == summary.max == summary.mean
    assert m.tpot.p99 == pytest.approx(0.5)
    assert m.itl.p90 == pytest.approx(0.5)
    assert (m.goodput, m.slo_attainment, m.max_concurrency) == (0.5, 1.0, 1)


def test_one_token_outputs_only() -> None:
    m = compute_metrics([ok(i, float(i), 0.1, 0.1, 1, 4, []) for i in range(3)], 3.0, SLO(tpot_s=0.01))
    assert m.tpot.count == 0 and m.tpot.p99 is None and m.itl.mean is None
    assert m.output_throughput == pytest.approx(1.0)
    assert m.goodput == pytest.approx(1.0)  # TPOT counts as 0 for goodput
    assert m.slo_checks[0].value_s is None and m.is_slo_met is False  # no TPOT sample to judge


def test_all_failed_and_no_requests() -> None:
    m = compute_metrics([failed(0, 0, "connect_error", "refused"), failed(0, 1, "skipped", "")], 1.0, SLO(e2e_s=1.0))
    assert (m.num_completed, m.request_throughput, m.output_throughput) == (0, 0.0, 0.0)
    assert m.ttft.mean is None and m.e2e.p99 is None and m.max_concurrency == 0
    assert (m.goodput, m.slo_attainment, m.errors) == (0.0, 0.0, {"connect_error": 1, "skipped": 1})
    assert m.usd_per_million_output_tokens is None
    empty = compute_metrics([], 1.0, SLO(e2e_s=1.0))
    assert empty.num_requests == 0 and empty.slo_attainment is None
    with pytest.raises(ValueError):
        compute_metrics([], 0.0)


def test_cost_per_million_output_tokens() -> None:
    m = compute_metrics(trace(), DURATION_S, usd_per_hour=3.6)
    assert m.usd_per_million_output_tokens == pytest.approx(3.6 / (1.7 * 3600) * 1e6)
    assert usd_per_million_tokens(2.0, 1e6 / 3600) == pytest.approx(2.0)
    assert usd_per_million_tokens(None, 5.0) is None


def test_back_to_back_requests_do_not_overlap() -> None:
    assert max_concurrency([ok(0, 0.0, 0.1, 1.0, 2, 1, [0.9]), ok(1, 1.0, 0.1, 1.0, 2, 1, [0.9])]) == 1


def test_summary_of_nothing_and_to_json_round_trip() -> None:
    assert summarize([]).as_dict() == {"count": 0, "mean": None, "p50": None, "p90": None, "p95": None,
                                       "p99": None, "max": None}
    record = trace()[0]
    assert RequestRecord.from_json(record.to_json()) == record
    data = compute_metrics(trace(), DURATION_S, SLO(ttft_s=0.6)).to_json()
    assert data["num_failed"] == 2 and data["ttft_s"]["p50"] == pytest.approx(0.5)
    assert data["slo_checks"][0]["metric"] == "ttft" and data["is_slo_met"] is False
