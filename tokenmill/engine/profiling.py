"""Where a step's time goes: per-phase wall clock, the forward split by op class, and a torch trace.

    LLMEngine.step ─┬─ propose      speculative proposals (when on)
                    ├─ schedule     Scheduler.schedule()
                    ├─ build_input  SchedulerOutput → flat step tensors (model_input.py)
                    ├─ forward      the decoder stack: linear / attention / norm / embedding / other
                    ├─ logits       lm_head over the sampled rows (+ prompt logprobs)
                    ├─ sample       Sampler (+ the structured-outputs mask)
                    ├─ update       Scheduler.update(): tokens, stop rules, block frees
                    └─ output       OutputProcessor: detokenize, stop strings, RequestOutputs
    host = step - forward - logits   (what a faster model cannot remove)

`PhaseTimer` is owned by the EngineCore and shared with its ModelRunner; disabled (the default) a
phase is one attribute test and a shared null context. `StepProfiler` (ProfileConfig.num_steps = N)
skips warmup steps, times N steps per phase with the forward's op classes (wrappers put on the
model's own layer objects for that window only, removed after), then records N more steps under
`torch.profiler` (the Chrome trace) and the stack sampler (stack_sampler.py: the engine thread's
Python stacks, folded), whose overhead stays out of the timed window, and writes profile.json /
profile.txt / trace.json / stacks.txt. On CUDA every phase boundary synchronizes while timing.
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenmill.config import ProfileConfig
from tokenmill.engine.stack_sampler import StackSampler

if TYPE_CHECKING:
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine.llm_engine import EngineStep

log = logging.getLogger(__name__)

PHASES = ("propose", "schedule", "build_input", "forward", "logits", "sample", "update", "output")
OP_CLASSES = ("native_stack", "linear", "attention", "norm", "embedding")  # the rest of the forward is "other"
_NULL: AbstractContextManager[None] = nullcontext()


@dataclass(slots=True)
class StepShape:
    num_decode_tokens: int  # tokens of the decode group (one per decoding sequence, + verified proposals)
    num_prefill_tokens: int
    num_seqs: int

    @property
    def kind(self) -> str:
        if self.num_prefill_tokens == 0:
            return "decode"
        return "prefill" if self.num_decode_tokens == 0 else "mixed"

    @property
    def key(self) -> str:
        if self.kind == "decode":
            return f"decode batch={self.num_seqs}"
        if self.kind == "prefill":
            return f"prefill tokens={self.num_prefill_tokens} seqs={self.num_seqs}"
        return f"mixed decode={self.num_decode_tokens} prefill={self.num_prefill_tokens}"


class PhaseTimer:
    """Wall-clock seconds per phase of the current step, when enabled."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.enabled = False
        # Label phases in a torch trace (record_function): only while one records. Each label is two
        # torch op calls, ~0.5 ms over the eight phases of a SmolLM2 decode step, which the timed
        # window used to count as phase and "between" time.
        self.annotate = False
        self.times: dict[str, float] = {}
        self.shape: StepShape | None = None
        self._sync = device is not None and device.type == "cuda"

    def phase(self, name: str) -> AbstractContextManager[None]:
        return self._timed(name) if self.enabled else _NULL

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        self.sync()
        with torch.profiler.record_function(f"tokenmill.{name}") if self.annotate else _NULL:
            started = time.perf_counter()
            try:
                yield
            finally:
                self.sync()
                self.add(name, time.perf_counter() - started)

    def add(self, name: str, seconds: float) -> None:
        self.times[name] = self.times.get(name, 0.0) + seconds

    def sync(self) -> None:
        if self._sync:
            torch.cuda.synchronize()

    def take(self) -> tuple[dict[str, float], StepShape | None]:
        times, shape = self.times, self.shape
        self.times, self.shape = {}, None
        return times, shape


class _Timed:
    """Stands in for one layer object (a Linear, the PagedAttention, the Embedding) while profiling."""

    def __init__(self, inner: Any, timer: PhaseTimer, name: str) -> None:
        self.inner, self.timer, self.name = inner, timer, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.timer.sync()
        started = time.perf_counter()
        out = self.inner(*args, **kwargs)
        self.timer.sync()
        self.timer.add(f"forward.{self.name}", time.perf_counter() - started)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@contextmanager
def op_class_timing(model: nn.Module, timer: PhaseTimer) -> Iterator[None]:
    """Time the model's linear layers, attention, norms and embedding into `timer` (forward.*).

    Only objects the model owns are wrapped (attributes of its layers, hooks on its norm modules),
    and only inside this context; a model of another shape simply reports more as "other"."""
    swapped: list[tuple[Any, str, Any]] = []
    hooks: list[Any] = []

    def swap(owner: Any, attr: str, name: str) -> None:
        inner = getattr(owner, attr, None)
        if inner is not None and not isinstance(inner, nn.Module):
            swapped.append((owner, attr, inner))
            object.__setattr__(owner, attr, _Timed(inner, timer, name))

    starts: dict[int, float] = {}

    def pre(module: nn.Module, _args: Any) -> None:
        timer.sync()
        starts[id(module)] = time.perf_counter()

    def post(module: nn.Module, _args: Any, _out: Any) -> None:
        timer.sync()
        timer.add("forward.norm", time.perf_counter() - starts.pop(id(module)))

    try:
        swap(model, "attn", "attention")
        swap(model, "embedding", "embedding")
        # A decode step the native stack serves runs every layer in one call (models/native_stack.py):
        # it is one op class, the per-layer wrappers below never see it.
        swap(model, "native_stack", "native_stack")
        for layer in getattr(model, "layers", []):
            for attr in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                swap(layer, attr, "linear")
        for module in model.modules():
            if type(module).__name__ == "RMSNorm" and module is not getattr(model, "norm", None):
                hooks.append(module.register_forward_pre_hook(pre))
                hooks.append(module.register_forward_hook(post))
        final_norm = getattr(model, "norm", None)
        if isinstance(final_norm, nn.Module):
            hooks.append(final_norm.register_forward_pre_hook(pre))
            hooks.append(final_norm.register_forward_hook(post))
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for owner, attr, inner in reversed(swapped):
            object.__setattr__(owner, attr, inner)


@dataclass(slots=True)
class StepRecord:
    step_s: float
    phases: dict[str, float]
    shape: StepShape | None
    traced: bool = False  # recorded under the torch profiler (its overhead included)

    @property
    def forward_s(self) -> float:
        return self.phases.get("forward", 0.0) + self.phases.get("logits", 0.0)

    @property
    def host_s(self) -> float:
        return max(0.0, self.step_s - self.forward_s)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def summarize(records: list[StepRecord]) -> dict[str, Any]:
    """Median milliseconds per phase (and share of the step) for each step shape, untraced steps only."""
    groups: dict[str, list[StepRecord]] = {}
    for r in records:
        if not r.traced and r.shape is not None:
            groups.setdefault(r.shape.key, []).append(r)
    result: dict[str, Any] = {}
    for key, group in groups.items():
        step = _median([r.step_s for r in group])
        phases: dict[str, float] = {}
        for name in PHASES:
            value = _median([r.phases.get(name, 0.0) for r in group])
            if value > 0.0:
                phases[name] = value
        forward_ops = {}
        for name in OP_CLASSES:
            value = _median([r.phases.get(f"forward.{name}", 0.0) for r in group])
            if value > 0.0:
                forward_ops[name] = value
        if forward_ops:
            forward_ops["other"] = max(0.0, _median([
                r.phases.get("forward", 0.0) - sum(r.phases.get(f"forward.{n}", 0.0) for n in OP_CLASSES)
                for r in group]))
        host = _median([r.host_s for r in group])
        accounted = _median([sum(r.phases.get(n, 0.0) for n in PHASES) for r in group])
        result[key] = {
            "steps": len(group),
            "step_ms": step * 1e3,
            "phases_ms": {k: v * 1e3 for k, v in phases.items()},
            "forward_ops_ms": {k: v * 1e3 for k, v in forward_ops.items()},
            "host_ms": host * 1e3,
            "host_fraction": host / step if step > 0 else 0.0,
            "unaccounted_ms": max(0.0, step - accounted) * 1e3,  # the driver loop between phases
        }
    return result


def format_summary(summary: dict[str, Any]) -> str:
    lines = []
    for key, s in summary.items():
        lines.append(f"{key}: {s['steps']} steps, median step {s['step_ms']:.2f} ms, host (step - forward - "
                     f"logits) {s['host_ms']:.2f} ms = {s['host_fraction']:.1%}")
        for name, ms in s["phases_ms"].items():
            lines.append(f"  {name:<12} {ms:9.3f} ms  {ms / s['step_ms']:6.1%}")
            if name == "forward":
                for op, op_ms in s["forward_ops_ms"].items():
                    lines.append(f"    {op:<10} {op_ms:9.3f} ms  {op_ms / s['step_ms']:6.1%}")
        lines.append(f"  {'(between)':<12} {s['unaccounted_ms']:9.3f} ms")
    return "\n".join(lines)


def format_top_frames(frames: list[dict[str, Any]]) -> str:
    if not frames:
        return ""
    lines = ["", "engine thread, Python frames by samples of their own (stacks.txt: the folded stacks):"]
    lines += [f"  {f['share']:6.1%}  {f['frame']}" for f in frames]
    return "\n".join(lines)


@dataclass(slots=True)
class ProfileResult:
    records: list[StepRecord] = field(default_factory=list)
    top_ops: list[dict[str, Any]] = field(default_factory=list)  # the traced window's ops by self CPU time
    top_frames: list[dict[str, Any]] = field(default_factory=list)  # the stack samples' leaf frames
    files: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"summary": summarize(self.records), "top_ops": self.top_ops, "top_frames": self.top_frames,
                "steps": [asdict(r) for r in self.records], "files": self.files}


class StepProfiler:
    """Drives the windows of one profile: warmup, timed, traced; then writes the files, once."""

    def __init__(self, config: ProfileConfig, core: EngineCore) -> None:
        self.config = config
        self.core = core
        self.result = ProfileResult()
        self.done = not config.enabled
        self._seen = 0  # steps with work so far
        self._torch: torch.profiler.profile | None = None
        self._sampler: StackSampler | None = None
        self._instrumenting = False

    @property
    def timer(self) -> PhaseTimer:
        return self.core.timer

    def step(self, run: Callable[[], EngineStep]) -> EngineStep:
        """Run one engine step (`run`), timing or tracing it as the window says."""
        if self.done:
            return run()
        warmup, n = self.config.warmup_steps, self.config.num_steps
        index = self._seen - warmup
        traced = index >= n
        if index < 0:
            out = run()
            self._seen += out.stats.num_scheduled_tokens > 0
            return out
        if traced and not self._instrumenting:
            self._instrumenting = True
            self._torch = self._start_torch()
            self._sampler = self._start_sampler()
        self.timer.enabled = True
        self.timer.take()
        context = _NULL if traced else op_class_timing(self.core.runner.model, self.timer)
        try:
            with context:
                self.timer.sync()
                started = time.perf_counter()
                out = run()
                self.timer.sync()
                elapsed = time.perf_counter() - started
        finally:
            self.timer.enabled = False
        phases, shape = self.timer.take()
        if shape is not None and out.stats.num_scheduled_tokens > 0:
            self._seen += 1
            self.result.records.append(StepRecord(elapsed, phases, shape, traced))
        if self._seen - warmup >= (2 * n if self.config.instrumented else n):
            self.finish()
        return out

    def _start_sampler(self) -> StackSampler | None:
        if self.config.sample_interval_ms <= 0:
            return None
        sampler = StackSampler(threading.get_ident(), self.config.sample_interval_ms / 1e3)  # this: the engine thread
        sampler.start()
        return sampler

    def _start_torch(self) -> torch.profiler.profile | None:
        if not self.config.torch_trace:
            return None
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=activities)
        prof.start()
        self.timer.annotate = True
        return prof

    def finish(self) -> ProfileResult:
        """Stop tracing and write the files (also called early by LLMEngine when work runs out)."""
        if self.done:
            return self.result
        self.done = True
        out_dir = Path(self.config.output_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.timer.annotate = False
        if self._torch is not None:
            self._torch.stop()
            trace = out_dir / "trace.json"
            self._torch.export_chrome_trace(str(trace))
            self.result.files["trace"] = str(trace)
            traced_steps = max(1, sum(r.traced for r in self.result.records))
            events = sorted(self._torch.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
            self.result.top_ops = [{"name": e.key, "calls_per_step": e.count / traced_steps,
                                    "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / traced_steps}
                                   for e in events[:30]]
            self._torch = None
        if self._sampler is not None:
            self._sampler.stop()
            stacks = out_dir / "stacks.txt"
            self._sampler.write(stacks)
            self.result.files["stacks"] = str(stacks)
            self.result.top_frames = self._sampler.top_frames()
            self._sampler = None
        summary_path, text_path = out_dir / "profile.json", out_dir / "profile.txt"
        self.result.files.update({"json": str(summary_path), "text": str(text_path)})
        summary_path.write_text(json.dumps(self.result.to_json(), indent=1))
        text = format_summary(summarize(self.result.records)) + format_top_frames(self.result.top_frames)
        text_path.write_text(text + "\n")
        log.info("profile of %d steps written to %s\n%s", len(self.result.records), out_dir, text)
        return self.result
