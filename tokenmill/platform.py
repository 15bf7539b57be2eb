"""What the machine we run on is good at; decides defaults such as the compute dtype."""

from __future__ import annotations

import functools

import torch

_FAST_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}


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
