"""The engine thread's Python stacks, sampled from inside the process: a flame graph of host work.

py-spy attaches from outside through ptrace, which containers usually forbid (no CAP_SYS_PTRACE);
this samples from a daemon thread instead. Every `interval_s` it reads the target thread's frame
(`sys._current_frames`) and counts the stack; `folded()` writes the counts in the format of
`py-spy record --format raw`, which flamegraph.pl, inferno and speedscope read:

    <root frame>;<frame>;...;<leaf frame> <samples>        frame = "qualname (file:line)"

(a sample that could only be taken late counts once for every interval it waited: see _run).

What it sees: Python frames only. Time inside a native call (a kernel, a torch op) is charged to the
Python line that made it, as py-spy does without --native. Each sample takes the GIL (tens of µs),
so StepProfiler samples only in its instrumented window, whose step times it does not report. The
sampler can only run when the engine thread lets go of the GIL: at a native call that releases it, or
when the interpreter's switch interval (5 ms by default) forces a hand-over. While sampling, the
switch interval is lowered to half the sampling interval, so pure-Python stretches are not missed.
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import CodeType, FrameType

Frame = tuple[CodeType, int, str]  # code, line, the module's __name__
Stack = tuple[Frame, ...]  # root first


class StackSampler:
    """Counts the stacks of one thread, sampled every `interval_s` seconds from a daemon thread."""

    def __init__(self, thread_id: int, interval_s: float = 0.001) -> None:
        if interval_s <= 0:
            raise ValueError("the sampling interval must be positive")
        self.thread_id = thread_id
        self.interval_s = interval_s
        self.counts: Counter[Stack] = Counter()
        self.num_samples = 0  # sampling intervals seen (a late sample counts every interval it waited for)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._switch_interval = sys.getswitchinterval()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the sampler is already running")
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, self.interval_s / 2))
        self._thread = threading.Thread(target=self._run, name="tokenmill-stack-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        sys.setswitchinterval(self._switch_interval)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self.thread_id)
            if frame is None:  # the thread is gone: nothing more to see
                return
            # A sample is weighed by the intervals since the last one: a native call that holds the GIL
            # keeps the sampler out until it returns, and the stack it then finds is (at the latest) the
            # line after that call's; counted once, a 1 ms GIL-holding GEMM would weigh as 1 µs of Python.
            now = time.perf_counter()
            weight = max(1, round((now - last) / self.interval_s))
            last = now
            self.counts[_stack(frame)] += weight
            self.num_samples += weight

    def folded(self) -> list[str]:
        """`frame;frame;... samples` lines, most sampled first."""
        return [f"{';'.join(_root_marker(stack) + [_frame_name(*frame) for frame in stack])} {n}"
                for stack, n in self.counts.most_common()]

    def top_frames(self, n: int = 15) -> list[dict[str, object]]:
        """The `n` frames with the most samples of their own (the leaf of the stack): where the thread was."""
        leaves: Counter[str] = Counter()
        for stack, count in self.counts.items():
            leaves[_frame_name(*stack[-1])] += count
        total = max(1, self.num_samples)
        return [{"frame": name, "samples": count, "share": count / total} for name, count in leaves.most_common(n)]

    def write(self, path: Path) -> None:
        path.write_text("".join(line + "\n" for line in self.folded()))


def _stack(frame: FrameType | None) -> Stack:
    frames: list[Frame] = []
    while frame is not None:
        frames.append((frame.f_code, frame.f_lineno or 0, frame.f_globals.get("__name__", "")))
        frame = frame.f_back
    return tuple(reversed(frames))


_GENERATOR_FLAGS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def _root_marker(stack: Stack) -> list[str]:
    """A generator caught while it is being resumed can show no caller (CPython 3.11 links it only once
    it runs): such stacks are grouped under one marker instead of passing for a thread's root."""
    return [_TRUNCATED] if stack and stack[0][0].co_flags & _GENERATOR_FLAGS else []


_TRUNCATED = "(a resumed generator: its caller was not recorded)"


def _frame_name(code: CodeType, line: int, module: str) -> str:
    return f"{code.co_qualname} ({_file_label(code.co_filename, module)}:{line})"


def _file_label(filename: str, module: str) -> str:
    """A file by its import path (tokenmill/engine/core.py, threading.py), whatever folder it is installed
    in (an editable install is on no sys.path entry); else the path as the code object has it."""
    if module and module != "__main__":
        relative = module.replace(".", "/")
        for candidate in (f"{relative}.py", f"{relative}/__init__.py"):
            if filename.endswith(f"/{candidate}"):
                return candidate
    return filename
