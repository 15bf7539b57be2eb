"""llama.cpp's `llama-server`: built once from the llama-cpp-python sdist, then started as a peer.

The build lives in `.cache/llama.cpp/build-<isa>/` (git-ignored). CMake flags follow
/work/shared/PEERS.md: the Intel VMs advertise AMX but a native (AMX) build dies with SIGILL on
the first matmul, so AMX is off and AVX-512 (+VNNI, BF16) is on explicitly; on a host without
AVX-512 the same flags with AVX2 instead. Where no AMX flag is listed, a native build (keyed by the
CPU's flags). `python benchmarks/llama_server.py` builds it.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

from tokenmill.kernels import cpu_flags, isa_key

ROOT = Path(__file__).resolve().parents[1]
CACHE_DIR = ROOT / ".cache" / "llama.cpp"
SDIST_VERSION = "0.3.36"
# PEERS.md's flags, for the Intel hosts (AVX-512 + VNNI + BF16, AMX advertised but unusable).
AVX512_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON",
    "-DGGML_AVX512_BF16=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
    "-DLLAMA_CURL=OFF",
)
# Hosts without AVX-512 (an AMD EPYC VM showed up here): that build dies with SIGILL at startup,
# so the same flags with AVX-512 off and AVX2/FMA/F16C/BMI2 named explicitly.
AVX2_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
    "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF", "-DLLAMA_CURL=OFF",
)
TARGETS = ("llama-server", "llama-bench")


# Where /proc/cpuinfo lists no AMX, a native build is safe and the fairest peer (PEERS.md: ~20% faster
# than the explicit flags at 16-64 concurrent on an AVX-512 VNNI Xeon). It is keyed by the same
# instruction-set hash as tokenmill's own native builds, so a VM that lands on another host never
# runs a build made for this one.
NATIVE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF")


def isa_level() -> str:
    flags = cpu_flags()
    if not any(f.startswith("amx") for f in flags):
        return f"native-{isa_key()}"
    return "avx512" if {"avx512f", "avx512_vnni", "avx512_bf16"} <= flags else "avx2"


def cmake_flags(isa: str) -> tuple[str, ...]:
    if isa.startswith("native-"):
        return NATIVE_FLAGS
    return AVX512_FLAGS if isa == "avx512" else AVX2_FLAGS


def build_dir(isa: str) -> Path:
    """One build per instruction set: a VM may land on another host between runs."""
    return CACHE_DIR / f"build-{isa}"


def server_binary(isa: str) -> Path:
    return build_dir(isa) / "bin" / "llama-server"


def ensure_built() -> Path:
    """The llama-server binary for this CPU, building it first (10-15+ minutes on 2 cores) when missing."""
    isa = isa_level()
    if not server_binary(isa).is_file():
        source = _unpacked_source()
        _run(["cmake", "-S", str(source), "-B", str(build_dir(isa)), "-G", "Ninja", *cmake_flags(isa)])
        # nice 19 and two jobs: the machine is shared, and a build must never starve a benchmark.
        _run(["nice", "-n", "19", "cmake", "--build", str(build_dir(isa)), "-j2", "--target", *TARGETS])
    return server_binary(isa)


def server_argv(binary: Path, gguf: Path, port: int, alias: str, slots: int, ctx_per_slot: int,
                threads: int) -> list[str]:
    """PEERS.md's command: continuous batching over `slots` parallel slots sharing one KV cache of
    slots × ctx_per_slot tokens, pinned threads, the GGUF's own chat template (--jinja, as tokenmill)."""
    return [str(binary), "-m", str(gguf), "-np", str(slots), "-c", str(slots * ctx_per_slot), "-cb",
            "-t", str(threads), "-tb", str(threads), "--host", "127.0.0.1", "--port", str(port), "-a", alias,
            "--jinja"]


def _unpacked_source() -> Path:
    source = CACHE_DIR / f"llama_cpp_python-{SDIST_VERSION}" / "vendor" / "llama.cpp"
    if source.is_dir():
        return source
    sdist_dir = CACHE_DIR / "sdist"
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
          f"llama-cpp-python=={SDIST_VERSION}", "-d", str(sdist_dir)])
    archive = next(sdist_dir.glob(f"llama_cpp_python-{SDIST_VERSION}.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(CACHE_DIR, filter="data")
    if not source.is_dir():
        raise SystemExit(f"{archive.name} has no vendor/llama.cpp: pick another llama-cpp-python version")
    return source


def _run(argv: list[str]) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True)


if __name__ == "__main__":
    print(ensure_built())
