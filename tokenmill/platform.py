"""What the machine we run on is good at; decides defaults such as the compute dtype."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

import torch

_FAST_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}
log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_fast_bf16() -> bool:
    """bf16 GEMMs are fast only with native bf16 instructions (AVX512-BF16 or AMX).

    Without them (e.g. AVX2-only AMD EPYC guests) oneDNN emulates bf16 and a matmul runs
    ~50x slower than float32, so float32 is the right default there.
    """
    return bool(cpu_flags() & _FAST_BF16_FLAGS)


def auto_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library (for malloc_trim, mallopt, madvise), or None where it cannot be found."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None


@functools.cache
def retain_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of handing it back (once a process).

    By default every allocation above the mmap threshold (128 KiB, adapting up to 32 MiB) is a fresh
    mmap and every free an munmap, and a thread other than the main one allocates from its own arena,
    where even smaller blocks are trimmed away: so each engine step faulted its large activations in
    page by page (a 1,760-token Qwen2.5-Coder-0.5B prefill step took 4.0 s, 3.0 s with this; measured
    on the engine thread's pattern in docs/performance.md). With one arena, no mmap for allocations
    and no trimming below 2 GiB, a step's buffers reuse the previous step's pages. Resident memory
    then stays at the peak working set, which a server reaches on its first large step anyway; the
    loader trims what loading left behind before this is set. False where this is not glibc."""
    mallopt = getattr(libc(), "mallopt", None)
    if mallopt is None:
        return False
    ok = all(mallopt(param, value) == 1 for param, value in
             ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1)))
    if not ok:
        log.warning("mallopt refused a setting: freed memory may be returned to the OS between steps")
    return ok
