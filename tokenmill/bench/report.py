"""The result file (JSON), the console tables (rich) and a markdown table for reports.

Latencies are stored in seconds in the JSON, shown in milliseconds in tables, as vLLM prints them.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenmill.bench.bench import BenchConfig, Prepared, RunResult, ratios
from tokenmill.bench.metrics import BenchMetrics
from tokenmill.bench.server_metrics import EXACT
from tokenmill.bench.stats import Summary
from tokenmill.bench.workloads import get_workload

SCHEMA = "tokenmill-bench/1"
Row = tuple[str, Callable[[BenchMetrics], str]]


def document(config: BenchConfig, prepared: Prepared, results: Sequence[RunResult],
             command: Sequence[str]) -> dict[str, Any]:
    workload = get_workload(config.workload)
    doc: dict[str, Any] = {
        "schema": SCHEMA, "created_unix": time.time(), "command": list(command),
        "workload": {"name": workload.name, "api": workload.api.value, "params": config.params.as_dict(),
                     "dataset": config.dataset},
        # JSON has no infinity: an unlimited rate is null, as in each run's arrival description.
        "arrival": {"process": config.arrival,
                    "sweep_rates": [None if math.isinf(r) else r for r in config.rates] or None},
        "max_concurrency": config.max_concurrency, "seed": config.seed, "ignore_eos": config.ignore_eos,
        "slo": {"ttft_s": config.slo.ttft_s, "tpot_s": config.slo.tpot_s, "e2e_s": config.slo.e2e_s,
                "percentile": config.slo.percentile},
        "usd_per_hour": config.usd_per_hour, "tokenizer": prepared.tokenizer,
        "runs": [result.to_json() for result in results],
    }
    if len(prepared.targets) > 1:
        doc["ratios"] = ratio_rows(results, len(prepared.targets))
    return doc


def ratio_rows(results: Sequence[RunResult], num_targets: int) -> list[dict[str, Any]]:
    """For each rate: every other target against the first one given."""
    rows: list[dict[str, Any]] = []
    for start in range(0, len(results), num_targets):
        base, *others = results[start:start + num_targets]
        rows.extend({"rate": base.rate, "baseline": base.target.base_url, "target": other.target.base_url,
                     "ratios": ratios(base.metrics, other.metrics)} for other in others)
    return rows


def save_json(doc: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    return path


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _latency_rows(label: str, pick: Callable[[BenchMetrics], Summary]) -> list[Row]:
    def cell(stat: str) -> Callable[[BenchMetrics], str]:
        return lambda metrics: _ms(getattr(pick(metrics), stat))

    return [(f"{label} {stat} (ms)", cell(stat)) for stat in ("mean", "p50", "p99")]


ROWS: list[Row] = [
    ("successful / sent", lambda m: f"{m.num_completed} / {m.num_requests}"),
    ("duration (s)", lambda m: _num(m.duration_s)),
    ("request throughput (req/s)", lambda m: _num(m.request_throughput, 3)),
    ("output throughput (tok/s)", lambda m: _num(m.output_throughput)),
    ("total token throughput (tok/s)", lambda m: _num(m.total_token_throughput)),
    ("goodput (req/s)", lambda m: _num(m.goodput, 3)),
    ("SLO attainment", lambda m: "-" if m.slo_attainment is None else f"{m.slo_attainment:.0%}"),
    ("SLO met", lambda m: {None: "-", True: "yes", False: "no"}[m.is_slo_met]),
    *_latency_rows("TTFT", lambda m: m.ttft), *_latency_rows("TPOT", lambda m: m.tpot),
    *_latency_rows("ITL", lambda m: m.itl), *_latency_rows("E2E", lambda m: m.e2e),
    ("max concurrency", lambda m: str(m.max_concurrency)),
    ("errors", lambda m: ", ".join(f"{k}: {v}" for k, v in m.errors.items()) or "-"),
    ("$ / M output tokens", lambda m: _num(m.usd_per_million_output_tokens, 3)),
]


def column_name(result: RunResult, many_targets: bool) -> str:
    if "rate" in result.arrival:
        rate = result.arrival["rate"]
        rate_text = "inf" if rate is None else f"{rate:g}/s"
    else:
        rate_text = str(result.arrival.get("process", ""))
    return f"{result.target.base_url}\n{rate_text}" if many_targets else str(rate_text)


def print_results(results: Sequence[RunResult], title: str, console: Console | None = None) -> None:
    console = console or Console()
    many_targets = len({r.target.base_url for r in results}) > 1
    table = Table(title=title)
    table.add_column("metric", no_wrap=True)
    for result in results:
        table.add_column(column_name(result, many_targets), justify="right")
    for label, cell in ROWS:
        table.add_row(label, *(cell(result.metrics) for result in results))
    console.print(table)
    for result in results:
        if result.server is not None:
            console.print(phase_table(result))


def phase_table(result: RunResult) -> Table:
    server = result.server or {}
    hit_rate = server.get("prefix_cache_hit_rate")
    caption = f"prefix-cache hit rate {hit_rate:.0%}" if isinstance(hit_rate, float) else None
    table = Table(title=f"server-side phases ({phase_source(server)}), ms: {result.target.base_url}", caption=caption)
    for column in ("phase", "count", "mean", "p50", "p90", "p95", "p99"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for phase, stats in server.get("phases_s", {}).items():
        table.add_row(phase, f"{stats['count']:.0f}", *(_ms(stats[k]) for k in ("mean", "p50", "p90", "p95", "p99")))
    return table


def phase_source(server: dict[str, Any]) -> str:
    if server.get("method") == EXACT:
        return f"{server.get('source')}: exact, per request"
    return f"{server.get('source')} /metrics buckets: approximate"


def print_ratios(rows: Sequence[dict[str, Any]], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="ratios: target / baseline (throughput > 1 and latency < 1 favour the target)")
    table.add_column("metric")
    for row in rows:
        rate = "" if row["rate"] is None else f" @ {row['rate']:g}/s"
        table.add_column(f"{row['target']}\n/ {row['baseline']}{rate}", justify="right")
    for name in rows[0]["ratios"] if rows else []:
        table.add_row(name, *(_num(row["ratios"][name], 3) for row in rows))
    console.print(table)


def markdown_table(results: Sequence[RunResult], labels: Sequence[str]) -> str:
    lines = ["| metric | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    lines += [f"| {label} | " + " | ".join(cell(r.metrics) for r in results) + " |" for label, cell in ROWS]
    return "\n".join(lines)
