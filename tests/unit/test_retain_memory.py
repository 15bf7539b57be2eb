"""platform.retain_freed_memory: a step's large buffers reuse freed pages instead of faulting in new ones.

Run in subprocesses: mallopt is process-wide, and the test process's own allocator stays as it is."""

from __future__ import annotations

import subprocess
import sys

import pytest

# The engine thread's pattern (not the main thread): a 1,760-token Qwen2.5-Coder-0.5B prefill step's
# activations, the gate/up output 68 MB of them, allocated and freed every step.
CHILD = r"""
import resource, sys, threading, torch
from tokenmill.platform import retain_freed_memory
if sys.argv[1] == "1":
    assert retain_freed_memory()
faults = []
def work():
    for step in range(12):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.ones(1760, 896)
        buffers = [torch.empty(1760, n).fill_(1.0) for n in (9728, 4864, 896)]
        del x, buffers
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
thread = threading.Thread(target=work)
thread.start()
thread.join()
print(*faults[-4:])
"""


def _late_step_faults(retain: bool) -> list[int]:
    out = subprocess.run([sys.executable, "-c", CHILD, "1" if retain else "0"], capture_output=True, text=True,
                         check=True, timeout=120)
    return [int(v) for v in out.stdout.split()[-4:]]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_step_buffers_are_reused_without_page_faults() -> None:
    gate_up_pages = 1760 * 9728 * 4 // 4096
    # glibc's default: every large buffer a fresh mmap, faulted in page by page on every step.
    assert min(_late_step_faults(retain=False)) > gate_up_pages
    # Retained: after a few steps the heap holds a step's buffers and they are reused as they are.
    assert sum(_late_step_faults(retain=True)) < gate_up_pages // 20
