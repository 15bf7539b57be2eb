"""Results people can read: rich tables in the terminal, a JSON document, and a PNG of the deltas."""

from __future__ import annotations

import json
import math
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenmill.eval.client import EvalError
from tokenmill.eval.compare import Comparison
from tokenmill.eval.metrics import Interval
from tokenmill.eval.runner import TaskRun


def _fmt(value: float, digits: int = 4) -> str:
    return "-" if not math.isfinite(value) else f"{value:.{digits}g}"


def _ci(interval: Interval | None, digits: int = 4) -> str:
    if interval is None or not math.isfinite(interval.low):
        return "-"
    return f"[{_fmt(interval.low, digits)}, {_fmt(interval.high, digits)}]"


def run_table(runs: Sequence[TaskRun], title: str) -> Table:
    table = Table(title=title)
    for column in ("task", "metric", "value", "95% CI", "items", "s"):
        table.add_column(column, justify="left" if column in ("task", "metric") else "right")
    for run in runs:
        for name, value in run.metrics.items():
            table.add_row(run.task.name, name, _fmt(value), _ci(run.intervals.get(name)), str(len(run.items)),
                          f"{run.seconds:.1f}")
    return table


def comparison_tables(comparison: Comparison) -> list[Table]:
    deltas = Table(title="candidate - reference (paired bootstrap 95% CI; relative metrics in %)")
    for column in ("task", "metric", "reference", "candidate", "delta", "95% CI", "p", "test"):
        deltas.add_column(column, justify="left" if column in ("task", "metric", "test") else "right")
    for row in comparison.deltas:
        shown = f"{_fmt(row.delta_pct, 3)}%" if row.relative else _fmt(row.delta)
        deltas.add_row(row.task, row.metric, _fmt(row.reference), _fmt(row.candidate), shown, _ci(row.interval),
                       _fmt(row.p_value, 3), row.test)
    pairs = Table(title="candidate against reference, position by position")
    for column in ("task", "metric", "value", "95% CI"):
        pairs.add_column(column, justify="left" if column in ("task", "metric") else "right")
    for pair in comparison.pairs:
        pairs.add_row(pair.task, pair.metric, _fmt(pair.value), _ci(pair.interval))
    tables = [deltas] + ([pairs] if comparison.pairs else [])
    if comparison.gates:
        gates = Table(title="gates")
        for column in ("gate", "result", "detail"):
            gates.add_column(column)
        for gate in comparison.gates:
            verdict = "[green]PASS[/green]" if gate.passed else "[red]FAIL[/red]"
            detail = ", ".join(f"{k}={_fmt(v, 6)}" for k, v in gate.values.items()) if gate.passed else gate.reason
            gates.add_row(gate.gate.text, verdict, detail)
        tables.append(gates)
    return tables


def print_tables(tables: Sequence[Table], console: Console | None = None) -> None:
    console = console or Console()
    for table in tables:
        console.print(table)


def environment() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "python": platform.python_version()}


def comparison_dict(comparison: Comparison) -> dict[str, Any]:
    def num(v: float) -> float | None:
        return v if math.isfinite(v) else None

    return {
        "passed": comparison.passed,
        "deltas": [{"task": r.task, "metric": r.metric, "reference": num(r.reference), "candidate": num(r.candidate),
                    "delta": num(r.delta), "delta_pct": num(r.delta_pct), "relative": r.relative,
                    "interval": [num(r.interval.low), num(r.interval.high)], "p_value": num(r.p_value),
                    "test": r.test} for r in comparison.deltas],
        "pairs": [{"task": p.task, "metric": p.metric, "value": num(p.value),
                   "interval": [num(p.interval.low), num(p.interval.high)]} for p in comparison.pairs],
        "gates": [{"gate": g.gate.text, "passed": g.passed, "reason": g.reason,
                   "values": {k: num(v) for k, v in g.values.items()}} for g in comparison.gates],
    }


def save_json(document: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n")
    return path


def plot_comparison(comparison: Comparison, path: Path, title: str) -> Path:
    """One small panel per delta and per pairwise metric (each on its own scale): the point, its
    95% interval, and the zero line (deltas) so a reader sees at once which side of it each falls."""
    try:
        import matplotlib
    except ImportError as exc:
        raise EvalError("the plot needs matplotlib: pip install matplotlib (or pass --no-plot)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: list[tuple[str, float, Interval, bool]] = []
    for r in comparison.deltas:
        value = r.delta_pct if r.relative else r.delta
        rows.append((f"{r.task} {r.metric} Δ{' %' if r.relative else ''}", value, r.interval, True))
    rows += [(f"{p.task} {p.metric}", p.value, p.interval, False) for p in comparison.pairs]
    fig, axes = plt.subplots(len(rows) or 1, 1, figsize=(7, 0.55 * max(len(rows), 1) + 1.0), squeeze=False)
    for ax, (label, value, interval, is_delta) in zip(axes[:, 0], rows, strict=False):
        if math.isfinite(value):
            low = value - interval.low if math.isfinite(interval.low) else 0.0
            high = interval.high - value if math.isfinite(interval.high) else 0.0
            ax.errorbar([value], [0], xerr=[[max(low, 0.0)], [max(high, 0.0)]], fmt="o", color="tab:blue", capsize=4)
        if is_delta:
            ax.axvline(0.0, color="grey", linewidth=0.8)
        ax.set_yticks([0])
        ax.set_yticklabels([label], fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    axes[0, 0].set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
