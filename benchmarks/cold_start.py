"""Cold start of a replica: `tokenmill serve` spawn → /health answers → /ready (model loaded).

    python benchmarks/cold_start.py                           # tiny (built on the fly) and smollm2-135m
    python benchmarks/cold_start.py --models smollm2-135m --replicas 3 --repeats 3

For each model it prints, as medians over --repeats:
  - one replica: spawn → /health (interpreter, imports, app; the socket is bound while the weights
    load in the background) and spawn → /ready (the replica can serve);
  - N replicas started one after another (what a naive launcher does) vs all at once (what the
    gateway does), time until all N are ready, and the ratio (the peer: sequential start);
and saves results/cold_start_<model>_<date>.json. The gateway's other cut, the warm buffer,
makes this time invisible to requests while the buffer lasts (tests/gateway/test_chaos.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # tests.fixtures (the tiny model) and an uninstalled tokenmill

POLL_S = 0.02
TINY_ARGS = ("--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Replica:
    def __init__(self, model: str, extra_args: tuple[str, ...], threads: int) -> None:
        self.port = free_port()
        command = [sys.executable, "-m", "tokenmill", "serve", model, "--port", str(self.port),
                   "--threads", str(threads), "--log-level", "warning", *extra_args]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.started = time.monotonic()
        self.proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.health_s: float | None = None
        self.ready_s: float | None = None

    def poll(self) -> None:
        """Advance: note when /health, then /ready, first answer 200."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"replica on port {self.port} exited with {self.proc.returncode}")
        path = "/health" if self.health_s is None else "/ready"
        try:
            ok = httpx.get(f"http://127.0.0.1:{self.port}{path}", timeout=1).status_code == 200
        except httpx.HTTPError:
            return
        if ok and self.health_s is None:
            self.health_s = time.monotonic() - self.started
        elif ok:
            self.ready_s = time.monotonic() - self.started

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def wait_all_ready(replicas: list[Replica], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while any(r.ready_s is None for r in replicas):
        if time.monotonic() > deadline:
            raise RuntimeError("replicas did not become ready in time")
        for replica in replicas:
            if replica.ready_s is None:
                replica.poll()
        time.sleep(POLL_S)


def one_replica(model: str, extra: tuple[str, ...], threads: int) -> tuple[float, float]:
    replica = Replica(model, extra, threads)
    try:
        wait_all_ready([replica])
    finally:
        replica.stop()
    assert replica.health_s is not None and replica.ready_s is not None
    return replica.health_s, replica.ready_s


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


def measure(model: str, extra: tuple[str, ...], args: argparse.Namespace) -> dict[str, Any]:
    singles = [one_replica(model, extra, args.threads) for _ in range(args.repeats)]
    sequential = [fleet(model, extra, args.threads, args.replicas, concurrent=False) for _ in range(args.repeats)]
    concurrent = [fleet(model, extra, args.threads, args.replicas, concurrent=True) for _ in range(args.repeats)]
    return {
        "health_s": statistics.median(h for h, _ in singles), "ready_s": statistics.median(r for _, r in singles),
        "singles": singles, "num_replicas": args.replicas,
        "all_ready_sequential_s": statistics.median(sequential), "sequential": sequential,
        "all_ready_concurrent_s": statistics.median(concurrent), "concurrent": concurrent,
    }


def tiny_model_dir() -> str:
    from tests.fixtures.tiny_models import make_tiny_hf

    return str(make_tiny_hf("llama", Path(tempfile.mkdtemp(prefix="tiny-llama-"))))


def report(name: str, figures: dict[str, Any], args: argparse.Namespace) -> None:
    seq, conc = figures["all_ready_sequential_s"], figures["all_ready_concurrent_s"]
    print(f"{name}: spawn → /health {figures['health_s']:.2f} s, spawn → /ready {figures['ready_s']:.2f} s; "
          f"{args.replicas} replicas all ready: sequential {seq:.2f} s, concurrent {conc:.2f} s "
          f"(concurrent / sequential = {conc / seq:.2f})", flush=True)
    record = {"benchmark": "cold_start", "model": name, "date": dt.date.today().isoformat(),
              "config": vars(args), "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                "load_avg_1m": os.getloadavg()[0]}, "figures": figures}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"cold_start_{name}_{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m"])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    args = parser.parse_args()
    for name in args.models:
        model, extra = (tiny_model_dir(), TINY_ARGS) if name == "tiny" else (name, ())
        report(name, measure(model, extra, args), args)


if __name__ == "__main__":
    main()
