"""Cold start of `tokenmill serve`: process start → /health → /ready, first and second start.

    flock /tmp/tokenmill-bench.lock python benchmarks/cold_start.py       # smollm2-135m, qwen2.5-coder-1.5b
    flock /tmp/tokenmill-bench.lock python benchmarks/cold_start.py --models smollm2-135m --repeats 2
    python benchmarks/cold_start.py --fleet --models tiny --replicas 3      # N replicas, one by one vs at once

Per model, each start a fresh server process in an empty TOKENMILL_HOME made here (the model is
passed by path, so nothing else of the user's home is read):

  first      --quantization auto, nothing cached: tokenizer and repack caches built and written
  second     --quantization auto again: both caches hit (the GGUF and the repacked layers memory-mapped)
  repack     --quantization auto with TOKENMILL_REPACK_CACHE=0: packs every layer on every start
             (the path before the repack cache; tokenizer cache warm)
  none       --quantization none: dequantized to float (the reference path; tokenizer cache warm)

Each start records spawn → /health (the socket is bound while weights load in the background),
spawn → /ready (the replica serves), the first request's latency (one 8-token completion: it
faults in the mapped weights), and the server's VmRSS / VmHWM after that request. Figures are
printed as ratios against `repack` and `none` from the same run (the machine is shared and noisy),
with the CPU and load average, and saved to results/cold_start_<model>_<date>_<host>.json (common.result_path).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common
import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # tests.fixtures (the tiny model) and an uninstalled tokenmill

POLL_S = 0.02
TINY_ARGS = ("--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64")
# Variant → (--quantization, extra environment).
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "first": ("auto", {}), "second": ("auto", {}),
    "repack": ("auto", {"TOKENMILL_REPACK_CACHE": "0"}), "none": ("none", {}),
}  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Replica:
    def __init__(self, model: str, extra_args: tuple[str, ...], threads: int, env: dict[str, str] | None = None,
                 log_path: Path | None = None) -> None:
        self.port = free_port()
        command = [sys.executable, "-m", "tokenmill", "serve", model, "--port", str(self.port),
                   "--threads", str(threads), "--log-level", "info" if log_path else "warning", *extra_args]
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self._log = log_path.open("wb") if log_path else None
        self.started = time.monotonic()
        self.proc = subprocess.Popen(command, env=full_env, stdout=self._log or subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT if self._log else subprocess.DEVNULL)
        self.health_s: float | None = None
        self.ready_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def poll(self) -> None:
        """Advance: note when /health, then /ready, first answer 200."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"replica on port {self.port} exited with {self.proc.returncode}")
        path = "/health" if self.health_s is None else "/ready"
        try:
            ok = httpx.get(f"{self.url}{path}", timeout=1).status_code == 200
        except httpx.HTTPError:
            return
        if ok and self.health_s is None:
            self.health_s = time.monotonic() - self.started
        elif ok:
            self.ready_s = time.monotonic() - self.started

    def status(self) -> dict[str, int]:
        """VmRSS / VmHWM of the server process, bytes."""
        fields = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                    fields[key] = int(value.split()[0]) * 1024
        return fields

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._log:
            self._log.close()


def wait_all_ready(replicas: list[Replica], timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while any(r.ready_s is None for r in replicas):
        if time.monotonic() > deadline:
            raise RuntimeError("replicas did not become ready in time")
        for replica in replicas:
            if replica.ready_s is None:
                replica.poll()
        time.sleep(POLL_S)


def one_start(model: str, variant: str, home: Path, args: argparse.Namespace, extra: tuple[str, ...]) -> dict[str, Any]:
    quantization, env = VARIANTS[variant]
    log_path = home / f"serve-{variant}-{time.monotonic_ns()}.log"
    replica = Replica(model, ("--quantization", quantization, *extra), args.threads,
                      {"TOKENMILL_HOME": str(home), **env}, log_path)
    try:
        wait_all_ready([replica])
        served = httpx.get(f"{replica.url}/v1/models", timeout=30).json()["data"][0]["id"]
        started = time.monotonic()
        response = httpx.post(f"{replica.url}/v1/completions", timeout=600,
                              json={"model": served, "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0})
        first_request_s = time.monotonic() - started
        response.raise_for_status()
        memory = replica.status()
    finally:
        replica.stop()
    assert replica.health_s is not None and replica.ready_s is not None
    return {"variant": variant, "health_s": replica.health_s, "ready_s": replica.ready_s,
            "first_request_s": first_request_s, **{k.lower(): v for k, v in memory.items()},
            "load_avg_1m": os.getloadavg()[0]}


def measure_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    model, extra = resolve(name)
    home = Path(tempfile.mkdtemp(prefix="tokenmill-cold-"))
    runs: list[dict[str, Any]] = []
    try:
        runs.append(one_start(model, "first", home, args, extra))
        print(f"  {name} first:  ready {runs[-1]['ready_s']:.1f} s", flush=True)
        # Alternate the rest, so a load spike from other tenants spreads over all variants.
        for _ in range(args.repeats):
            for variant in ("second", "repack", "none"):
                runs.append(one_start(model, variant, home, args, extra))
                print(f"  {name} {variant}: ready {runs[-1]['ready_s']:.1f} s", flush=True)
        cache_bytes = sum(p.stat().st_size for p in (home / "repack").glob("*.safetensors")) \
            if (home / "repack").is_dir() else 0
    finally:
        if not args.keep_home:
            shutil.rmtree(home, ignore_errors=True)
    return summarize(runs, cache_bytes)


def summarize(runs: list[dict[str, Any]], cache_bytes: int) -> dict[str, Any]:
    figures: dict[str, Any] = {"runs": runs, "repack_cache_bytes": cache_bytes}
    for variant in VARIANTS:
        mine = [r for r in runs if r["variant"] == variant]
        for key in ("health_s", "ready_s", "first_request_s", "vmrss", "vmhwm"):
            figures[f"{variant}_{key}"] = statistics.median(r[key] for r in mine)
    for variant in ("first", "second"):
        for peer in ("repack", "none"):
            figures[f"{variant}_ready_vs_{peer}"] = figures[f"{variant}_ready_s"] / figures[f"{peer}_ready_s"]
    return figures


def resolve(name: str) -> tuple[str, tuple[str, ...]]:
    if name == "tiny":
        from tests.fixtures.tiny_models import make_tiny_gguf

        path = make_tiny_gguf("llama", Path(tempfile.mkdtemp(prefix="tiny-llama-")) / "tiny-llama.gguf")
        return str(path), TINY_ARGS
    from tokenmill.models.resolve import resolve_model

    return str(resolve_model(name).path), ()


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform()}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                           if line.startswith("model name"))
        flags = next(line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags"))
        info["isa_flags"] = sorted(f for f in flags if f.startswith(("avx", "fma", "f16c", "amx")))
    except (OSError, StopIteration):
        pass
    return info


def report(name: str, f: dict[str, Any], args: argparse.Namespace) -> None:
    mb = 1e6
    print(f"\n{name}: spawn → /ready (median), first request, server memory after it")
    for variant in VARIANTS:
        print(f"  {variant:7s} /health {f[f'{variant}_health_s']:5.1f} s  /ready {f[f'{variant}_ready_s']:6.1f} s  "
              f"first request {f[f'{variant}_first_request_s']:5.2f} s  VmRSS {f[f'{variant}_vmrss'] / mb:6.0f} MB  "
              f"VmHWM {f[f'{variant}_vmhwm'] / mb:6.0f} MB")
    print(f"  second start / repack every start = {f['second_ready_vs_repack']:.2f}, "
          f"second / none = {f['second_ready_vs_none']:.2f}, first / repack = {f['first_ready_vs_repack']:.2f}; "
          f"repack cache {f['repack_cache_bytes'] / mb:.0f} MB on disk", flush=True)
    save(name, "cold_start", f, args)


def save(name: str, benchmark: str, figures: dict[str, Any], args: argparse.Namespace) -> None:
    record = {"benchmark": benchmark, "model": name, "date": dt.date.today().isoformat(),
              "config": vars(args), "machine": {**machine(), "load_avg_1m": os.getloadavg()[0]}, "figures": figures}
    # The host in the name: hosts never overwrite each other; --tag keeps two runs of a day apart.
    path = common.result_path(benchmark, f"{name}_{args.tag}" if args.tag else name, "json")
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"  saved {path.relative_to(ROOT)}")


# ---- --fleet: N replicas started one after another vs all at once (the gateway's case) -------------


def fleet(model: str, extra: tuple[str, ...], threads: int, num: int, concurrent: bool) -> float:
    """Seconds until `num` replicas are all ready, started all at once or one after another."""
    started = time.monotonic()
    replicas: list[Replica] = []
    try:
        for _ in range(num):
            replicas.append(Replica(model, extra, threads))
            if not concurrent:
                wait_all_ready(replicas)
        wait_all_ready(replicas)
        return time.monotonic() - started
    finally:
        for replica in replicas:
            replica.stop()


def measure_fleet(name: str, args: argparse.Namespace) -> None:
    model, extra = resolve(name)
    sequential = [fleet(model, extra, args.threads, args.replicas, concurrent=False) for _ in range(args.repeats)]
    concurrent = [fleet(model, extra, args.threads, args.replicas, concurrent=True) for _ in range(args.repeats)]
    seq, conc = statistics.median(sequential), statistics.median(concurrent)
    print(f"{name}: {args.replicas} replicas all ready: sequential {seq:.2f} s, concurrent {conc:.2f} s "
          f"(concurrent / sequential = {conc / seq:.2f})", flush=True)
    save(name, "cold_start_fleet", {"num_replicas": args.replicas, "all_ready_sequential_s": seq,
                                    "sequential": sequential, "all_ready_concurrent_s": conc,
                                    "concurrent": concurrent}, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-1.5b"])
    parser.add_argument("--repeats", type=int, default=1, help="rounds of (second, repack, none) after the first")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per server")
    parser.add_argument("--keep-home", action="store_true", help="keep the temporary TOKENMILL_HOME (logs, caches)")
    parser.add_argument("--tag", default="", help="suffix of the result file name (a second run of a day "
                                                   "otherwise overwrites the first)")
    parser.add_argument("--fleet", action="store_true", help="measure N replicas sequential vs concurrent instead")
    parser.add_argument("--replicas", type=int, default=3)
    args = parser.parse_args()
    # A timeout's SIGTERM unwinds through the `finally`s, so no server outlives the benchmark.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"CPU: {machine().get('cpu')}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    for name in args.models:
        if args.fleet:
            measure_fleet(name, args)
        else:
            report(name, measure_model(name, args), args)


if __name__ == "__main__":
    main()
