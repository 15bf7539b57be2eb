"""Quantized weights moved into one anonymous mapping backed by transparent huge pages.

A decode step streams every weight once, and with 4 KiB pages that is one TLB miss (a page walk
that itself misses the caches) per 4 KiB of weights: 28,000 of them a step for SmolLM2-135M, more
for each bigger model. Weights loaded from the repack cache are file-backed mappings, which Linux
never backs with huge pages, and torch's own allocations get them only when THP is "always". So
after load, the packed tensors of every quantized layer are copied into one mapping advised with
MADV_HUGEPAGE (2 MiB pages: 512x fewer TLB entries), which measured 8-12% off a batch-1 decode step
on a 2-core EPYC (docs/performance.md). Resident memory does not grow: the originals are dropped,
and pages of a file-backed original (the repack cache's map) are released from this process as
soon as their layer is copied (MADV_DONTNEED; the file is only ever read, so nothing is lost), so
the load's peak is the arena plus one layer, not twice the weights. Loading pays one copy.

`TOKENMILL_HUGE_PAGES=0` keeps the weights where they were loaded; so does a kernel with THP off.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from tokenmill.layers.linear_layers import Linear
from tokenmill.platform import libc

log = logging.getLogger(__name__)

HUGE_PAGES_ENV = "TOKENMILL_HUGE_PAGES"
_HUGE = 2 << 20
_ALIGN = 64  # every tensor starts on a cache line (the kernels' loads assume no split lines)
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    if os.environ.get(HUGE_PAGES_ENV, "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _THP_MODE.read_text()
    except OSError:
        return False


class WeightArena:
    """One anonymous, huge-page-advised mapping; `place` copies a tensor into the next free slot."""

    def __init__(self, nbytes: int) -> None:
        self.size = nbytes + _HUGE  # room to start on a 2 MiB boundary
        self._map = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._map.madvise(mmap.MADV_HUGEPAGE)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._offset = -self._bytes.data_ptr() % _HUGE
        self.used = 0

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        n = tensor.numel() * tensor.element_size()
        if n == 0:
            return tensor
        end = self._offset + n
        if end > self.size:
            raise ValueError(f"weight arena of {self.size} bytes is full")
        out = self._bytes[self._offset:end].view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        self._offset = end + (-end % _ALIGN)
        self.used += n
        return out

    @staticmethod
    def footprint(tensors: Iterable[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() + _ALIGN for t in tensors)


def relocate(linears: Iterable[Linear]) -> WeightArena | None:
    """Move every relocatable layer's storage into one arena (None when huge pages are off or
    there is nothing to move). The arena must live as long as the layers: the model keeps it."""
    layers = [lin for lin in linears if lin.relocatable]
    if not layers or not huge_pages_available():
        return None
    unique = {t.data_ptr(): t for lin in layers for t in lin.relocatable if t.numel()}
    arena = WeightArena(WeightArena.footprint(unique.values()))
    moved: dict[int, torch.Tensor] = {}

    def place(t: torch.Tensor) -> torch.Tensor:
        if t.numel() == 0:
            return t
        if t.data_ptr() not in moved:
            moved[t.data_ptr()] = arena.place(t)
        return moved[t.data_ptr()]

    file_ranges = _file_backed_ranges()
    for lin in layers:
        sources = list(lin.relocatable)
        lin.relocate(place)
        for t in sources:
            _release_file_pages(t, file_ranges)
    # Now, not only at the end of the load: the KV cache is allocated next, and on top of the
    # originals' unreturned heap the load's peak grows (1.5B fresh repack: 3.10 GB without this trim,
    # 2.75-2.98 GB with it).
    release_free_memory()
    log.debug("weights moved to a huge-page arena: %.0f MB", arena.used / 1e6)
    return arena


def release_free_memory() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim; after relocation, and in the
    loader once the checkpoint is gone). The originals the arena replaced were a few MB each: glibc serves such
    sizes from its heap once its mmap threshold has adapted, and keeps freed heap pages resident
    (measured: 2.9 GB resident serving the 1.5B after a fresh repack, against 1.8 GB)."""
    trim = getattr(_LIBC, "malloc_trim", None) if _LIBC is not None else None
    if trim is not None:
        trim(ctypes.c_size_t(0))


def _file_backed_ranges() -> list[tuple[int, int]]:
    """[start, end) of this process's mappings of regular files (from /proc/self/maps)."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    lo, hi = fields[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return ranges


def _release_file_pages(tensor: torch.Tensor, file_ranges: list[tuple[int, int]]) -> None:
    """Drop the whole pages of a tensor that lies in a file mapping from this process's resident set
    (they come back from the file if touched again). Anonymous memory is never touched: there
    MADV_DONTNEED would zero live data."""
    start, n = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    if n == 0 or not any(lo <= start and start + n <= hi for lo, hi in file_ranges):
        return
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, (start + n) // page * page
    if hi > lo and _LIBC is not None:
        _LIBC.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), ctypes.c_int(mmap.MADV_DONTNEED))


_LIBC = libc()
