"""One frozen dataclass per subsystem; each validates itself on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.errors import TokenmillError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise TokenmillError(message)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str
    dtype: str = "auto"  # "auto": bfloat16 (AMX on CPU, tensor cores on GPU); float32 for parity
    device: str = "auto"  # "auto": cuda when available, else cpu
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0

    def __post_init__(self) -> None:
        _require(self.dtype == "auto" or self.dtype in _DTYPES,
                 f"dtype '{self.dtype}' is not supported: use auto, {', '.join(_DTYPES)}")
        _require(self.max_model_len is None or self.max_model_len > 0, "max_model_len must be positive")

    def torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype == "auto" else _DTYPES[self.dtype]

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    # KV budget: an explicit block count wins; else bytes; else a fraction of free memory.
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    memory_fraction: float = 0.25
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
                 "block_size must be a power of two")
        _require(self.num_blocks is None or self.num_blocks > 0, "num_blocks must be positive")
        _require(0.0 < self.memory_fraction <= 0.95, "memory_fraction must be in (0, 0.95]")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one engine step
    max_num_seqs: int = 64
    policy: str = "fcfs"  # "fcfs" or "priority"
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        _require(self.max_num_batched_tokens > 0, "max_num_batched_tokens must be positive")
        _require(self.max_num_seqs > 0, "max_num_seqs must be positive")
        _require(self.policy in ("fcfs", "priority"), "policy must be 'fcfs' or 'priority'")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = None  # None: torch's default (all cores)
