"""Shared helpers of the benchmark scripts: prompts, machine noise, timing stats, results on disk.

Every script is run as `python benchmarks/NAME.py`, so this module also puts the repository
root on `sys.path` (tokenmill need not be installed).
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import datetime as _dt
import importlib
import importlib.util
import io
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"

if importlib.util.find_spec("tokenmill") is None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # else: an installed tokenmill, or one on PYTHONPATH, wins

from host_info import environment, host_label  # noqa: E402  (re-exported: benchmarks import them from here)

MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")
T = TypeVar("T")


# ---------------------------------------------------------------- prompts


def workload_arguments(p: argparse.ArgumentParser) -> None:
    """The offline workload the throughput and memory benchmarks share: N prompts of L tokens, O out."""
    p.add_argument("--model", choices=MODELS, default="smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)


def corpus_text() -> str:
    """English prose from the Zen of Python, then the stdlib docstrings `tokenmill bench` cuts its
    prompts from (tokenmill.bench.corpus), in a fixed order."""
    from tokenmill.bench.corpus import TextKind
    from tokenmill.bench.corpus import corpus_text as bench_corpus

    return _zen_of_python() + "\n\n" + bench_corpus(TextKind.PROSE)


def _zen_of_python() -> str:
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        this = importlib.import_module("this")
    return codecs.decode(this.s, "rot13")


def build_prompts(encode: Callable[..., list[int]], num_prompts: int, prompt_len: int,
                  bos_token_id: int | None) -> list[list[int]]:
    """`num_prompts` prompts of exactly `prompt_len` token ids: consecutive, non-overlapping windows
    of the corpus (so no two prompts share a prefix), each led by BOS when the model uses one."""
    ids = encode(corpus_text(), add_special_tokens=False)
    body = prompt_len - (1 if bos_token_id is not None else 0)
    if len(ids) < num_prompts * body:
        ids = ids * (num_prompts * body // len(ids) + 1)  # wraps only for very long requests
    lead = [bos_token_id] if bos_token_id is not None else []
    return [lead + ids[i * body:(i + 1) * body] for i in range(num_prompts)]


def prompt_bos(tokenizer: Any) -> int | None:
    return tokenizer.bos_token_id if tokenizer.add_bos_token else None


# ---------------------------------------------------------------- servers under test


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def server_process(argv: list[str], ready_url: str, log_path: Path, threads: int,
                   timeout_s: float = 300.0, root: Path | None = None) -> Iterator[int]:
    """The pid of a server started from `argv` (log to `log_path`), once `ready_url` answers 200;
    stopped (SIGTERM, then SIGKILL) on the way out. A server that dies first is a one-line exit.
    `root` (default ROOT): the checkout it runs, as its working directory and PYTHONPATH. Both: for
    `python -m`, the working directory comes first on sys.path, so a PYTHONPATH alone loses to the
    checkout the bench was started from (an A/B of two checkouts then ran one of them twice)."""
    import subprocess

    import httpx

    log_path.parent.mkdir(parents=True, exist_ok=True)
    root = root or ROOT
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(root)}
    with log_path.open("w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if process.poll() is not None:
                    raise SystemExit(f"the server exited with {process.returncode} before it was ready: see {log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(ready_url, timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise SystemExit(f"{ready_url} was not ready after {timeout_s:.0f} s")
                time.sleep(0.5)
            yield process.pid
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# ---------------------------------------------------------------- machine noise


@dataclass(slots=True)
class NoiseMeter:
    """CPU time that *other* processes used while this one ran, in cores (0 = quiet machine), over this
    process's CPUs (the engine's own reading: tokenmill/engine/cpu_share.py).

    On 2 cores any other busy process stalls every parallel op (see shared/CPU_NOTES.md), so
    each figure carries the noise it was measured under.
    """

    also_ours: tuple[int, ...] = ()  # pids whose CPU time is ours too (the server a benchmark measures)
    reader: Any = None
    start: Any = None

    def __post_init__(self) -> None:
        from tokenmill.engine.cpu_share import ProcCpuReader

        self.reader = ProcCpuReader(own=("self", *self.also_ours))
        self.restart()

    def restart(self) -> None:
        self.start = self.reader.read()

    def others_cores(self) -> float:
        from tokenmill.engine.cpu_share import others_cores

        now = self.reader.read()
        return 0.0 if now is None or self.start is None else others_cores(self.start, now, self.reader.num_cpus)


def wait_for_quiet(max_wait_s: float, threshold_cores: float = 0.25, window_s: float = 2.0,
                   also_ours: tuple[int, ...] = ()) -> float:
    """Sleep until other processes (not this one, nor `also_ours`) use under `threshold_cores` over a
    window (or give up). Returns the last measured load of others, in cores."""
    deadline = time.monotonic() + max_wait_s
    while True:
        meter = NoiseMeter(also_ours)
        time.sleep(window_s)
        load = meter.others_cores()
        if load < threshold_cores or time.monotonic() >= deadline:
            if load >= threshold_cores:
                print(f"warning: machine still busy (others use {load:.2f} cores); measuring anyway")
            return load
        print(f"waiting for a quiet machine: others use {load:.2f} cores")


def after_quiet(run: Callable[[], dict[str, Any]], quiet_wait_s: float) -> dict[str, Any]:
    """Wait for a quiet machine, run one measured shape, and add the cores other processes used
    meanwhile to its result (`others_cores`)."""
    wait_for_quiet(quiet_wait_s)
    meter = NoiseMeter()
    return {**run(), "others_cores": meter.others_cores()}


def quietest(run: Callable[[], T], noise_of: Callable[[T], float], attempts: int, noise_limit: float,
             quiet_wait_s: float) -> tuple[T, list[float]]:
    """Run a timed phase until other processes stayed under `noise_limit` cores during it, at most
    `attempts` times; keep the quietest run. Returns it and the noise of every attempt."""
    best: T | None = None
    noises: list[float] = []
    for _ in range(max(1, attempts)):
        wait_for_quiet(quiet_wait_s)
        result = run()
        noises.append(noise_of(result))
        if best is None or noises[-1] < noise_of(best):
            best = result
        if noises[-1] <= noise_limit:
            break
        print(f"others used {noises[-1]:.2f} cores during the run: measuring again")
    assert best is not None
    return best, noises


# ---------------------------------------------------------------- timing


@dataclass(slots=True)
class Stats:
    n: int
    median: float
    mean: float
    p10: float
    p90: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        ordered = sorted(values)
        return cls(len(ordered), statistics.median(ordered), statistics.fmean(ordered), _quantile(ordered, 0.1),
                   _quantile(ordered, 0.9), ordered[0], ordered[-1])


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The value at rank floor(q * n) of the sorted values (NaN when there are none)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks."""
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class Timer:
    """`with Timer() as t: ...` then `t.elapsed_s`."""

    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        self.elapsed_s = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed_s = time.perf_counter() - self.start


def pin_threads(num_threads: int) -> None:
    import torch

    torch.set_num_threads(num_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(num_threads))


# ---------------------------------------------------------------- model sizes


def weight_bytes(model: Any) -> dict[str, Any]:
    """Bytes of the weights a decode step reads: every linear layer's storage once (a tied lm_head
    counted once), norms and the embedding rows excluded (a step reads a few rows of it)."""
    linears = model.linears()
    head_storage = linears["lm_head"].storage[0].data_ptr()
    embed = model.embedding.dense_weight
    tied = embed is not None and embed.data_ptr() == head_storage
    return {"bytes": model.weight_bytes(), "num_tensors": len(linears), "lm_head_tied_to_embedding": tied,
            "embedding_bytes": model.embedding.nbytes,
            "dtypes": sorted({linear.method for linear in linears.values()})}


def gguf_arch(model: str) -> Any:
    """The ArchConfig of an installed GGUF model, from its header alone (no weights read)."""
    from tokenmill.models.loading.gguf_header import read_gguf_header
    from tokenmill.models.loading.gguf_weights import gguf_arch_config
    from tokenmill.models.resolve import resolve_model

    path = resolve_model(model).path
    return gguf_arch_config(read_gguf_header(path), path)


def kv_bytes_per_token(arch: Any, dtype: Any) -> int:
    import torch

    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * torch.empty(0, dtype=dtype).element_size()


# ---------------------------------------------------------------- results


def result_path(benchmark: str, model: str, suffix: str) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    return RESULTS_DIR / f"{benchmark}_{model}_{_dt.date.today().isoformat()}_{host_label()}.{suffix}"


def save_json(benchmark: str, model: str, payload: dict[str, Any]) -> Path:
    path = result_path(benchmark, model, "json")
    path.write_text(json.dumps({"benchmark": benchmark, "model": model, "environment": environment(), **payload},
                               indent=2, default=_jsonable) + "\n")
    print(f"saved {path.relative_to(ROOT)}")
    return path


def _jsonable(value: object) -> object:
    if hasattr(value, "__dataclass_fields__"):
        return {k: getattr(value, k) for k in value.__dataclass_fields__}
    return str(value)


def new_figure(benchmark: str, model: str) -> tuple[Any, Any, Path]:
    """A matplotlib (figure, axes, png path), headless."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    return fig, ax, result_path(benchmark, model, "png")


def save_figure(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path)
    print(f"saved {path.relative_to(ROOT)}")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def verdict(ratio: float, target: float) -> str:
    return f"{ratio:.2f}x (target >= {target:g}x: {'PASS' if ratio >= target else 'FAIL'})"
