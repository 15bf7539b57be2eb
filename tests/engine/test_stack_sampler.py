"""StackSampler: the stacks of one thread, counted, in the folded format flame-graph tools read."""

from __future__ import annotations

import re
import sys
import threading
import time

import pytest

from tokenmill.engine.stack_sampler import StackSampler


def _spin_inner(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(200))


def _spin_outer(stop: threading.Event) -> None:
    _spin_inner(stop)


def test_samples_name_the_target_threads_frames_root_first() -> None:
    stop = threading.Event()
    worker = threading.Thread(target=_spin_outer, args=(stop,))
    worker.start()
    try:
        assert worker.ident is not None
        sampler = StackSampler(worker.ident, interval_s=0.0005)
        sampler.start()
        time.sleep(0.2)
        sampler.stop()
    finally:
        stop.set()
        worker.join()
    lines = sampler.folded()
    assert sampler.num_samples > 20 and sum(int(line.rsplit(" ", 1)[1]) for line in lines) == sampler.num_samples
    spin = [line for line in lines if "_spin_inner" in line]
    assert spin and sum(int(line.rsplit(" ", 1)[1]) for line in spin) >= 0.9 * sampler.num_samples
    pattern = (r"Thread\.run \(threading\.py:\d+\);_spin_outer \((tests/engine/)?test_stack_sampler\.py:\d+\);"
               r"_spin_inner ")
    assert all(re.search(pattern, line) for line in spin)  # root first, each frame "qualname (file:line)"
    assert "test_samples_name" not in "".join(lines)  # not the sampling test's own thread
    top = sampler.top_frames(3)
    assert re.match(r"_spin_inner \((tests/engine/)?test_stack_sampler\.py:", str(top[0]["frame"]))


def test_the_sampler_ends_when_its_thread_does_and_rejects_bad_intervals() -> None:
    worker = threading.Thread(target=time.sleep, args=(0.05,))
    worker.start()
    assert worker.ident is not None
    switch_interval = sys.getswitchinterval()
    sampler = StackSampler(worker.ident, interval_s=0.001)
    sampler.start()
    assert sys.getswitchinterval() == 0.0005  # lowered while sampling
    worker.join()
    time.sleep(0.05)
    assert sampler._thread is not None and not sampler._thread.is_alive()  # it noticed and returned
    sampler.stop()
    assert sys.getswitchinterval() == switch_interval  # the GIL's hand-over interval is back
    with pytest.raises(ValueError, match="positive"):
        StackSampler(worker.ident, interval_s=0)


def _hold_the_gil_then_spin(go: threading.Event, stop: threading.Event) -> None:
    go.wait()
    sum(range(30_000_000))  # one C call that never lets go of the GIL (~0.2-0.5 s)
    while not stop.is_set():
        pass


def test_a_sample_that_comes_late_counts_every_interval_it_waited() -> None:
    """Time in a native call that holds the GIL is not lost: the first sample after it carries it."""
    go, stop = threading.Event(), threading.Event()
    worker = threading.Thread(target=_hold_the_gil_then_spin, args=(go, stop))
    worker.start()
    try:
        assert worker.ident is not None
        sampler = StackSampler(worker.ident, interval_s=0.001)
        sampler.start()
        started = time.perf_counter()
        go.set()
        time.sleep(0.01)  # returns once the worker's long call has (the GIL)
        sampler.stop()
        window = time.perf_counter() - started
    finally:
        stop.set()
        worker.join()
    assert window > 0.1  # the call held everyone out for a while
    assert sampler.num_samples >= 0.6 * window / sampler.interval_s  # counted once, a sample would be ~1%
    # ... and lands on the worker's stack (on its own line or a call it was entering: Event.is_set).
    hog = sum(n for stack, n in sampler.counts.items() if any(f[0].co_name == "_hold_the_gil_then_spin" for f in stack))
    assert hog >= 0.9 * sampler.num_samples
