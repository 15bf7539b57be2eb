"""Engine threads matched to the CPUs this process actually gets, when other processes take some.

OpenMP's workers meet at the end of every parallel region (~150 of them in a decode step) and spin
while they wait. When another process keeps a CPU busy, one of our threads is off-CPU for a time
slice at a time and every region waits for it: a SmolLM2 decode step on 2 vCPUs with one busy
process beside it took 19.7 ms at batch 1 (7.5 ms alone) with 2 threads, but 9.0 ms with 1
(docs/performance.md, "CPU share"). The same holds for two replicas sharing cores.

So the engine measures, every `interval_s`, how much of its CPUs (the affinity mask) other processes
used — from /proc/stat's per-CPU busy ticks (steal included: a hypervisor's other guests count too)
minus this process's own (/proc/self/stat) — and runs on the CPUs left:

    others = (Δbusy(our CPUs) − Δours) / (Δticks(our CPUs) / n)     in cores
    threads = clamp(n − floor(others + 1 − GIVE_UP_AT), 1, configured threads)

i.e. a thread is given up for each GIVE_UP_AT (0.4) of a core others take, then each whole core more.
Where that lies was measured with a neighbour busy a fraction of every 10 ms (SmolLM2, 2 vCPUs, batch
1 / 4): at 30% 2 threads were faster (9.7 / 17.4 ms against 11.6 / 20.1), at 50% 1 thread (11.3 / 24.9
against 16.0 / 25.4), at 70% 1 thread (10.8 / 21.2 against 16.4 / 29.9).

A drop applies after one interval (contention costs 2-3x at once); a rise after `rise_intervals`
in a row (a competitor that pauses for a moment should not flip us back and forth), or at once when
the engine resumes after sitting idle for more than IDLE_INTERVALS intervals (its evidence is stale). The thread count
changes through torch.set_num_threads on the engine thread, whose parallel regions it governs.
Off on non-CPU devices and where /proc is missing.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from tokenmill.kernels import cpu_kernels

log = logging.getLogger(__name__)

GIVE_UP_AT = 0.4  # cores of our CPUs other processes take before a compute thread is given up (measured above)
# An engine that ran no step for more than this many intervals has been idle: its next step starts a fresh
# baseline and gets its threads back. (Two: a benchmark client's 2 s wait for a quiet machine, after its
# own tokenizer load had cost the server a thread, is an idle server that should come back whole.)
IDLE_INTERVALS = 2


@dataclass(frozen=True, slots=True)
class CpuSample:
    busy_ticks: int  # busy time of the process's CPUs, summed (user, nice, system, irq, softirq, steal)
    total_ticks: int  # all time of those CPUs, summed (busy + idle + iowait)
    own_ticks: int  # this process's CPU time (utime + stime)


class CpuReader(Protocol):
    num_cpus: int

    def read(self) -> CpuSample | None: ...


class ProcCpuReader:
    """CpuSamples from /proc for the CPUs in this process's affinity mask (Linux). `own` are the
    processes whose CPU time counts as ours (benchmarks add the server they measure)."""

    def __init__(self, proc: Path = Path("/proc"), own: tuple[int | str, ...] = ("self",)) -> None:
        self.proc = proc
        self.own = own
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.num_cpus = len(self.cpus)

    def read(self) -> CpuSample | None:
        try:
            stat = (self.proc / "stat").read_text()
        except OSError:
            return None
        wanted = {f"cpu{c}" for c in self.cpus}
        busy = total = 0
        for line in stat.splitlines():
            fields = line.split()
            if not fields or fields[0] not in wanted:
                continue
            user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
            busy += user + nice + system + irq + softirq + steal
            total += user + nice + system + idle + iowait + irq + softirq + steal
        own_ticks = 0
        for pid in self.own:
            try:
                own = (self.proc / str(pid) / "stat").read_text()
            except OSError:
                if pid == "self":
                    return None
                continue  # a process of ours that has exited
            # /proc/PID/stat: "pid (comm) state ..." where comm may hold spaces; utime, stime are fields 14, 15.
            after_comm = own[own.rindex(")") + 2:].split()
            own_ticks += int(after_comm[11]) + int(after_comm[12])
        return CpuSample(busy, total, own_ticks)


def others_cores(before: CpuSample, after: CpuSample, num_cpus: int) -> float:
    """Cores of `num_cpus` CPUs that other processes kept busy between two samples (0 when no time passed)."""
    d_total = after.total_ticks - before.total_ticks
    if d_total <= 0:
        return 0.0
    d_others = (after.busy_ticks - before.busy_ticks) - (after.own_ticks - before.own_ticks)
    return max(0.0, d_others / (d_total / num_cpus))


class ThreadGovernor:
    """Sets the engine's thread count from the CPU share other processes leave it (module docstring)."""

    def __init__(self, max_threads: int, reader: CpuReader, interval_s: float = 1.0, rise_intervals: int = 3,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_threads = max_threads
        self.reader = reader
        self.interval_s = interval_s
        self.rise_intervals = rise_intervals
        self.set_threads = set_threads
        self.clock = clock
        self.threads = max_threads
        self.others_cores = 0.0  # the last interval's measure
        self._rises = 0
        self._last: CpuSample | None = None
        self._last_time = 0.0

    def tick(self) -> None:
        """Once per engine step (cheap: a clock read unless an interval has passed)."""
        now = self.clock()
        if self._last is not None and now - self._last_time < self.interval_s:
            return
        sample = self.reader.read()
        previous, gap = self._last, now - self._last_time
        self._last, self._last_time = sample, now
        # A first sample, or one after the engine sat idle for a while: a fresh baseline, no decision;
        # after idling, the threads given up come back at once (the contention that took them is old
        # news, and a new one takes them again after one interval). Held back, a server that gave up
        # a thread while the client beside it started kept it for the first 5 s of a 16-request burst
        # (Zen 5: 147 output tok/s against 207-217 with both threads; docs/performance.md).
        idle = gap > IDLE_INTERVALS * self.interval_s
        if previous is not None and idle and self.threads < self.max_threads:
            self._apply(self.max_threads, f"idle for {gap:.1f} s")
        if sample is None or previous is None or idle:
            return
        if sample.total_ticks <= previous.total_ticks:
            return
        self.others_cores = others_cores(previous, sample, self.reader.num_cpus)
        given_up = math.floor(self.others_cores + 1 - GIVE_UP_AT)
        self._decide(max(1, min(self.max_threads, self.reader.num_cpus - given_up)))

    def _decide(self, target: int) -> None:
        if target < self.threads:
            self._apply(target)
        elif target > self.threads:
            self._rises += 1
            if self._rises >= self.rise_intervals:
                self._apply(target)
        else:
            self._rises = 0

    def _apply(self, threads: int, why: str | None = None) -> None:
        reason = why or f"other processes used {self.others_cores:.2f} of this engine's {self.reader.num_cpus} CPUs"
        log.info("%s: %d compute thread%s (was %d)", reason, threads, "" if threads == 1 else "s", self.threads)
        self.set_threads(threads)
        self.threads = threads
        self._rises = 0


def build_governor(device: torch.device, enabled: bool) -> ThreadGovernor | None:
    """The governor for an engine on `device`, or None (off, not a CPU, or no /proc to read)."""
    if not enabled or device.type != "cpu":
        return None
    reader = ProcCpuReader()
    if reader.num_cpus < 2 or reader.read() is None:
        return None
    governor = ThreadGovernor(min(torch.get_num_threads(), reader.num_cpus), reader)
    # Decode attention splits a sequence's keys by thread count; pinned at the governor's most, a row's
    # float sums (and so greedy tokens) do not change when the governor gives a thread up.
    native = cpu_kernels()
    if native is not None:
        native.set_decode_split_threads(governor.max_threads)
    return governor
