"""tokenmill against llama.cpp's `llama-server` on the same GGUF, archetype by archetype.

    python benchmarks/peers.py                       # both models, all three archetypes, ~10-15 min
    python benchmarks/peers.py --models smollm2-135m --workloads dataproc
    python benchmarks/peers.py --models qwen2.5-coder-0.5b --workloads burst16 burst64 --slots 64

Each server runs alone (ggml's threads spin: never beside another busy process), with the same
thread count and the same number of parallel sequences; both get the very same sessions (cut
once, with the first server's tokenizer: both read the GGUF's vocabulary) and arrival times
(same seed). Before each run the script waits for the machine to go quiet and records how many
cores other processes used during the run (`others_cores`: well above 0.1 means noise).
Writes benchmarks/results/peers_<date>.{json,md} (peers_burst_<date> for the burst runs) and one CDF
plot per model and archetype.
llama-server is built on first use into .cache/llama.cpp/ (see llama_server.py; 10-15+ min).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import llama_server  # noqa: E402
from common import NoiseMeter, free_port, host_label, server_process, wait_for_quiet  # noqa: E402

from tokenmill.bench.arrivals import ArrivalOptions  # noqa: E402
from tokenmill.bench.bench import BenchConfig, RunResult, finish, measure, prepare, ratios, warm_up  # noqa: E402
from tokenmill.bench.client import Target  # noqa: E402
from tokenmill.bench.plots import plot_cdfs  # noqa: E402
from tokenmill.bench.report import markdown_table  # noqa: E402
from tokenmill.bench.runner import make_client  # noqa: E402
from tokenmill.bench.sessions import Session  # noqa: E402
from tokenmill.bench.workloads import WorkloadParams, get_workload  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"
LOG_DIR = ROOT / ".cache" / "peers-logs"
MODELS = ("qwen2.5-coder-0.5b", "smollm2-135m")
SERVERS = ("tokenmill", "llama.cpp")
TICKS_PER_S = os.sysconf("SC_CLK_TCK")

# Small enough that both models x both servers x three archetypes take < 15 minutes on 2 cores
# (tokenmill decodes Qwen2.5-0.5B at ~5-10 tokens/s there): a first look, not a capacity study.
SIZES: dict[str, tuple[WorkloadParams, str, ArrivalOptions]] = {
    "chatbot": (WorkloadParams(num_sessions=6, turns=2, input_len=48, output_len=24, system_len=32,
                               range_ratio=0.25, think_time_s=0.5), "poisson", ArrivalOptions(rate=1.0)),
    "agent": (WorkloadParams(num_sessions=3, turns=3, input_len=64, output_len=24, system_len=384),
              "poisson", ArrivalOptions(rate=0.5)),
    "dataproc": (WorkloadParams(num_sessions=12, turns=1, input_len=96, output_len=32), "burst", ArrivalOptions()),
    # Issue 11's concurrency runs: 16 and 64 requests of ~110 prompt tokens and 64 output tokens at
    # once (with --slots 64, as `llama-server -np 64`); each lasts 30 s or more on 2 cores.
    "burst16": (WorkloadParams(num_sessions=16, turns=1, input_len=110, output_len=64), "burst", ArrivalOptions()),
    "burst64": (WorkloadParams(num_sessions=64, turns=1, input_len=110, output_len=64), "burst", ArrivalOptions()),
    # The same requests, ten / four times as many, with at most 16 / 64 in flight (a finished one is
    # replaced at once): 16 and 64 concurrent for 30 s or more on a host where one burst ends in 7 s (a Zen 5
    # EPYC; 64 requests at 16 in flight took tokenmill 13.5 s there, so sustained16 sends 160).
    "sustained16": (WorkloadParams(num_sessions=160, turns=1, input_len=110, output_len=64), "burst",
                    ArrivalOptions()),
    "sustained64": (WorkloadParams(num_sessions=256, turns=1, input_len=110, output_len=64), "burst",
                    ArrivalOptions()),
}
MAX_CONCURRENCY = {"sustained16": 16, "sustained64": 64}  # client-side cap; the others send all at once
DEFAULT_WORKLOADS = ("chatbot", "agent", "dataproc")


@dataclass(slots=True)
class Settings:
    slots: int
    ctx_per_slot: int
    threads: int
    quiet_wait_s: float
    seed: int
    tokenmill_dtype: str
    max_noise_cores: float = 0.25  # a run during which others used more is run again
    noise_retries: int = 2
    tag: str = ""  # in the result files' names (a variant; common.host_label() names the host in every one)


def default_tokenmill_dtype() -> str:
    """tokenmill's own default (auto: bf16) where the CPU computes bf16 natively; float32 elsewhere.

    On an AVX2-only host (the AMD EPYC VMs) torch emulates bf16 matmuls: 3-5x slower than fp32
    here, which would measure the emulation, not the engine."""
    flags = Path("/proc/cpuinfo").read_text()
    return "auto" if "avx512_bf16" in flags or "amx_bf16" in flags else "float32"


@dataclass(slots=True)
class PeerPair:
    """One archetype on one model: each server's result and the machine noise during its run."""

    results: dict[str, RunResult] = field(default_factory=dict)
    noise: dict[str, dict[str, float]] = field(default_factory=dict)

    def ratios(self) -> dict[str, float | None]:
        return ratios(self.results["llama.cpp"].metrics, self.results["tokenmill"].metrics)

    def to_json(self) -> dict[str, Any]:
        servers = {name: {**self.results[name].to_json(), "noise": self.noise[name]} for name in SERVERS}
        return {**servers, "ratios_tokenmill_over_llama_cpp": self.ratios()}


Report = dict[str, dict[str, PeerPair]]  # model → workload → pair


# ---------------------------------------------------------------- servers


def server_argv(server: str, gguf: Path, model: str, port: int, settings: Settings) -> tuple[list[str], str]:
    """The command line and the path that answers 200 once the model is loaded."""
    if server == "llama.cpp":
        argv = llama_server.server_argv(llama_server.ensure_built(), gguf, port, model, settings.slots,
                                        settings.ctx_per_slot, settings.threads)
        return argv, "/health"
    argv = [sys.executable, "-m", "tokenmill", "serve", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", model, "--threads", str(settings.threads), "--max-num-seqs", str(settings.slots),
            "--max-model-len", str(settings.ctx_per_slot), "--dtype", settings.tokenmill_dtype]
    return argv, "/ready"


@contextlib.contextmanager
def running(server: str, gguf: Path, model: str, settings: Settings) -> Iterator[tuple[str, int]]:
    """(url, pid) of a started server; stopped (SIGTERM, then SIGKILL) on the way out."""
    port = free_port()
    argv, ready_path = server_argv(server, gguf, model, port, settings)
    url = f"http://127.0.0.1:{port}"
    with server_process(argv, url + ready_path, LOG_DIR / f"{server}_{model}.log", settings.threads) as pid:
        yield url, pid


# ---------------------------------------------------------------- runs


def bench_config(workload: str, seed: int) -> BenchConfig:
    params, arrival, options = SIZES[workload]
    base = workload.rstrip("0123456789").replace("sustained", "burst").replace("burst", "dataproc")
    slo = get_workload(base).default_slo()  # burst16/64, sustained16/64: dataproc requests
    return BenchConfig(base, params, arrival, options, slo=slo, seed=seed,
                       max_concurrency=MAX_CONCURRENCY.get(workload))


async def run_server(server: str, url: str, pid: int, model: str, workloads: list[str], settings: Settings,
                     sessions: dict[str, list[Session]], pairs: dict[str, PeerPair]) -> None:
    """Every archetype against one server; fills `sessions` the first time a workload is seen."""
    meter = NoiseMeter((pid,))
    async with make_client(timeout_s=1800.0) as client:
        for workload in workloads:
            config = bench_config(workload, settings.seed)
            if workload not in sessions:
                sessions[workload] = (await prepare(client, config, [url], model, None)).sessions
            target = Target(url, model)
            await warm_up(client, target, config)
            pair = pairs.setdefault(workload, PeerPair())
            for attempt in range(settings.noise_retries + 1):
                await _measure_once(client, target, config, sessions[workload], meter, settings, pair, server)
                if pair.noise[server]["others_cores"] <= settings.max_noise_cores:
                    break
                print(f"  noisy (attempt {attempt + 1}): waiting for quiet and running it again", flush=True)


async def _measure_once(client: httpx.AsyncClient, target: Target, config: BenchConfig, sessions: list[Session],
                        meter: NoiseMeter, settings: Settings, pair: PeerPair, server: str) -> None:
    before = wait_for_quiet(settings.quiet_wait_s, also_ours=meter.also_ours)
    meter.restart()
    outcome, server_metrics, arrival = await measure(client, target, config, sessions, None)
    pair.noise[server] = {"others_cores_before": round(before, 3), "others_cores": round(meter.others_cores(), 3)}
    pair.results[server] = finish(target, config, arrival, [outcome], [server_metrics])
    print(f"  {server:9} {config.workload:8} {outcome.duration_s:6.1f} s  "
          f"{pair.results[server].metrics.output_throughput:7.2f} out tok/s  "
          f"others {pair.noise[server]['others_cores']}", flush=True)


def run_model(model: str, workloads: list[str], settings: Settings, order: tuple[str, ...]) -> dict[str, PeerPair]:
    from tokenmill.models.resolve import resolve_model

    gguf = Path(resolve_model(model).path)
    sessions: dict[str, list[Session]] = {}
    pairs: dict[str, PeerPair] = {}
    for server in order:
        print(f"{model}: starting {server}", flush=True)
        with running(server, gguf, model, settings) as (url, pid):
            asyncio.run(run_server(server, url, pid, model, workloads, settings, sessions, pairs))
    return pairs


# ---------------------------------------------------------------- report


def environment(settings: Settings) -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "git_commit": commit,
            "llama_cpp": f"llama-cpp-python {llama_server.SDIST_VERSION} sdist (vendor/llama.cpp)",
            "llama_cpp_cmake_flags": list(llama_server.cmake_flags(llama_server.isa_level())), "slots": settings.slots,
            "ctx_per_slot": settings.ctx_per_slot, "threads": settings.threads, "seed": settings.seed,
            "tokenmill_dtype": settings.tokenmill_dtype}


def write_report(report: Report, settings: Settings, command: list[str]) -> list[Path]:
    # The burst (concurrency) runs get their own files, so they never replace the archetype report.
    workloads = {w for pairs in report.values() for w in pairs}
    kind = "burst_" if workloads and all(w.startswith(("burst", "sustained")) for w in workloads) else ""
    tag = f"{settings.tag}_" if settings.tag else ""
    stem = RESULTS_DIR / f"peers_{kind}{tag}{dt.date.today().isoformat()}_{host_label()}"
    plots = [_plot(stem, model, workload, pair) for model, pairs in report.items() for workload, pair in pairs.items()]
    doc = {"schema": "tokenmill-peers/1", "date": dt.date.today().isoformat(), "command": command,
           "environment": environment(settings), "sizes": {w: s[0].as_dict() for w, s in SIZES.items()},
           "models": {model: {"gguf": Path(_gguf(model)).name,
                              "workloads": {w: pair.to_json() for w, pair in pairs.items()}}
                      for model, pairs in report.items()}}
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    stem.with_suffix(".md").write_text(_markdown(report, settings, command))
    return [stem.with_suffix(".json"), stem.with_suffix(".md"), *plots]


def _gguf(model: str) -> str:
    from tokenmill.models.resolve import resolve_model

    return str(resolve_model(model).path)


def _plot(stem: Path, model: str, workload: str, pair: PeerPair) -> Path:
    path = stem.with_name(f"{stem.name}_{model}_{workload}_cdf.png")
    return plot_cdfs([pair.results[s] for s in SERVERS], list(SERVERS), path,
                     f"{model} · {workload}: tokenmill vs llama.cpp llama-server")


HEADLINE = (("output tok/s", "output_throughput"), ("goodput", "goodput"), ("TTFT P50", "ttft_s.p50"),
            ("TTFT P99", "ttft_s.p99"), ("TPOT P50", "tpot_s.p50"), ("E2E P99", "e2e_s.p99"))


def _markdown(report: Report, settings: Settings, command: list[str]) -> str:
    lines = [f"# tokenmill vs llama.cpp `llama-server` — {dt.date.today().isoformat()}", "",
             f"Command: `{' '.join(command)}`", "",
             f"Same GGUF, {settings.threads} threads, {settings.slots} parallel sequences, one server at a time, "
             f"tokenmill dtype {settings.tokenmill_dtype}, "
             f"same sessions and arrival times (seed {settings.seed}), greedy, `ignore_eos` (exact output lengths).",
             "", "## Ratios tokenmill / llama.cpp (throughput > 1 and latency < 1 favour tokenmill)", "",
             "| model | workload | " + " | ".join(name for name, _ in HEADLINE) + " | others_cores |",
             "|---|---|" + "---:|" * (len(HEADLINE) + 1)]
    for model, pairs in report.items():
        for workload, pair in pairs.items():
            ratio = pair.ratios()
            cells = ["-" if ratio[key] is None else f"{ratio[key]:.2f}" for _, key in HEADLINE]
            noise = max(pair.noise[s]["others_cores"] for s in SERVERS)
            lines.append(f"| {model} | {workload} | " + " | ".join(cells) + f" | {noise:.2f} |")
    for model, pairs in report.items():
        for workload, pair in pairs.items():
            lines += ["", f"## {model} · {workload}", "",
                      markdown_table([pair.results[s] for s in SERVERS], list(SERVERS))]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS), choices=list(SIZES))
    parser.add_argument("--slots", type=int, default=8, help="llama-server -np; tokenmill --max-num-seqs")
    parser.add_argument("--ctx-per-slot", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quiet-wait-s", type=float, default=20.0)
    parser.add_argument("--max-noise-cores", type=float, default=0.25,
                        help="rerun a run during which other processes used more cores than this")
    parser.add_argument("--noise-retries", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="", help="extra label in result names (a variant; the host is always there)")
    parser.add_argument("--tokenmill-dtype", default=None, help="default: auto where bf16 is native, else float32")
    args = parser.parse_args()
    settings = Settings(args.slots, args.ctx_per_slot, args.threads, args.quiet_wait_s, args.seed,
                        args.tokenmill_dtype or default_tokenmill_dtype(), args.max_noise_cores, args.noise_retries,
                        args.tag)
    llama_server.ensure_built()
    started = time.monotonic()
    report: Report = {}
    for index, model in enumerate(args.models):
        order = SERVERS if index % 2 == 0 else SERVERS[::-1]  # alternate who goes first: drift hits both
        report[model] = run_model(model, args.workloads, settings, order)
    command = ["python", "benchmarks/peers.py", *sys.argv[1:]]
    for path in write_report(report, settings, command):
        print(path)
    print(f"done in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
