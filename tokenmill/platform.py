"""What the machine we run on is good at; decides defaults such as the compute dtype."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable
from pathlib import Path, PurePosixPath

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


# ---- CPU quota (containers) -------------------------------------------------------------------------

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def cpu_quota_cores(root: Path = _CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU time a cgroup quota grants this process, in cores (None: no quota, or not Linux).

    A container started with `--cpus 1` (Kubernetes: a CPU limit) still sees every CPU of the host in
    its affinity mask, so torch starts a thread per CPU; the threads then run until the quota is
    spent and all stop until the next period, in the middle of every parallel region's barrier
    (SmolLM2 decode under a 1-CPU quota on 2 vCPUs: 13.3 ms a step with 2 threads, 8.5 with 1).
    cgroup v2: `cpu.max` ("quota period" or "max ..."); v1: `cpu.cfs_quota_us` / `cpu.cfs_period_us`.
    The tightest limit on the cgroup's path (it and its ancestors under the mount) counts."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:  # cgroup v2, one unified hierarchy
            limits += _cgroup_limits(root, path, _v2_limit)
        elif "cpu" in controllers.split(","):
            mount = root / controllers if (root / controllers).is_dir() else root / "cpu"
            limits += _cgroup_limits(mount, path, _v1_limit)
    return min(limits) if limits else None


def _cgroup_limits(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """Limits of the cgroup at `path` under `mount` and of its ancestors. Inside a container the path
    may be the host's while the mount shows the container's own cgroup at its root: that is read too."""
    found: list[float] = []
    folder = PurePosixPath(path)
    for candidate in [folder, *folder.parents]:
        limit = read(mount / str(candidate).lstrip("/"))
        if limit is not None:
            found.append(limit)
    return found


def _v2_limit(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_limit(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def default_num_threads(quota: float | None) -> int:
    """torch's thread count (one per CPU of the affinity mask), capped by a CPU quota (`cpu_quota_cores`):
    floor(quota), at least 1."""
    threads = torch.get_num_threads()
    return threads if quota is None else max(1, min(threads, int(quota)))
