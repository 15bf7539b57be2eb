"""ThreadGovernor: compute threads from the CPU share other processes leave (fake /proc readings)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokenmill.engine.cpu_share import CpuSample, ProcCpuReader, ThreadGovernor, others_cores
from tokenmill.kernels import cpu_kernels


class FakeReader:
    """Two CPUs; each `advance` is one 1-second interval at 100 ticks a second per CPU."""

    num_cpus = 2

    def __init__(self) -> None:
        self.sample = CpuSample(0, 0, 0)

    def advance(self, others_cores: float, own_cores: float) -> None:
        s = self.sample
        busy = round(100 * (others_cores + own_cores))
        self.sample = CpuSample(s.busy_ticks + busy, s.total_ticks + 200, s.own_ticks + round(100 * own_cores))

    def read(self) -> CpuSample:
        return self.sample


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _governor() -> tuple[ThreadGovernor, FakeReader, Clock, list[int]]:
    reader, clock, calls = FakeReader(), Clock(), []
    governor = ThreadGovernor(2, reader, interval_s=1.0, rise_intervals=3, set_threads=calls.append, clock=clock)
    governor.tick()  # the baseline
    return governor, reader, clock, calls


def _interval(governor: ThreadGovernor, reader: FakeReader, clock: Clock, others: float, own: float) -> None:
    clock.now += 0.5
    governor.tick()  # mid-interval: no read, no decision
    reader.advance(others, own)
    clock.now += 0.5
    governor.tick()


def test_a_busy_neighbour_takes_a_thread_at_once_and_its_absence_gives_it_back_after_three_intervals() -> None:
    governor, reader, clock, calls = _governor()
    _interval(governor, reader, clock, others=0.02, own=2.0)  # alone: stays at 2
    assert calls == [] and governor.threads == 2
    _interval(governor, reader, clock, others=0.67, own=1.33)  # a busy process beside 2 threads gets ~2/3 core
    assert calls == [1] and governor.threads == 1 and governor.others_cores == pytest.approx(0.67)
    _interval(governor, reader, clock, others=1.0, own=1.0)  # with 1 thread it gets its whole core: stay
    assert calls == [1]
    for _ in range(2):
        _interval(governor, reader, clock, others=0.0, own=1.0)  # it left: not yet
    assert calls == [1]
    _interval(governor, reader, clock, others=0.0, own=1.0)
    assert calls == [1, 2] and governor.threads == 2


def test_a_neighbour_that_pauses_for_a_moment_does_not_flip_the_count() -> None:
    governor, reader, clock, calls = _governor()
    _interval(governor, reader, clock, others=1.0, own=1.0)
    for others in (0.0, 0.0, 1.0, 0.0, 0.0, 1.0):  # idle twice, busy again: never three quiet intervals
        _interval(governor, reader, clock, others=others, own=1.0)
    assert calls == [1]


@pytest.mark.parametrize(("others", "threads"), [(0.3, 2), (0.38, 2), (0.42, 1), (0.5, 1), (1.9, 1)])
def test_a_thread_is_given_up_from_four_tenths_of_a_core(others: float, threads: int) -> None:
    governor, reader, clock, calls = _governor()
    _interval(governor, reader, clock, others=others, own=2.0 - others)
    assert governor.threads == threads and calls == ([] if threads == 2 else [threads])


def test_a_thread_given_up_comes_back_when_the_engine_resumes_after_idling() -> None:
    """The contention that took a thread is old news after an idle gap: the engine resumes on all its
    threads at once, and a neighbour still busy takes one again after one interval."""
    governor, reader, clock, calls = _governor()
    _interval(governor, reader, clock, others=1.0, own=1.0)
    assert calls == [1]
    reader.advance(others_cores=0.0, own_cores=0.0)
    clock.now += 1.5  # a pause of less than two intervals is an ordinary interval: one quiet one of three
    governor.tick()
    assert calls == [1]
    reader.advance(others_cores=0.0, own_cores=0.0)
    clock.now += 2.5  # idle for more than two intervals (a benchmark client's 2 s quiet wait)
    governor.tick()  # the first step after idling
    assert calls == [1, 2] and governor.threads == 2
    _interval(governor, reader, clock, others=1.0, own=1.0)
    assert calls == [1, 2, 1]


def test_an_idle_gap_takes_a_fresh_baseline() -> None:
    """After the engine sat idle (no ticks), the long interval's average decides nothing."""
    governor, reader, clock, calls = _governor()
    reader.advance(others_cores=2.0, own_cores=0.0)
    clock.now += 10.0
    governor.tick()
    assert calls == []
    _interval(governor, reader, clock, others=1.0, own=1.0)
    assert calls == [1]


@pytest.mark.skipif(not Path("/proc/stat").exists() or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux /proc and two CPUs")
def test_the_proc_reader_sees_a_busy_process_beside_it() -> None:
    reader = ProcCpuReader()
    governor = ThreadGovernor(reader.num_cpus, reader, interval_s=0.5, set_threads=lambda n: None)
    governor.tick()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.6)
        governor.tick()
    finally:
        busy.kill()
        busy.wait()
    assert 0.6 <= governor.others_cores <= reader.num_cpus  # the busy loop's core (and whatever else ran)


@pytest.mark.skipif(not Path("/proc/stat").exists() or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux /proc and two CPUs")
def test_a_process_counted_as_ours_is_not_another() -> None:
    """Benchmarks count the server they measure as theirs (benchmarks/common.NoiseMeter)."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        readers = [ProcCpuReader(), ProcCpuReader(own=("self", busy.pid))]
        before = [r.read() for r in readers]
        time.sleep(0.6)
        after = [r.read() for r in readers]
    finally:
        busy.kill()
        busy.wait()
    seen = [others_cores(b, a, r.num_cpus) for r, b, a in zip(readers, before, after, strict=True)
            if b is not None and a is not None]
    assert seen[0] >= 0.6 and seen[1] <= seen[0] - 0.5
    # a process of ours that has exited counts as nothing, not as an unreadable /proc
    assert ProcCpuReader(own=("self", busy.pid)).read() is not None


@pytest.mark.skipif(not Path("/proc/stat").exists() or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux /proc and two CPUs")
@pytest.mark.parametrize("adapt", [True, False])
def test_a_cpu_engine_carries_a_governor_unless_told_not_to(adapt: bool) -> None:
    import torch

    from tests.engine.tiny import tiny_model
    from tokenmill.config import CacheConfig, EngineConfig, ModelConfig
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine.request import SamplingParams

    threads = torch.get_num_threads()
    tiny = tiny_model("llama")
    config = EngineConfig(ModelConfig("tiny", dtype="float32", device="cpu"), CacheConfig(num_blocks=16),
                          adapt_threads=adapt)
    core = EngineCore(config, tiny.arch, tiny.state_dict)
    core.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), ())
    stats = core.step().stats
    torch.set_num_threads(threads)
    assert (core.governor is not None) == adapt
    assert stats.cpu_threads == (min(threads, len(os.sched_getaffinity(0))) if adapt else 0)
    native = cpu_kernels()
    if adapt and native is not None:  # the attention split stays put while the governor moves threads
        assert native.set_decode_split_threads(0) == stats.cpu_threads
