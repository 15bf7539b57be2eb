"""Facts about the host and the tree a benchmark ran on, recorded with every result (common.py
re-exports them): versions, the CPU (model, vendor and family, the flags that pick dtype and quant
path), the commit, and the host label in result names."""

from __future__ import annotations

import datetime as _dt
import os
import platform
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "num_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "cpu": _cpu_model(), "cpu_flags": _cpu_flags(), "loadavg": os.getloadavg(),
        "cpu_vendor_family": _cpu_vendor_family(),  # "AMD EPYC" alone does not tell Zen 3, 4 and 5 apart
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
    }
    info["git"] = _git_state()
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def _git_state() -> dict[str, str | bool]:
    """The commit measured, and whether the engine's sources differed from it."""
    import subprocess

    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    import tokenmill

    return {"commit": git("rev-parse", "HEAD"), "tokenmill_dirty": bool(git("status", "--porcelain", "tokenmill")),
            "tokenmill_path": str(Path(tokenmill.__file__).parent)}


def _cpu_flags() -> list[str]:
    """The instruction sets that decide which dtype and quant path are fast here."""
    from tokenmill.kernels import cpu_flags

    return sorted({"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"} & cpu_flags())


def _cpu_vendor_family() -> tuple[str, int]:
    from tokenmill.kernels import cpu_vendor_family

    return cpu_vendor_family()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def host_label() -> str:
    """The machine kind in result names, e.g. `avx512vnni-7f21b0`: the best quant ISA and a hash of the
    CPU's instruction-set flags. Sessions land on different hosts on the same day, and a run on one
    must not overwrite another's figures (it did, three times, on 2026-12-02)."""
    from tokenmill.kernels import cpu_flags, isa_key

    flags = cpu_flags()
    isa = ("amx" if "amx_int8" in flags else "avx512vnni" if "avx512_vnni" in flags else "avx2" if "avx2" in flags
           else platform.machine())
    return f"{isa}-{isa_key()[:6]}"
