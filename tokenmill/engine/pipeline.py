"""Asynchronous scheduling: the next step is scheduled and built while the current one runs.

    engine thread   schedule N+1, prepare N+1 ─submit─▶ wait N, update N, advance N+1, return N's outputs
    device thread   ────────── run N ──────────┘ run N+1 (its pending tokens: N's samples) ─────────────

Synchronously, the host work of a step (schedule, build the inputs, apply the samples, stop rules,
hand outputs over) sits between two forwards, and the device idles through it: on the H200, with
graphs, the replayed forward of a 1.5B model took 42% of the HBM roofline's time and the whole step
24% (docs/performance.md). Here the device thread runs the steps back to back, and the host work of
step N + 1 overlaps the forward of step N. Tokens are those of synchronous steps: a pending token never
reaches a block hash, a prefill or a sampler that reads history (scheduler.advance). The price is one
row per request per finish thrown away (a request whose EOS arrives in step N was scheduled in N + 1
already). Step N + 1 is scheduled just in time: when N is predicted to end within the time scheduling
takes (`wait_until_due`), and after a step with a prefill ends, so requests arriving during N make N + 1.

A step that may hold a prefill chunk is scheduled only after the running one ends. A server adds the
requests that arrived during step N just before step N + 1 is scheduled (`EngineCore.before_schedule`);
added between `step()` calls they waited for the step already running.
Off by default ("auto" is off): measured on CPU only, where it needs a CPU the compute threads leave free
(docs/performance.md); "on" turns it on.

Steps overlap only while no request's sampling reads its own tokens on the host (penalties, min_tokens,
a grammar: `overlappable`), and never with speculation. Otherwise the engine drains the running step and
steps synchronously, still on the device thread. The sampler's per-request state (seeds' generators)
belongs to the device thread: a finished request's is dropped there, after the step that may still
sample a row of it.

Every step runs on the device thread, overlapped or not, so one thread owns the compute threads'
OpenMP team: two live teams on a small CPU made each parallel region wake a sleeping worker (the
server's 52 vs 45 ms decode step, docs/performance.md "One OpenMP team in the server"). The thread
that built the engine gives its team back once the device thread exists (`release_openmp_team`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from tokenmill.engine.interfaces import RunnerOutput, SchedulerOutput
from tokenmill.engine.model_input import MAX_DECODE_QUERY
from tokenmill.engine.request import Request

log = logging.getLogger(__name__)

T = TypeVar("T")


def async_scheduling_enabled(mode: str, speculative: bool) -> bool:
    """`auto` is off for now, on every device: measured on CPU only, where it pays only with a CPU the
    compute threads leave free (docs/performance.md); "on" turns it on, except with speculation."""
    return mode == "on" and not speculative


def overlappable(request: Request) -> bool:
    """A request whose next step may be built before its last token is known on the host: its sampling
    does not read its own tokens (penalties, min_tokens' count, a grammar's state, bad words do). Seeds,
    logprobs, prompt logprobs, logit bias and allowed token ids are fine: their state lives on the device
    thread or is static."""
    p = request.params
    return not (p.uses_penalties or p.min_tokens or p.structured is not None or p.bad_words_token_ids)


# Scheduling of step N + 1 starts this long, plus twice the recent time it took, before step N is
# predicted to end: late enough that requests arriving during step N make step N + 1 (scheduled at N's
# start, they waited for N + 1 too), early enough that N + 1 is submitted before N ends.
LEAD_MARGIN_S = 0.0005


@dataclass(slots=True)
class InFlight:
    scheduled: SchedulerOutput
    # The runner's output and the step's seconds on the device thread.
    result: Future[tuple[RunnerOutput, float]] = field(default_factory=Future)
    started: float | None = None  # when the device thread began it (monotonic)
    host_s: float = 0.0  # the engine thread's time scheduling and preparing it

    @property
    def is_long(self) -> bool:
        """A step with a prefill chunk (beyond the decode group's rows): the next one is scheduled after it
        ends. Scheduled at its start, the next step would miss every request arriving meanwhile, which then
        waited for that step too: with a batch job's 2,048-token prefill steps, a chat's first token came
        2.3-2.7x later at P99 (docs/performance.md); the host work such a step could hide is ~1% of it."""
        return any(s.num_new_tokens > MAX_DECODE_QUERY for s in self.scheduled.scheduled)


class StepPipeline:
    """The device thread and the step running on it (at most one)."""

    def __init__(self, num_threads: int) -> None:
        # A new thread starts with OpenMP's default team size, not the one torch was given.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-device",
                                            initializer=torch.set_num_threads, initargs=(num_threads,))
        self.in_flight: InFlight | None = None
        self.scheduling_s = 0.0  # recent time from scheduling a step to submitting it (decayed mean)

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        return self._executor.submit(fn, *args)

    def call(self, fn: Callable[..., T], *args: object) -> T:
        return self._executor.submit(fn, *args).result()

    def launch(self, scheduled: SchedulerOutput, fn: Callable[..., RunnerOutput], *args: object) -> None:
        """Submit a step; it becomes `in_flight` (the caller took the previous one)."""
        in_flight = InFlight(scheduled)

        def run() -> tuple[RunnerOutput, float]:
            in_flight.started = started = time.monotonic()
            value = fn(*args)
            return value, time.monotonic() - started

        in_flight.result = self._executor.submit(run)
        self.in_flight = in_flight

    def wait_until_due(self, predicted_s: float | None) -> None:
        """Until the running step is predicted to end within the time scheduling takes (or it ends)."""
        in_flight = self.in_flight
        if in_flight is None or in_flight.started is None or predicted_s is None:
            return
        delay = in_flight.started + predicted_s - 2 * self.scheduling_s - LEAD_MARGIN_S - time.monotonic()
        if delay > 0:
            wait([in_flight.result], timeout=delay)

    def note_scheduling(self, seconds: float) -> None:
        self.scheduling_s = 0.8 * self.scheduling_s + 0.2 * seconds

    def take(self) -> InFlight | None:
        in_flight, self.in_flight = self.in_flight, None
        return in_flight


def release_openmp_team() -> None:
    """Free the calling thread's idle OpenMP teams (libgomp keeps one per thread that ran a parallel
    region, until the thread exits). Every libgomp loaded: wheels bundle their own copies (torch's, and
    e.g. sentencepiece's). Best effort: a runtime without OpenMP 5.0's pause keeps its team."""
    for path in _loaded_libgomps():
        try:
            pause = ctypes.CDLL(path, mode=os.RTLD_NOLOAD).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        if pause(1) != 0:  # omp_pause_soft
            log.debug("omp_pause_resource_all failed in %s: the thread keeps its OpenMP team", path)


def _loaded_libgomps() -> list[str]:
    """The OpenMP runtimes mapped into this process."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "libgomp" in os.path.basename(path) and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths
