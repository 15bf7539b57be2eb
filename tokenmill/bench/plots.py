"""PNG plots: latency CDFs, throughput vs latency across a rate sweep, and a per-request timeline.

matplotlib is imported lazily (with the Agg backend: no display needed) so that a run that
asks for no plots never pays for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.bench.bench import RunResult
from tokenmill.bench.errors import BenchError
from tokenmill.bench.records import RequestRecord

Samples = Callable[[RunResult], list[float]]
CDF_PANELS: tuple[tuple[str, Samples], ...] = (
    ("TTFT", lambda r: [x.ttft_s for x in r.records if x.is_success and x.ttft_s is not None]),
    ("TPOT", lambda r: [t for x in r.records if (t := x.tpot_s) is not None]),
    ("ITL", lambda r: [gap for x in r.records if x.is_success for gap in x.itl_s]),
    ("E2E", lambda r: [x.e2e_s for x in r.records if x.is_success and x.e2e_s is not None]),
)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise BenchError("plots need matplotlib: pip install matplotlib (or pass --no-plots)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    return path


def plot_cdfs(results: Sequence[RunResult], labels: Sequence[str], path: Path, title: str = "") -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (name, samples) in zip(axes.flat, CDF_PANELS, strict=True):
        for result, label in zip(results, labels, strict=True):
            values = np.sort(np.asarray(samples(result))) * 1e3
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=label)
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def plot_sweep(results: Sequence[RunResult], labels: Sequence[str], path: Path, title: str = "") -> Path:
    """Output throughput against P50/P99 TTFT and TPOT, one line per label across its rates."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for label in dict.fromkeys(labels):
        points = sorted((r.metrics.output_throughput, r) for r, lab in zip(results, labels, strict=True)
                        if lab == label)
        throughput = [tput for tput, _ in points]
        for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
            for stat, style in (("p50", "o-"), ("p99", "s--")):
                values = [_ms(getattr(getattr(r.metrics, metric), stat)) for _, r in points]
                ax.plot(throughput, values, style, label=f"{label} {stat}")
    for ax, metric in zip(axes, ("TTFT", "TPOT"), strict=True):
        ax.set(title=f"{metric} vs output throughput", xlabel="output tokens/s", ylabel=f"{metric} (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def _ms(value: float | None) -> float:
    return float("nan") if value is None else value * 1e3


def plot_timeline(result: RunResult, path: Path, title: str = "") -> Path:
    """One line per request, by send time: waiting for the first token (light), then streaming (dark)."""
    plt = _pyplot()
    sent = sorted((r for r in result.records if r.start_s is not None), key=lambda r: r.start_s or 0.0)
    fig, ax = plt.subplots(figsize=(11, max(3.0, min(12.0, 0.12 * len(sent) + 2))))
    for row, record in enumerate(sent):
        _draw_request(ax, row, record)
    ax.set(title=title or "requests over time", xlabel="seconds since the start of the run", ylabel="request")
    ax.plot([], [], color="tab:blue", alpha=0.35, lw=3, label="waiting for first token")
    ax.plot([], [], color="tab:blue", lw=3, label="streaming")
    ax.plot([], [], "rx", label="failed")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _draw_request(ax: Any, row: int, record: RequestRecord) -> None:
    start = record.start_s or 0.0
    if not record.is_success or record.ttft_s is None or record.e2e_s is None:
        ax.plot([start], [row], "rx")
        return
    ax.plot([start, start + record.ttft_s], [row, row], color="tab:blue", alpha=0.35, lw=3)
    ax.plot([start + record.ttft_s, start + record.e2e_s], [row, row], color="tab:blue", lw=3)
