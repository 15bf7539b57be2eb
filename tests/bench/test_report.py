"""compare's arithmetic (ratios, pooled rounds), the markdown table and the three plots, on
synthetic results: no server."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.bench.bench import RunResult, pool, ratios
from tokenmill.bench.client import Target
from tokenmill.bench.metrics import SLO, compute_metrics
from tokenmill.bench.records import RequestRecord, failed
from tokenmill.bench.report import markdown_table, ratio_rows
from tokenmill.bench.runner import RunOutcome


def ok(session: int, start: float, ttft: float, e2e: float, out: int) -> RequestRecord:
    gap_s = (e2e - ttft) / (out - 1)
    return RequestRecord(session, 0, start_s=start, ttft_s=ttft, e2e_s=e2e, itl_s=[gap_s] * (out - 1),
                         prompt_tokens=10, output_tokens=out)


def result(url: str, rate: float | None, speed: float) -> RunResult:
    """Three requests; `speed` 2 halves every latency and the duration."""
    records = [ok(i, i / speed, 0.5 / speed, 2.5 / speed, 5) for i in range(3)] + [failed(3, 0, "timeout", "")]
    metrics = compute_metrics(records, 10.0 / speed, SLO(ttft_s=0.3))
    return RunResult(Target(url, "m"), {"process": "poisson", "rate": rate, "burstiness": 1.0}, metrics, None,
                     records, 0.0)


def test_ratios_are_target_over_baseline() -> None:
    slow, fast = result("http://a", 1.0, 1.0), result("http://b", 1.0, 2.0)
    got = ratios(slow.metrics, fast.metrics)
    assert got["output_throughput"] == pytest.approx(2.0) and got["request_throughput"] == pytest.approx(2.0)
    assert got["ttft_s.p50"] == pytest.approx(0.5) and got["e2e_s.p99"] == pytest.approx(0.5)
    assert got["tpot_s.p99"] == pytest.approx(0.5) and got["itl_s.p50"] == pytest.approx(0.5)
    assert got["goodput"] is None  # the slow baseline has goodput 0: no ratio, not infinity
    assert ratios(fast.metrics, slow.metrics)["goodput"] == pytest.approx(0.0)


def test_ratio_rows_pair_each_rate_with_its_first_target() -> None:
    results = [result("http://a", 1.0, 1.0), result("http://b", 1.0, 2.0), result("http://c", 1.0, 4.0),
               result("http://a", None, 1.0), result("http://b", None, 2.0), result("http://c", None, 4.0)]
    rows = ratio_rows(results, num_targets=3)
    assert [(r["rate"], r["baseline"], r["target"]) for r in rows] == [
        (1.0, "http://a", "http://b"), (1.0, "http://a", "http://c"),
        (None, "http://a", "http://b"), (None, "http://a", "http://c")]
    assert rows[1]["ratios"]["output_throughput"] == pytest.approx(4.0)


def test_pool_puts_rounds_on_one_timeline() -> None:
    first = RunOutcome([ok(0, 0.5, 0.1, 1.0, 2)], duration_s=3.0, started_unix=0.0)
    second = RunOutcome([ok(0, 0.5, 0.1, 1.0, 2), failed(1, 0, "timeout", "")], duration_s=2.0, started_unix=9.0)
    pooled = pool([first, second])
    assert [r.start_s for r in pooled] == [0.5, 3.5, None]
    assert first.records[0].start_s == 0.5  # the originals are untouched


def test_markdown_table_has_a_row_per_metric_and_a_column_per_result() -> None:
    lines = markdown_table([result("http://a", 1.0, 1.0), result("http://b", 1.0, 2.0)], ["A", "B"]).splitlines()
    assert lines[0] == "| metric | A | B |" and lines[1] == "|---|---:|---:|"
    assert "| successful / sent | 3 / 4 | 3 / 4 |" in lines
    assert "| TTFT p50 (ms) | 500.0 | 250.0 |" in lines
    assert "| errors | timeout: 1 | timeout: 1 |" in lines


def test_plots_write_pngs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from tokenmill.bench.plots import plot_cdfs, plot_sweep, plot_timeline

    results = [result("http://a", rate, speed) for rate, speed in ((1.0, 1.0), (2.0, 1.5), (4.0, 2.0))]
    paths = [plot_cdfs(results[:2], ["a", "b"], tmp_path / "cdf.png"),
             plot_sweep(results, ["a"] * 3, tmp_path / "sweep.png"),
             plot_timeline(results[0], tmp_path / "timeline.png")]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
