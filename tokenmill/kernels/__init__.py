"""Native CPU kernels, compiled on first use with torch's C++ extension builder.

What is here is the product's own hot path where PyTorch has no fitting op:
  * `cpu_kernels()` (cpu_kernels.cpp): paged decode attention reading the block cache in place, and
    a skinny GEMM (1-4 rows) that streams each weight on all threads. Built with -march=native.
  * `glue_kernels()` (glue_kernels.cpp): RMSNorm (the residual add fused in front) and in-place RoPE,
    one call each where ATen takes five or more small ops. Built with -march=native.
  * `quant_kernels()` (quant_kernels.cpp): q8/q4/q5 block-quantized linear layers with integer dot
    products. Built for the baseline ISA; each fast path (AVX2, AVX-512 VNNI, AMX) carries its own
    target attribute and is picked at run time (`quant_isa()`), so one object runs on every x86-64 CPU.
  * `stack_kernels()` (stack_kernels.cpp): a decode step's whole decoder stack in one call. It holds
    no math of its own: the other three export their entry points as C function pointers (`c_api()`,
    declared in c_api.h) and it calls them without Python in between. Built for the baseline ISA.

Each build takes about a minute once and is cached under ~/.cache/torch_extensions. The cache name
carries `isa_key()`, a hash of the CPU's instruction-set flags and the machine type: a home folder
shared between an AVX-512 host and an AVX2-only host must not hand the first's -march=native object
to the second (it would die with SIGILL). Where a module cannot build, callers fall back to the
pure-PyTorch path and a single warning says why.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

# Backend names, here (no torch import) so the CLI can offer them without loading torch.
GEMM_BACKENDS: tuple[str, ...] = ("auto", "aten", "onednn")  # see layers/linear.py
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "sdpa", "native", "triton")  # see layers/attention.py
QUANTIZATIONS: tuple[str, ...] = ("auto", "none", "q8", "q4", "q5")  # see layers/linear.py
# "auto": a GGUF's own 4/8-bit blocks run natively. It passes the release gate against the
# dequantized reference path (`tokenmill eval compare --gates quant`: top-1 agreement >= 0.99 and
# perplexity within 1% of "none" on SmolLM2-135M and Qwen2.5-Coder-0.5B, docs/quantization.md) since
# the kernels round activations in two passes. Parity tests against transformers pin "none".
DEFAULT_QUANTIZATION = "auto"
# The quant kernel's code paths, in the order cpu_isas() numbers them (quant_kernels.cpp).
QUANT_ISAS: tuple[str, ...] = ("portable", "avx2", "avx512vnni", "amx")
QUANT_ISA_ENV = "TOKENMILL_QUANT_ISA"

_KERNEL_DIR = Path(__file__).parent
_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}
# /proc/cpuinfo flags that change what -march=native emits or what the kernels may run.
_ISA_FLAG_PREFIXES = ("sse", "ssse3", "avx", "fma", "f16c", "bmi", "amx", "vnni", "popcnt", "movbe", "sha", "vaes",
                      "vpclmulqdq", "gfni", "adx", "lzcnt", "abm", "asimd", "sve", "fp16", "bf16")


def triton_available() -> bool:
    """Whether the Triton kernels (triton_attention.py, triton_glue.py) can be imported."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The instruction-set flags of this CPU (x86 `flags`, Arm `Features`), from /proc/cpuinfo."""
    if cpuinfo is None:
        cpuinfo = _read_cpuinfo()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(flag for flag in value.split() if flag.startswith(_ISA_FLAG_PREFIXES))
    return frozenset()


def cpu_vendor_family(cpuinfo: str | None = None) -> tuple[str, int]:
    """(vendor_id, cpu family) of an x86 CPU from /proc/cpuinfo, e.g. ("AuthenticAMD", 26) for Zen 5;
    ("", 0) elsewhere. Kernel choices that differ by microarchitecture, not by flag, key on it."""
    if cpuinfo is None:
        cpuinfo = _read_cpuinfo()
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if not line.strip() and fields:
            break  # the first processor's block is enough
        if sep:
            fields.setdefault(key.strip(), value.strip())
    family = fields.get("cpu family", "")
    return fields.get("vendor_id", ""), int(family) if family.isdigit() else 0


def isa_key(flags: frozenset[str] | None = None, machine: str | None = None) -> str:
    """A short hash naming the instruction set a native build was compiled for."""
    flags = cpu_flags() if flags is None else flags
    text = (machine or platform.machine()) + ":" + " ".join(sorted(flags))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# The headers beside the sources (c_api.h: the C entry points the modules hand each other; quant_vnni.h
# and quant_amx.h: the quant kernel's AVX-512 VNNI and AMX tiles; attention_avx512.h and prefill_avx512.h:
# the AVX-512 decode tiles and prefill flash attention), copied beside each source, hashed into its build name.
_HEADERS = ("attention_avx512.h", "c_api.h", "prefill_avx512.h", "quant_amx.h", "quant_vnni.h")


def _build_name(stem: str, source: Path) -> str:
    # The source hash is in the name too: torch's own versioning keeps one build per name, so two
    # checkouts with different sources sharing a cache would otherwise rebuild each other forever.
    # The shared header is hashed in: a changed signature must rebuild every module that exports it.
    hasher = hashlib.sha256(source.read_bytes())
    for header in _HEADERS:
        hasher.update((source.parent / header).read_bytes())
    return f"{stem}_{isa_key()}_{hasher.hexdigest()[:8]}"


# module key → (build stem, source file, compiler flags): what each accessor below builds.
_MODULES: dict[str, tuple[str, str, list[str]]] = {
    # -march=native: the cache is keyed by this CPU's ISA, and AVX2/FMA roughly doubles the dot
    # products. -fopenmp: at::parallel_for is an OpenMP region compiled into this module; it binds
    # to the libgomp torch already loaded (same soname), so torch.set_num_threads holds.
    "module": ("tokenmill_cpu_kernels", "cpu_kernels.cpp", ["-O3", "-march=native", "-fopenmp"]),
    "glue": ("tokenmill_glue_kernels", "glue_kernels.cpp", ["-O3", "-march=native", "-fopenmp"]),
    # -ffp-contract=off: the activation rounding's multiply-then-subtract must not fuse into an FMA on
    # one path and not another, so every path (and the tests' torch model) rounds identically.
    "quant": ("tokenmill_quant_kernels", "quant_kernels.cpp", ["-O3", "-fopenmp", "-ffp-contract=off"]),
    # Orchestration only: the math is in the other modules, reached through their C entry points.
    "stack": ("tokenmill_stack_kernels", "stack_kernels.cpp", ["-O2"]),
}


def build_variant(key: str, source_dir: Path, tag: str) -> ModuleType | None:
    """Module `key` ("module", "glue", "quant" or "stack") built from another copy of the kernel sources
    (`source_dir` holds the .cpp and the shared headers), under its own cached name: benchmarks
    load two builds in one process to A/B them (benchmarks/kernel_ab.py)."""
    stem, source_name, cflags = _MODULES[key]
    return _build(f"{stem}_{tag}", source_dir / source_name, cflags, f"{source_name} ({tag})", "nothing")


def cpu_kernels() -> ModuleType | None:
    """The compiled module, or None when this machine cannot build it (the reason is logged once)."""
    return _module("module", "native CPU kernels", "the PyTorch paths")


def glue_kernels() -> ModuleType | None:
    """RMSNorm (with the residual add fused) and RoPE as one native call each, or None (logged once)."""
    return _module("glue", "native norm/RoPE kernels", "the PyTorch ops")


def quant_kernels() -> ModuleType | None:
    """The quantized-linear module, or None when it cannot build (logged once)."""
    return _module("quant", "native quantized kernels", "dequantized weights")


def stack_kernels() -> ModuleType | None:
    """The one-call decoder stack for decode steps (stack_kernels.cpp), or None (logged once)."""
    return _module("stack", "the native decoder stack", "the Python layers")


def _module(key: str, what: str, fallback: str) -> ModuleType | None:
    with _lock:
        if key not in _state:
            stem, source_name, cflags = _MODULES[key]
            _state[key] = _build(stem, _KERNEL_DIR / source_name, cflags, what, fallback)
        return _state[key]


def _build(stem: str, source: Path, cflags: list[str], what: str, fallback: str) -> ModuleType | None:
    log.info("loading %s (the first build on a machine takes about a minute on 2 cores)", what)
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        name = _build_name(stem, source)
        build_dir = Path(_get_build_directory(name, verbose=False))
        with _build_lock(build_dir):
            stable_source = _stable_source(source, build_dir)
            return load(name=name, sources=[str(stable_source)], extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                        build_directory=str(build_dir), verbose=False)
    except Exception as exc:  # no compiler, no ninja, a read-only cache: all mean "use the fallback"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("%s unavailable, using %s: %s", what, fallback, first_line)
        return None


def _stable_source(source: Path, build_dir: Path) -> Path:
    """The source copied into its build folder, and built from there.

    torch rebuilds whenever the source *path* in its build arguments changes, so two checkouts (a CI
    clone, a worktree) sharing one cache would rebuild each other's identical module every time they
    alternate. The build name carries the source hash, so the copy under it never changes."""
    build_dir.mkdir(parents=True, exist_ok=True)
    for name in (*_HEADERS, source.name):  # the headers beside it: `#include "c_api.h"` finds them there
        copy, data = build_dir / name, (source.parent / name).read_bytes()
        if not copy.is_file() or copy.read_bytes() != data:
            tmp = copy.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(data)
            os.replace(tmp, copy)
    return build_dir / source.name


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Serialise tokenmill's builds of one module with a lock the kernel drops when its holder dies.

    torch's own lock is a file that exists while a build runs; a builder killed mid-build (a test
    timeout, Ctrl-C) leaves it behind and every later load waits on it forever. Holding this flock,
    no other tokenmill process is building the module, so a torch lock still present is stale."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's own lock alone
        yield
        return
    with open(build_dir.parent / f"{build_dir.name}.tokenmill-lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing a stale build lock left by a killed build: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def available_quant_isas() -> tuple[str, ...]:
    """The quant kernel paths this CPU runs (empty when the module cannot build)."""
    module = quant_kernels()
    return () if module is None else tuple(QUANT_ISAS[i] for i in module.cpu_isas())


def quant_isa() -> str:
    """The path quantized matmuls take: $TOKENMILL_QUANT_ISA when set (an error if this CPU cannot run
    it), else the fastest this CPU has."""
    from tokenmill.errors import TokenmillError

    available = available_quant_isas()
    forced = os.environ.get(QUANT_ISA_ENV, "").strip().lower()
    if forced:
        if forced not in QUANT_ISAS:
            raise TokenmillError(f"{QUANT_ISA_ENV}={forced!r} is not a quant ISA: use {', '.join(QUANT_ISAS)}")
        if forced not in available:
            raise TokenmillError(f"{QUANT_ISA_ENV}={forced}: this CPU runs only {', '.join(available) or 'none'}")
        return forced
    if not available:
        raise TokenmillError("native quantized kernels are unavailable on this machine: use --quantization none")
    return available[-1]
