"""A benchmark end to end: resolve the target, build the sessions once, then for each rate of
the sweep (or the single arrival process) scrape /metrics, run, scrape again and compute metrics.

`compare` sends the very same sessions and arrival times (same seed) to every target, one target
at a time, alternating the order each round (A B, B A, ...) so that drift in the machine hits
both alike; rounds are pooled per target before metrics are computed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tokenmill.bench.arrivals import ArrivalOptions, ArrivalProcess, build_arrival, with_rate
from tokenmill.bench.client import Target, send, server_root
from tokenmill.bench.datasets import load_sessions
from tokenmill.bench.errors import BenchError
from tokenmill.bench.metrics import SLO, BenchMetrics, compute_metrics
from tokenmill.bench.records import RequestRecord
from tokenmill.bench.runner import RunOutcome, RunSpec, make_client, run_sessions
from tokenmill.bench.server_metrics import EXACT, exact_phases, finished_count, phase_breakdown, scrape_settled
from tokenmill.bench.sessions import Api, Session
from tokenmill.bench.tokens import PromptFactory, connect_tokenizer
from tokenmill.bench.workloads import WorkloadParams, get_workload


@dataclass(slots=True, frozen=True)
class BenchConfig:
    workload: str
    params: WorkloadParams
    arrival: str
    arrival_options: ArrivalOptions
    rates: tuple[float, ...] = ()  # a sweep: one run per rate
    max_concurrency: int | None = None
    slo: SLO = field(default_factory=SLO)
    seed: int = 0
    ignore_eos: bool = True
    usd_per_hour: float | None = None
    timeout_s: float = 600.0
    dataset: str | None = None
    warmup: bool = True

    def arrival_for(self, rate: float | None) -> ArrivalProcess:
        options = self.arrival_options if rate is None else with_rate(self.arrival_options, rate)
        return build_arrival(self.arrival, options)

    def sweep(self) -> Sequence[float | None]:
        return self.rates or (None,)


@dataclass(slots=True)
class RunResult:
    target: Target
    arrival: dict[str, Any]
    metrics: BenchMetrics
    server: dict[str, Any] | None
    records: list[RequestRecord]
    started_unix: float
    num_rounds: int = 1

    @property
    def rate(self) -> float | None:
        rate = self.arrival.get("rate")
        return float(rate) if isinstance(rate, int | float) else None

    def to_json(self) -> dict[str, Any]:
        return {"target": {"url": self.target.base_url, "model": self.target.model}, "arrival": self.arrival,
                "started_unix": self.started_unix, "num_rounds": self.num_rounds, "metrics": self.metrics.to_json(),
                "server_metrics": self.server, "requests": [r.to_json() for r in self.records]}


@dataclass(slots=True)
class Prepared:
    targets: list[Target]
    sessions: list[Session]
    tokenizer: str


async def discover_model(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    headers = Target(base_url, "", api_key).headers
    try:
        response = await client.get(base_url + "/v1/models", headers=headers)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchError(f"cannot list the models of {base_url} ({exc}): is the server up? "
                         "Pass --model if it has no /v1/models") from exc


async def prepare(client: httpx.AsyncClient, config: BenchConfig, urls: Sequence[str], model: str | None,
                  api_key: str | None) -> Prepared:
    """Targets with their model names, and sessions cut with the first target's tokenizer."""
    targets = [Target(server_root(url), model or await discover_model(client, server_root(url), api_key), api_key)
               for url in urls]
    tokenizer = await connect_tokenizer(client, targets[0].base_url, targets[0].model)
    prompts = PromptFactory(tokenizer)
    rng = np.random.default_rng([config.seed, 0])
    if config.dataset is not None:
        sessions = await load_sessions(Path(config.dataset), config.params.num_sessions, config.params.turns,
                                       config.params.output_len, prompts, rng)
    else:
        sessions = await get_workload(config.workload).build_sessions(config.params, prompts, rng)
    return Prepared(targets, sessions, tokenizer.name)


WARMUP_TEXT = "Warm-up request: reply with one word."


async def warm_up(client: httpx.AsyncClient, target: Target, config: BenchConfig) -> None:
    """One short request first, as vLLM's benchmark does: it fails fast on a wrong URL or model,
    and one-off first-request costs stay out of the numbers. Its text is none of the sessions',
    so that it primes no prefix cache for them."""
    api = get_workload(config.workload).api
    record = RequestRecord(-1, 0)
    message = {"messages": [{"role": "user", "content": WARMUP_TEXT}]} if api is Api.CHAT else {"prompt": WARMUP_TEXT}
    await send(client, target, api, {"max_tokens": 4, "temperature": 0.0, **message}, record, 0.0)
    if not record.is_success:
        raise BenchError(f"the warm-up request to {target.base_url} (model {target.model!r}) failed: "
                         f"{record.error_kind}: {record.error}")


async def measure(client: httpx.AsyncClient, target: Target, config: BenchConfig, sessions: list[Session],
                  rate: float | None) -> tuple[RunOutcome, dict[str, Any] | None, ArrivalProcess]:
    arrival = config.arrival_for(rate)
    offsets = arrival.offsets_s(len(sessions), np.random.default_rng([config.seed, 1]))  # same for every target
    spec = RunSpec(get_workload(config.workload).api, sessions, offsets, config.params.think_time_s,
                   config.max_concurrency, config.ignore_eos)
    before = await scrape_settled(client, target.base_url)
    outcome = await run_sessions(client, target, spec)
    num_done = sum(record.is_success for record in outcome.records)
    after = await scrape_settled(client, target.base_url, (finished_count(before) or 0.0) + num_done)
    server = phase_breakdown(before, after, outcome.records)
    return outcome, server, arrival


def finish(target: Target, config: BenchConfig, arrival: ArrivalProcess, outcomes: list[RunOutcome],
           servers: list[dict[str, Any] | None]) -> RunResult:
    records = pool(outcomes)
    duration_s = sum(outcome.duration_s for outcome in outcomes)
    metrics = compute_metrics(records, duration_s, config.slo, config.usd_per_hour)
    return RunResult(target, arrival.describe(), metrics, pooled_server(servers, records), records,
                     outcomes[0].started_unix, len(outcomes))


def pooled_server(servers: list[dict[str, Any] | None], records: list[RequestRecord]) -> dict[str, Any] | None:
    """One round's breakdown as it is; several rounds pool only exact per-request times (bucket
    quantiles do not add up, and the prefix cache is warm after the first round)."""
    if len(servers) == 1:
        return servers[0]
    exact = exact_phases(records)
    if exact is None:
        return None
    return {"source": "tokenmill", "method": EXACT, "phases_s": exact, "prefix_cache_hit_rate": None}


def pool(outcomes: list[RunOutcome]) -> list[RequestRecord]:
    """Records of several rounds on one timeline: each round starts where the previous one ended."""
    pooled: list[RequestRecord] = []
    shift_s = 0.0
    for outcome in outcomes:
        for record in outcome.records:
            start = None if record.start_s is None else record.start_s + shift_s
            pooled.append(replace(record, start_s=start))
        shift_s += outcome.duration_s
    return pooled


async def run_benchmark(config: BenchConfig, url: str, model: str | None = None,
                        api_key: str | None = None) -> tuple[Prepared, list[RunResult]]:
    async with make_client(config.timeout_s) as client:
        prepared = await prepare(client, config, [url], model, api_key)
        target = prepared.targets[0]
        if config.warmup:
            await warm_up(client, target, config)
        results = []
        for rate in config.sweep():
            outcome, server, arrival = await measure(client, target, config, prepared.sessions, rate)
            results.append(finish(target, config, arrival, [outcome], [server]))
        return prepared, results


async def compare_targets(config: BenchConfig, urls: Sequence[str], rounds: int = 1, model: str | None = None,
                          api_key: str | None = None) -> tuple[Prepared, list[RunResult]]:
    """One result per (rate, target), rates outer, targets in the order given."""
    if len(urls) < 2 or rounds < 1:
        raise BenchError("compare needs at least two --target and --rounds ≥ 1")
    async with make_client(config.timeout_s) as client:
        prepared = await prepare(client, config, urls, model, api_key)
        if config.warmup:
            for target in prepared.targets:
                await warm_up(client, target, config)
        results: list[RunResult] = []
        for rate in config.sweep():
            results.extend(await _compare_at(client, config, prepared, rate, rounds))
        return prepared, results


async def _compare_at(client: httpx.AsyncClient, config: BenchConfig, prepared: Prepared, rate: float | None,
                      rounds: int) -> list[RunResult]:
    runs: dict[int, list[tuple[RunOutcome, dict[str, Any] | None, ArrivalProcess]]] = {}
    indices = list(range(len(prepared.targets)))
    for round_index in range(rounds):
        for i in indices if round_index % 2 == 0 else indices[::-1]:
            runs.setdefault(i, []).append(await measure(client, prepared.targets[i], config, prepared.sessions, rate))
    return [finish(prepared.targets[i], config, runs[i][0][2], [o for o, _, _ in runs[i]], [s for _, s, _ in runs[i]])
            for i in indices]


RATIO_METRICS = (("output_throughput", True), ("request_throughput", True), ("total_token_throughput", True),
                 ("goodput", True), ("ttft_s.p50", False), ("ttft_s.p99", False), ("tpot_s.p50", False),
                 ("tpot_s.p99", False), ("itl_s.p50", False), ("itl_s.p99", False), ("e2e_s.p50", False),
                 ("e2e_s.p99", False))


def ratios(baseline: BenchMetrics, other: BenchMetrics) -> dict[str, float | None]:
    """other / baseline per headline metric (throughputs: > 1 is better; latencies: < 1 is better)."""
    base, mine = baseline.to_json(), other.to_json()
    return {name: _ratio(_lookup(mine, name), _lookup(base, name)) for name, _ in RATIO_METRICS}


def _lookup(data: dict[str, Any], dotted: str) -> float | None:
    value: Any = data
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return float(value) if isinstance(value, int | float) else None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0 or math.isnan(denominator):
        return None
    return numerator / denominator
