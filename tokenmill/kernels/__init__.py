"""Native CPU kernels, compiled on first use with torch's C++ extension builder.

What is here is the product's own hot path where PyTorch has no fitting op: paged decode attention
reading the block cache in place, and a skinny GEMM (1-4 rows) that streams each weight on all
threads. The build needs a C++ compiler and ninja; it takes about a
minute once and is cached under ~/.cache/torch_extensions (keyed by the source's hash). Where it
cannot build, callers fall back to the pure-PyTorch path and a single warning says why.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

# Backend names, here (no torch import) so the CLI can offer them without loading torch.
GEMM_BACKENDS: tuple[str, ...] = ("auto", "aten", "onednn")  # see layers/linear.py
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "sdpa", "native")  # see layers/attention.py

_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


def cpu_kernels() -> ModuleType | None:
    """The compiled module, or None when this machine cannot build it (the reason is logged once)."""
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


def _build() -> ModuleType | None:
    log.info("loading native CPU kernels (the first build on a machine takes about a minute on 2 cores)")
    try:
        from torch.utils.cpp_extension import load

        # -march=native: the cache lives on this machine, and AVX2/FMA roughly doubles the dot
        # products. -fopenmp: at::parallel_for is an OpenMP region compiled into this module; it
        # binds to the libgomp torch already loaded (same soname), so torch.set_num_threads holds.
        return load(name="tokenmill_cpu_kernels", sources=[str(_SOURCE)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, a read-only cache: all mean "use the fallback"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("native CPU kernels unavailable, using the PyTorch paths: %s", first_line)
        return None
