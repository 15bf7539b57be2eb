"""Issue 15's numbers: chat users and a batch job on one `tokenmill serve` replica.

    flock /tmp/tokenmill-bench.lock python benchmarks/workload_classes.py            # smollm2-135m, 2 threads

One server with service classes (the default), then one with `--no-slo-scheduling` (classes are
labels only: the schedule of before issue 15), each running the `mixed` workload of `tokenmill
bench` (bench/mixed.py): the chat sessions alone, the batch burst alone, then both at once
(the burst sent at 0, chat arriving from `--chat-start` on). The batch burst alone runs after
`--batch-alone-gap-s` (65 s) without chat: for 60 s after a chat request the scheduler keeps even
batch-only steps short for the next chat's sake, which is a guard, not the batch job alone. Printed
as ratios measured in this one run, against the targets:

    chat P99 TPOT, mixed / chat alone            <= 1.2
    chat P99 TTFT, mixed / chat alone            <= 1.5
    total output tok/s mixed / batch alone       >= 0.85
    batch alone, classes / without classes       ~ 1.0 (within noise)

The last one is the median of `--batch-pairs` (2) ABBA pairs of fresh servers, classes against
`--no-slo-scheduling`, each running the batch burst alone (ab_pairs, also behind server_ab.py): the
two servers' batch-alone phases above run minutes apart, and this VM's speed drifts more than the
effect between them (0.79-1.15 over four runs; the pairs, 0.96-1.06). Their ratio is reported too
(`..._sequential`). Plus the same ratios on the server without classes, for contrast. Each server's /metrics after
its runs (SLO attainment by class, the step-time fit, paused batch requests, tokens scheduled per
class) goes into the JSON, with the load other processes put on the machine during each server's
runs. Writes benchmarks/results/workload_classes_<model>_<date>.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import re
import statistics
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
from common import (
    ROOT,
    NoiseMeter,
    environment,
    free_port,
    new_figure,
    print_table,
    save_figure,
    save_json,
    server_process,
    wait_for_quiet,
)

from tokenmill.bench.arrivals import ArrivalOptions
from tokenmill.bench.metrics import SLO
from tokenmill.bench.mixed import MixedConfig, MixedResult, pool_phases, print_mixed, run_mixed
from tokenmill.bench.workloads import WorkloadParams

LOG_DIR = ROOT / ".cache" / "workload-classes-logs"
SERVER_SERIES = ("slo_requests_total", "slo_met_total", "service_class_generation_tokens_total",
                 "service_class_scheduled_tokens_total", "service_class_deferred_requests_total",
                 "step_time_model_coefficient_seconds", "step_time_model_samples", "service_class_requests_total",
                 "num_preemptions_total")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chat-sessions", type=int, default=8)
    p.add_argument("--chat-turns", type=int, default=2)
    p.add_argument("--chat-output-len", type=int, default=32)
    p.add_argument("--chat-rate", type=float, default=1.0, help="chat sessions per second (Poisson)")
    p.add_argument("--batch-requests", type=int, default=48)
    p.add_argument("--batch-input-len", type=int, default=128)
    p.add_argument("--batch-output-len", type=int, default=192)
    p.add_argument("--chat-start", type=float, default=3.0)
    p.add_argument("--no-baseline", action="store_true", help="skip the server without service classes")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `tokenmill serve` flag (repeatable)")
    p.add_argument("--quiet-wait-s", type=float, default=20.0)
    p.add_argument("--batch-alone-gap-s", type=float, default=65.0,
                   help="seconds without chat before the batch-alone phase (> the server's interactive_recent_s, "
                        "60 s: batch alone means no recent chat; 0: straight after the previous phase)")
    p.add_argument("--rounds", type=int, default=1, help="phases repeated in alternating order (new prompts "
                   "each round: seed = round), pooled per phase: load drift hits every phase alike")
    p.add_argument("--batch-pairs", type=int, default=2, help="ABBA pairs of fresh servers running the batch burst "
                   "alone, classes against --no-slo-scheduling (0: only the sequential ratio)")
    return p.parse_args()


def mixed_config(args: argparse.Namespace, phases: tuple[str, ...], seed: int = 0) -> MixedConfig:
    chat = WorkloadParams(num_sessions=args.chat_sessions, turns=args.chat_turns, input_len=64,
                          output_len=args.chat_output_len, system_len=32, think_time_s=0.5, range_ratio=0.25)
    batch = WorkloadParams(num_sessions=args.batch_requests, turns=1, input_len=args.batch_input_len,
                           output_len=args.batch_output_len)
    return MixedConfig(chat, batch, "poisson", ArrivalOptions(rate=args.chat_rate), args.chat_start,
                       slo=SLO(ttft_s=2.0, tpot_s=0.2), phases=phases, seed=seed)


# ---------------------------------------------------------------- the server


@contextlib.contextmanager
def serving(args: argparse.Namespace, name: str, extra: list[str],
            root: Path | None = None) -> Iterator[tuple[str, int]]:
    port = free_port()
    argv = [sys.executable, "-m", "tokenmill", "serve", args.model, "--port", str(port), "--threads",
            str(args.threads), "--log-level", "warning", *args.serve_arg, *extra]
    url = f"http://127.0.0.1:{port}"
    with server_process(argv, url + "/ready", LOG_DIR / f"{name}.log", args.threads, timeout_s=600, root=root) as pid:
        yield url, pid


def server_view(url: str) -> dict[str, float]:
    """The classes' series the server exposes, label sets flattened into the key."""
    text = httpx.get(url + "/metrics", timeout=10).text
    view: dict[str, float] = {}
    for line in text.splitlines():
        match = re.fullmatch(r"tokenmill:(\w+)\{(.*)\} (\S+)", line)
        if match and match.group(1) in SERVER_SERIES:
            labels = ",".join(p for p in match.group(2).split(",") if not p.startswith("model_name="))
            view[f"{match.group(1)}{{{labels}}}"] = float(match.group(3))
    return view


def run_round(args: argparse.Namespace, url: str, phases: tuple[str, ...], seed: int) -> MixedResult:
    """The phases in one run (same sessions: same seed), the batch burst alone only after
    --batch-alone-gap-s without chat (MixedConfig.batch_alone_gap_s). A chat request within the last
    `interactive_recent_s` (60 s) keeps even batch-only steps short, so an arriving chat waits little
    (docs/workload_classes.md); a batch burst right after a chat phase measures that guard, not the
    batch job alone. With the phases alternating per round, batch_alone never opens a round after the first."""
    config = dataclasses.replace(mixed_config(args, phases, seed=seed), batch_alone_gap_s=args.batch_alone_gap_s)
    return asyncio.run(run_mixed(config, url))


def run_server(args: argparse.Namespace, name: str, extra: list[str], phases: tuple[str, ...]) -> dict[str, Any]:
    wait_for_quiet(args.quiet_wait_s)
    with serving(args, name, extra) as (url, pid):
        noise = NoiseMeter((pid,))
        rounds = [run_round(args, url, phases if i % 2 == 0 else phases[::-1], seed=i) for i in range(args.rounds)]
        others = noise.others_cores()
        view = server_view(url)
    by_phase = {name: [p for r in rounds for p in r.phases if p.name == name] for name in phases}
    slo = mixed_config(args, phases).slo
    result = MixedResult(rounds[0].target, rounds[0].tokenizer, [pool_phases(by_phase[n], slo) for n in phases])
    print_mixed(result)
    print(f"{name}: other processes used {others:.2f} cores during the runs")
    return {"name": name, "serve_flags": extra, "rounds": args.rounds, "result": result, "others_cores": others,
            "server_metrics": view}


def ab_run(args: argparse.Namespace, phase: str, name: str, root: Path, flags: list[str], index: int) -> dict[str, Any]:
    """One phase on a fresh server running checkout `root`."""
    wait_for_quiet(args.quiet_wait_s)
    with serving(args, f"ab-{name}-{index}", flags, root) as (url, pid):
        noise = NoiseMeter((pid,))
        result = run_round(args, url, (phase,), seed=index // 2)
        others = noise.others_cores()
    found = result.phase(phase)
    assert found is not None
    row: dict[str, Any] = {"version": name, "pair": index // 2, "others_cores": round(others, 3),
                           "duration_s": found.duration_s, "total_tps": found.total_output_throughput}
    if found.chat is not None:
        m = found.chat.metrics
        row.update(chat_ttft_p50=m.ttft.p50, chat_ttft_p99=m.ttft.p99, chat_tpot_p50=m.tpot.p50,
                   chat_tpot_p99=m.tpot.p99)
    if found.batch is not None:
        row["batch_tps"] = found.batch.metrics.output_throughput
    return row


def ab_pairs(args: argparse.Namespace, phase: str, sides: Mapping[str, tuple[Path, list[str]]],
             pairs: int) -> tuple[list[dict[str, Any]], list[dict[str, float]]]:
    """`pairs` pairs of runs of one phase, sides "base" and "new" (checkout, serve flags) in ABBA order
    (base, new, new, base, ...: a linear drift of the machine's speed cancels), each pair on the same
    prompts; the runs and each pair's new / base ratios."""
    order = (["base", "new", "new", "base"] * pairs)[: 2 * pairs]
    rows = []
    for index, name in enumerate(order):
        rows.append(ab_run(args, phase, name, *sides[name], index))
        print(rows[-1], flush=True)
    ratios = []
    for pair in range(pairs):
        by = {r["version"]: r for r in rows if r["pair"] == pair}
        ratios.append({k: by["new"][k] / by["base"][k] for k in by["new"]
                       if k not in ("version", "pair", "others_cores") and isinstance(by["new"][k], float)
                       and by["base"].get(k)})
        print(f"pair {pair}: new / base " + ", ".join(f"{k} {v:.3f}" for k, v in ratios[-1].items()))
    return rows, ratios


# ---------------------------------------------------------------- figures


def chat_stat(result: MixedResult, phase: str, metric: str, stat: str) -> float | None:
    found = result.phase(phase)
    if found is None or found.chat is None:
        return None
    value: float | None = getattr(getattr(found.chat.metrics, metric), stat)
    return value


def batch_tps(result: MixedResult, phase: str) -> float | None:
    found = result.phase(phase)
    return None if found is None or found.batch is None else found.batch.metrics.output_throughput


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def headline(classes: MixedResult, baseline: MixedResult | None) -> dict[str, Any]:
    mixed = classes.phase("mixed")
    rows: dict[str, Any] = {
        "chat_tpot_p99_mixed_over_alone": ratio(chat_stat(classes, "mixed", "tpot", "p99"),
                                                chat_stat(classes, "chat_alone", "tpot", "p99")),
        "chat_ttft_p99_mixed_over_alone": ratio(chat_stat(classes, "mixed", "ttft", "p99"),
                                                chat_stat(classes, "chat_alone", "ttft", "p99")),
        "total_tps_mixed_over_batch_alone": ratio(mixed.total_output_throughput if mixed else None,
                                                  batch_tps(classes, "batch_alone")),
    }
    if baseline is not None:
        base_mixed = baseline.phase("mixed")
        rows["batch_alone_classes_over_without"] = ratio(batch_tps(classes, "batch_alone"),
                                                         batch_tps(baseline, "batch_alone"))
        rows["without_classes_chat_tpot_p99_mixed_over_alone"] = ratio(
            chat_stat(baseline, "mixed", "tpot", "p99"), chat_stat(classes, "chat_alone", "tpot", "p99"))
        rows["without_classes_chat_ttft_p99_mixed_over_alone"] = ratio(
            chat_stat(baseline, "mixed", "ttft", "p99"), chat_stat(classes, "chat_alone", "ttft", "p99"))
        rows["without_classes_total_tps_mixed_over_batch_alone"] = ratio(
            base_mixed.total_output_throughput if base_mixed else None, batch_tps(baseline, "batch_alone"))
    return rows


TARGETS = {"chat_tpot_p99_mixed_over_alone": ("<=", 1.2), "chat_ttft_p99_mixed_over_alone": ("<=", 1.5),
           "total_tps_mixed_over_batch_alone": (">=", 0.85), "batch_alone_classes_over_without": (">=", 0.95)}


def plot(servers: list[dict[str, Any]], model: str) -> None:
    import numpy as np

    fig, _ax, path = new_figure("workload_classes", model)
    fig.set_size_inches(15, 4.5)
    fig.clf()
    axes = fig.subplots(1, 3)
    for server in servers:
        result: MixedResult = server["result"]
        for phase in result.phases:
            if phase.chat is None or (phase.name == "chat_alone" and server["name"] != "classes"):
                continue
            label = f"{server['name']}: {phase.name}"
            for axis, metric in zip(axes[:2], ("tpot_s", "ttft_s"), strict=True):
                values = np.sort([v for r in phase.chat.records if (v := getattr(r, metric)) is not None])
                if len(values):
                    axis.step(values * 1e3, np.arange(1, len(values) + 1) / len(values), where="post", label=label)
    for axis, metric in zip(axes[:2], ("TPOT", "TTFT"), strict=True):
        axis.set(title=f"chat {metric} CDF", xlabel="ms", ylabel="fraction of chat requests", ylim=(0, 1.02))
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    names, chat_tps, batch = [], [], []
    for server in servers:
        for phase in server["result"].phases:
            names.append(f"{server['name']}\n{phase.name}")
            chat_tps.append(phase.chat.metrics.total_output_tokens / phase.duration_s if phase.chat else 0.0)
            batch.append(phase.batch.metrics.total_output_tokens / phase.duration_s if phase.batch else 0.0)
    axes[2].bar(names, batch, label="batch", color="tab:orange")
    axes[2].bar(names, chat_tps, bottom=batch, label="chat", color="tab:blue")
    axes[2].set(title="output tokens/s per phase", ylabel="tokens/s")
    axes[2].tick_params(axis="x", labelsize=7)
    axes[2].legend(fontsize=8)
    fig.suptitle(f"{model}: chat + batch on one replica, service classes vs none")
    save_figure(fig, path)


def main() -> int:
    args = parse_args()
    env = environment()
    print(f"CPU: {env['cpu']} flags {env['cpu_flags']}, {env['cpu_count']} cores")
    servers = [run_server(args, "classes", [], ("chat_alone", "batch_alone", "mixed"))]
    if not args.no_baseline:
        servers.append(run_server(args, "no_classes", ["--no-slo-scheduling"], ("batch_alone", "mixed")))
    ratios = headline(servers[0]["result"], servers[1]["result"] if len(servers) > 1 else None)
    batch_ab: dict[str, Any] = {}
    if not args.no_baseline and args.batch_pairs > 0:
        runs, pairs = ab_pairs(args, "batch_alone", {"base": (ROOT, ["--no-slo-scheduling"]), "new": (ROOT, [])},
                               args.batch_pairs)
        per_pair = [p["batch_tps"] for p in pairs]
        batch_ab = {"runs": runs, "classes_over_without": per_pair}
        ratios["batch_alone_classes_over_without_sequential"] = ratios["batch_alone_classes_over_without"]
        ratios["batch_alone_classes_over_without"] = statistics.median(per_pair)
    rows = []
    for name, value in ratios.items():
        op, target = TARGETS.get(name, ("", None))
        verdict = "" if value is None or target is None else \
            ("PASS" if (value <= target if op == "<=" else value >= target) else "FAIL")
        rows.append((name, "-" if value is None else f"{value:.3f}", f"{op} {target}" if target else "", verdict))
    print_table(("ratio", "value", "target", ""), rows)
    payload = {"args": vars(args), "ratios": ratios, "targets": {k: list(v) for k, v in TARGETS.items()},
               "servers": [{**{k: v for k, v in s.items() if k != "result"},
                            "phases": [p.to_json() for p in s["result"].phases],
                            "bench_ratios": s["result"].ratios()} for s in servers],
               "batch_alone_ab": batch_ab}
    save_json("workload_classes", args.model, payload)
    plot(servers, args.model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
