"""Step profiling: the phase breakdown, the files it writes, and that it changes nothing it times."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.engine.tiny import tiny_model
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ProfileConfig, SchedulerConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.llm_engine import EngineStep
from tokenmill.engine.profiling import OP_CLASSES, PHASES, PhaseTimer, StepProfiler, StepRecord, StepShape, summarize
from tokenmill.engine.request import SamplingParams
from tokenmill.models.native_stack import NATIVE_STACK_ENV


def _core(profile: ProfileConfig) -> EngineCore:
    tiny = tiny_model("llama")
    config = EngineConfig(ModelConfig("tiny", dtype="float32", device="cpu"), CacheConfig(num_blocks=64),
                          SchedulerConfig(max_num_seqs=8), profile=profile)
    return EngineCore(config, tiny.arch, tiny.state_dict)


class _Driver:
    """LLMEngine's step loop without a tokenizer: core steps wrapped in EngineSteps."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def step(self) -> EngineStep:
        result = self.core.step()
        with self.core.timer.phase("output"):
            pass
        return EngineStep([], result.stats)


def _tokens(core: EngineCore, profiler: StepProfiler | None) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    for i in range(3):
        core.add_request(f"r{i}", [1 + i, 5, 9, 2 + i, 7], params, ())
    requests = dict(core.scheduler.requests)
    driver = _Driver(core)
    while core.has_unfinished:
        if profiler is not None:
            profiler.step(driver.step)
        else:
            driver.step()
    return {rid: r.output_token_ids for rid, r in requests.items()}


@pytest.mark.parametrize("native_stack", [True, False])
def test_a_profile_times_every_phase_writes_its_files_and_leaves_outputs_unchanged(
        tmp_path: Path, native_stack: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # With the native stack a decode step's layers are one op class; without it, the layers' own.
    if not native_stack:
        monkeypatch.setenv(NATIVE_STACK_ENV, "0")
    config = ProfileConfig(num_steps=3, output_dir=str(tmp_path), warmup_steps=1)
    plain = _tokens(_core(ProfileConfig()), None)
    core = _core(config)
    profiler = StepProfiler(config, core)
    profiled = _tokens(core, profiler)
    assert profiled == plain  # timing wrappers and the torch profiler change no token
    assert profiler.done and not core.timer.enabled
    assert len(profiler.result.records) == 6 and sum(r.traced for r in profiler.result.records) == 3
    timed = [r for r in profiler.result.records if not r.traced]
    for r in timed:
        assert {"schedule", "build_input", "forward", "logits", "sample", "update", "output"} <= set(r.phases)
        assert set(r.phases) <= set(PHASES) | {f"forward.{n}" for n in OP_CLASSES}
        if native_stack:
            assert r.phases["forward.native_stack"] > 0 and "forward.linear" not in r.phases
        else:
            assert r.phases["forward.linear"] > 0 and r.phases["forward.attention"] > 0
            assert "forward.native_stack" not in r.phases
        assert sum(r.phases[p] for p in PHASES if p in r.phases) <= r.step_s
    assert all(r.shape is not None and r.shape.kind == "decode" for r in timed)  # after a 1-step warmup
    data = json.loads((tmp_path / "profile.json").read_text())
    assert "decode batch=3" in data["summary"] and data["top_ops"]
    assert "tokenmill.forward" in (tmp_path / "trace.json").read_text()  # phases labelled in the trace
    assert "decode batch=3" in (tmp_path / "profile.txt").read_text()
    # The wrappers came off: the model's layers are its own objects again.
    assert type(core.runner.model.attn).__name__ == "PagedAttention"
    assert (core.runner.model.native_stack is not None) == native_stack
    assert native_stack is False or type(core.runner.model.native_stack).__name__ == "NativeDecodeStack"


def test_the_timer_is_a_no_op_when_disabled() -> None:
    timer = PhaseTimer()
    with timer.phase("forward"):
        pass
    assert timer.take() == ({}, None)
    timer.enabled = True
    with timer.phase("forward"):
        pass
    times, _ = timer.take()
    assert set(times) == {"forward"}


def test_summary_splits_host_time_from_forward_and_groups_by_shape() -> None:
    decode = StepShape(32, 0, 32)
    records = [StepRecord(0.100, {"forward": 0.080, "logits": 0.010, "sample": 0.004, "forward.linear": 0.06}, decode)
               for _ in range(3)]
    records.append(StepRecord(1.0, {"forward": 0.9}, StepShape(0, 512, 1)))
    records.append(StepRecord(9.0, {"forward": 0.1}, decode, traced=True))  # traced steps stay out
    summary = summarize(records)
    d = summary["decode batch=32"]
    assert d["steps"] == 3 and d["host_ms"] == pytest.approx(10.0) and d["host_fraction"] == pytest.approx(0.1)
    assert d["forward_ops_ms"]["linear"] == pytest.approx(60.0) and d["forward_ops_ms"]["other"] == pytest.approx(20.0)
    assert summary["prefill tokens=512 seqs=1"]["host_fraction"] == pytest.approx(0.1)


def test_a_profile_samples_the_engine_threads_python_stacks(tmp_path: Path) -> None:
    """stacks.txt: folded stacks (py-spy's raw format) of the thread that steps, from the instrumented window."""
    config = ProfileConfig(num_steps=3, output_dir=str(tmp_path), warmup_steps=1, torch_trace=False,
                           sample_interval_ms=0.5)
    core = _core(config)
    schedule = core.scheduler.schedule

    def slow_schedule() -> Any:  # 3 ms of Python a step: enough samples to find, whatever the machine
        deadline = time.perf_counter() + 0.003
        while time.perf_counter() < deadline:
            pass
        return schedule()

    core.scheduler.schedule = slow_schedule  # type: ignore[method-assign]
    profiler = StepProfiler(config, core)
    _tokens(core, profiler)
    assert sum(r.traced for r in profiler.result.records) == 3  # the window runs without a torch trace too
    assert not (tmp_path / "trace.json").exists()
    lines = (tmp_path / "stacks.txt").read_text().splitlines()
    assert lines and all(re.fullmatch(r".+ \d+", line) for line in lines)
    # This thread (the one that steps), in this loop; a generator caught mid-resume shows no caller.
    assert all("_tokens (" in line or line.startswith("(a resumed generator") for line in lines)
    slow = sum(int(line.rsplit(" ", 1)[1]) for line in lines
               if re.search(r"EngineCore\.step \(tokenmill/engine/core\.py:\d+\);.*slow_schedule", line))
    total = sum(int(line.rsplit(" ", 1)[1]) for line in lines)
    assert slow >= 0.3 * total  # 9 ms of the window's ~10-20 ms: where the thread was
    data = json.loads((tmp_path / "profile.json").read_text())
    assert data["files"]["stacks"] == str(tmp_path / "stacks.txt") and data["top_frames"]
    assert "engine thread, Python frames" in (tmp_path / "profile.txt").read_text()
