"""The `mixed` workload: chat users and a batch job on one target at the same time.

A dataproc burst (completions, `service_tier: flex`, which tokenmill maps to its batch class) is
sent at t = 0; chatbot sessions (chat, `service_tier: priority` → interactive) arrive from
`chat_start_s` on, while the burst is running. The phases, each against the same target with the
same prompts and arrival times, one after another:

    chat_alone    the chat sessions, nothing else       → the chat figures' peer
    batch_alone   the burst, nothing else               → the throughput peer
    mixed         both at once                          → chat goodput and TTFT/TPOT, batch throughput

and the ratios the issue judges (mixed / alone): chat P99 TPOT and TTFT, total output tokens/s of
the mixed run over the batch burst's alone. The tiers are OpenAI's own names, so other servers
accept them (vLLM reads `priority`/`flex` or ignores the field; llama.cpp ignores it).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tokenmill.bench.arrivals import ArrivalOptions, build_arrival
from tokenmill.bench.bench import discover_model
from tokenmill.bench.client import Target, send, server_root
from tokenmill.bench.errors import BenchError
from tokenmill.bench.metrics import SLO, BenchMetrics, compute_metrics
from tokenmill.bench.records import RequestRecord
from tokenmill.bench.runner import RunOutcome, RunSpec, make_client, run_sessions
from tokenmill.bench.sessions import Api, Session
from tokenmill.bench.tokens import PromptFactory, connect_tokenizer
from tokenmill.bench.workloads import Dataproc, Mixed, WorkloadParams

SCHEMA = "tokenmill-bench-mixed/1"
PHASES = ("chat_alone", "batch_alone", "mixed")
CHAT, BATCH = "chat", "batch"


@dataclass(slots=True, frozen=True)
class MixedConfig:
    chat: WorkloadParams = field(default_factory=lambda: Mixed().default_params())
    batch: WorkloadParams = field(default_factory=lambda: Mixed().batch_params())
    chat_arrival: str = "poisson"
    chat_options: ArrivalOptions = field(default_factory=lambda: ArrivalOptions(rate=1.0))
    chat_start_s: float = 3.0  # chat sessions arrive this long after the burst was sent
    chat_tier: str | None = "priority"  # None: send no service_tier (the server's default for chat)
    batch_tier: str | None = "flex"
    batch_max_concurrency: int | None = None  # a client-side cap on the burst (None: all at once)
    slo: SLO = field(default_factory=lambda: Mixed().default_slo())  # the chat users'
    phases: tuple[str, ...] = PHASES
    seed: int = 0
    ignore_eos: bool = True
    timeout_s: float = 600.0
    warmup: bool = True
    # Seconds without chat before the batch-alone phase when a phase with chat ran before it: a chat
    # within the server's interactive_recent_s (tokenmill: 60 s) keeps even batch-only steps short, so
    # a burst right after chat measures that guard, not the batch job alone. 0: straight after.
    batch_alone_gap_s: float = 0.0

    def __post_init__(self) -> None:
        unknown = [p for p in self.phases if p not in PHASES]
        if unknown or not self.phases:
            raise BenchError(f"phases must be some of {', '.join(PHASES)}; got {', '.join(self.phases) or 'none'}")
        if self.chat_start_s < 0:
            raise BenchError("chat_start_s must be >= 0")
        if self.batch_alone_gap_s < 0:
            raise BenchError("batch_alone_gap_s must be >= 0")

    def as_dict(self) -> dict[str, Any]:
        return {"chat": self.chat.as_dict(), "batch": self.batch.as_dict(), "chat_arrival": self.chat_arrival,
                "chat_rate": self.chat_options.rate, "chat_start_s": self.chat_start_s, "chat_tier": self.chat_tier,
                "batch_tier": self.batch_tier, "batch_max_concurrency": self.batch_max_concurrency,
                "slo": {"ttft_s": self.slo.ttft_s, "tpot_s": self.slo.tpot_s, "e2e_s": self.slo.e2e_s,
                        "percentile": self.slo.percentile},
                "phases": list(self.phases), "seed": self.seed, "ignore_eos": self.ignore_eos,
                "batch_alone_gap_s": self.batch_alone_gap_s}


@dataclass(slots=True)
class ClassRun:
    """One class's requests in one phase; times relative to the phase's start."""

    records: list[RequestRecord]
    metrics: BenchMetrics


@dataclass(slots=True)
class PhaseResult:
    name: str
    duration_s: float  # first send → last answer of every request in the phase
    chat: ClassRun | None
    batch: ClassRun | None
    started_unix: float

    @property
    def total_output_tokens(self) -> int:
        return sum(run.metrics.total_output_tokens for run in (self.chat, self.batch) if run is not None)

    @property
    def total_output_throughput(self) -> float:
        return self.total_output_tokens / self.duration_s

    def to_json(self) -> dict[str, Any]:
        def part(run: ClassRun | None) -> dict[str, Any] | None:
            return None if run is None else {"metrics": run.metrics.to_json(),
                                             "requests": [r.to_json() for r in run.records]}

        return {"phase": self.name, "duration_s": self.duration_s, "started_unix": self.started_unix,
                "total_output_tokens": self.total_output_tokens,
                "total_output_throughput": self.total_output_throughput, "chat": part(self.chat),
                "batch": part(self.batch)}


@dataclass(slots=True)
class MixedResult:
    target: Target
    tokenizer: str
    phases: list[PhaseResult]

    def phase(self, name: str) -> PhaseResult | None:
        return next((p for p in self.phases if p.name == name), None)

    def ratios(self) -> dict[str, float | None]:
        """What the mixed run costs each class against its phase alone (latency: < 1 better)."""
        chat_alone, batch_alone, mixed = (self.phase(n) for n in PHASES)

        def chat(phase: PhaseResult | None, metric: str, stat: str) -> float | None:
            if phase is None or phase.chat is None:
                return None
            value: float | None = getattr(getattr(phase.chat.metrics, metric), stat)
            return value

        out: dict[str, float | None] = {}
        for metric in ("ttft", "tpot"):
            for stat in ("p50", "p99"):
                out[f"chat_{metric}_{stat}"] = _ratio(chat(mixed, metric, stat), chat(chat_alone, metric, stat))
        out["total_output_throughput_vs_batch_alone"] = _ratio(
            mixed.total_output_throughput if mixed else None,
            batch_alone.batch.metrics.output_throughput if batch_alone and batch_alone.batch else None)
        out["batch_output_throughput"] = _ratio(
            mixed.batch.metrics.output_throughput if mixed and mixed.batch else None,
            batch_alone.batch.metrics.output_throughput if batch_alone and batch_alone.batch else None)
        return out


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0 or math.isnan(denominator):
        return None
    return numerator / denominator


# ----------------------------------------------------------------------------------------- running


async def run_mixed(config: MixedConfig, url: str, model: str | None = None,
                    api_key: str | None = None) -> MixedResult:
    async with make_client(config.timeout_s) as client:
        base_url = server_root(url)
        target = Target(base_url, model or await discover_model(client, base_url, api_key), api_key)
        tokenizer = await connect_tokenizer(client, target.base_url, target.model)
        prompts = PromptFactory(tokenizer)
        chat_sessions = await Mixed().build_sessions(config.chat, prompts, np.random.default_rng([config.seed, 0]))
        batch_sessions = await Dataproc().build_sessions(config.batch, prompts,
                                                         np.random.default_rng([config.seed, 2]))
        if config.warmup:
            await _warm_up(client, target)
        phases: list[PhaseResult] = []
        for name in config.phases:
            if name == "batch_alone" and config.batch_alone_gap_s > 0 and any(p.chat for p in phases):
                await asyncio.sleep(config.batch_alone_gap_s)
            phases.append(await run_phase(client, target, config, name, chat_sessions, batch_sessions))
        return MixedResult(target, tokenizer.name, phases)


def chat_spec(config: MixedConfig, sessions: Sequence[Session], delay_s: float) -> RunSpec:
    offsets = build_arrival(config.chat_arrival, config.chat_options).offsets_s(
        len(sessions), np.random.default_rng([config.seed, 1]))
    return RunSpec(Api.CHAT, sessions, [delay_s + t for t in offsets], config.chat.think_time_s, None,
                   config.ignore_eos, extra_body=_tier(config.chat_tier))


def batch_spec(config: MixedConfig, sessions: Sequence[Session]) -> RunSpec:
    return RunSpec(Api.COMPLETIONS, sessions, [0.0] * len(sessions), 0.0, config.batch_max_concurrency,
                   config.ignore_eos, extra_body=_tier(config.batch_tier))


def _tier(tier: str | None) -> dict[str, Any]:
    return {} if tier is None else {"service_tier": tier}


async def run_phase(client: httpx.AsyncClient, target: Target, config: MixedConfig, name: str,
                    chat_sessions: Sequence[Session], batch_sessions: Sequence[Session]) -> PhaseResult:
    """One phase; in `mixed` both runs start together (one clock), the chat sessions `chat_start_s` later."""
    started_unix, start = time.time(), time.perf_counter()
    runs: dict[str, RunOutcome] = {}
    if name == "chat_alone":
        runs[CHAT] = await run_sessions(client, target, chat_spec(config, chat_sessions, 0.0))
    elif name == "batch_alone":
        runs[BATCH] = await run_sessions(client, target, batch_spec(config, batch_sessions))
    else:
        chat, batch = await asyncio.gather(
            run_sessions(client, target, chat_spec(config, chat_sessions, config.chat_start_s)),
            run_sessions(client, target, batch_spec(config, batch_sessions)))
        runs = {CHAT: chat, BATCH: batch}
    duration_s = max(time.perf_counter() - start, 1e-9)
    parts = {kind: _class_run(outcome.records, config.slo if kind == CHAT else None) for kind, outcome in runs.items()}
    return PhaseResult(name, duration_s, parts.get(CHAT), parts.get(BATCH), started_unix)


def pool_phases(phases: Sequence[PhaseResult], slo: SLO | None) -> PhaseResult:
    """Rounds of one phase as one: records pooled, durations and each class's spans added (so
    throughputs are totals over totals and percentiles are over every request of every round)."""
    def pooled(runs: list[ClassRun], with_slo: SLO | None) -> ClassRun | None:
        if not runs:
            return None
        records = [r for run in runs for r in run.records]
        return ClassRun(records, compute_metrics(records, sum(run.metrics.duration_s for run in runs), with_slo))

    return PhaseResult(phases[0].name, sum(p.duration_s for p in phases),
                       pooled([p.chat for p in phases if p.chat is not None], slo),
                       pooled([p.batch for p in phases if p.batch is not None], None), phases[0].started_unix)


def _class_run(records: list[RequestRecord], slo: SLO | None) -> ClassRun:
    """Metrics over the class's own span (its first send → its last answer): in `mixed` the chat
    sessions start late, and the burst's duration should not dilute their goodput."""
    starts = [r.start_s for r in records if r.start_s is not None]
    ends = [e for r in records if (e := r.end_s) is not None]
    span_s = max(ends) - min(starts) if starts and ends else 0.0
    return ClassRun(records, compute_metrics(records, max(span_s, 1e-9), slo))


async def _warm_up(client: httpx.AsyncClient, target: Target) -> None:
    record = RequestRecord(-1, 0)
    await send(client, target, Api.COMPLETIONS, {"prompt": "Warm-up request.", "max_tokens": 4,
                                                 "temperature": 0.0}, record, 0.0)
    if not record.is_success:
        raise BenchError(f"the warm-up request to {target.base_url} (model {target.model!r}) failed: "
                         f"{record.error_kind}: {record.error}")


# ---------------------------------------------------------------------------------- report and plots


def document(config: MixedConfig, result: MixedResult, command: Sequence[str]) -> dict[str, Any]:
    return {"schema": SCHEMA, "created_unix": time.time(), "command": list(command), "workload": "mixed",
            "target": {"url": result.target.base_url, "model": result.target.model},
            "tokenizer": result.tokenizer, "config": config.as_dict(),
            "phases": [p.to_json() for p in result.phases], "ratios": result.ratios()}


def print_mixed(result: MixedResult) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"mixed: chat (interactive) + batch on {result.target.base_url}")
    table.add_column("metric")
    for phase in result.phases:
        table.add_column(phase.name, justify="right")
    rows: list[tuple[str, Any]] = [
        ("chat requests ok/sent", lambda p: _count(p.chat)),
        ("chat TTFT p50 (ms)", lambda p: _ms(p.chat, "ttft", "p50")),
        ("chat TTFT p99 (ms)", lambda p: _ms(p.chat, "ttft", "p99")),
        ("chat TPOT p50 (ms)", lambda p: _ms(p.chat, "tpot", "p50")),
        ("chat TPOT p99 (ms)", lambda p: _ms(p.chat, "tpot", "p99")),
        ("chat goodput (req/s)", lambda p: _num(p.chat.metrics.goodput if p.chat else None, 3)),
        ("chat SLO attainment", lambda p: _num(p.chat.metrics.slo_attainment if p.chat else None, 3)),
        ("batch requests ok/sent", lambda p: _count(p.batch)),
        ("batch output tok/s", lambda p: _num(p.batch.metrics.output_throughput if p.batch else None, 1)),
        ("total output tok/s", lambda p: _num(p.total_output_throughput, 1)),
        ("duration (s)", lambda p: _num(p.duration_s, 1)),
    ]
    for label, cell in rows:
        table.add_row(label, *(cell(p) for p in result.phases))
    console = Console()
    console.print(table)
    for name, value in result.ratios().items():
        console.print(f"{name}: {_num(value, 3)}")


def _count(run: ClassRun | None) -> str:
    return "-" if run is None else f"{run.metrics.num_completed}/{run.metrics.num_requests}"


def _ms(run: ClassRun | None, metric: str, stat: str) -> str:
    value = None if run is None else getattr(getattr(run.metrics, metric), stat)
    return "-" if value is None else f"{value * 1e3:.1f}"


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def plot_mixed(result: MixedResult, path: Path) -> Path:
    """Chat latency CDFs alone vs mixed (TTFT, TPOT), and output tokens/s per phase and class."""
    from tokenmill.bench.plots import _pyplot, _save

    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for phase in result.phases:
        if phase.chat is None:
            continue
        for ax, metric in zip(axes[:2], ("ttft_s", "tpot_s"), strict=True):
            values = np.sort([v for r in phase.chat.records if r.is_success and (v := getattr(r, metric)) is not None])
            if len(values):
                ax.step(values * 1e3, np.arange(1, len(values) + 1) / len(values), where="post", label=phase.name)
    for ax, metric in zip(axes[:2], ("TTFT", "TPOT"), strict=True):
        ax.set(title=f"chat {metric} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    names = [p.name for p in result.phases]
    chat = [p.chat.metrics.total_output_tokens / p.duration_s if p.chat else 0.0 for p in result.phases]
    batch = [p.batch.metrics.total_output_tokens / p.duration_s if p.batch else 0.0 for p in result.phases]
    axes[2].bar(names, batch, label="batch", color="tab:orange")
    axes[2].bar(names, chat, bottom=batch, label="chat", color="tab:blue")
    axes[2].set(title="output tokens/s over each phase", ylabel="tokens/s")
    axes[2].legend(fontsize=8)
    axes[2].grid(alpha=0.3, axis="y")
    fig.suptitle(f"mixed workload on {result.target.base_url} ({result.target.model})")
    return _save(fig, path)
