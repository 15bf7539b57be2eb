"""From a model name to a running EngineCore plus its tokenizer: the one place that wires them."""

from __future__ import annotations

import gc
import logging
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.kv_calibration import fit_kv_smoothing, model_cache_key
from tokenmill.layers.weight_arena import release_free_memory
from tokenmill.models.loading.tokenizer import Tokenizer
from tokenmill.models.loading.weights import load_checkpoint
from tokenmill.models.resolve import ModelSource, resolve_model
from tokenmill.platform import auto_dtype, retain_freed_memory

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedEngine:
    core: EngineCore
    tokenizer: Tokenizer
    source: ModelSource
    load_time_s: float


def load_tokenizer(source: ModelSource) -> Tokenizer:
    return Tokenizer.from_gguf(source.path) if source.format == "gguf" else Tokenizer.from_hf_dir(source.path)


def load_engine(config: EngineConfig) -> LoadedEngine:
    started = time.monotonic()
    source = resolve_model(config.model.model)
    config = resolve_compute_dtype(config, source.format)
    tokenizer = load_tokenizer(source)
    checkpoint = load_checkpoint(source.path, source.format)
    core = EngineCore(config, checkpoint.arch, checkpoint.tensors)
    del checkpoint  # the loader's tensors (and a repack cache's packed copies) are garbage now
    gc.collect()
    # int8 KV cache: keys smoothed per channel, fitted on a calibration prefill (engine/kv_calibration.py);
    # before the release below, which returns its temporary cache too.
    fit_kv_smoothing(core.runner, tokenizer.encode, core.max_model_len,
                     model_cache_key(source.path, config.model.dtype, config.model.quantization))
    release_free_memory()
    if config.retain_freed_memory:  # before the engine thread starts: it then shares the main arena
        retain_freed_memory()
    elapsed = time.monotonic() - started
    log.info("loaded %s from %s in %.1f s; %s", source.name, source.path, elapsed,
             weights_summary(core.runner.model, source.path))
    return LoadedEngine(core, tokenizer, source, elapsed)


def weights_summary(model: Any, path: Path) -> str:
    """One line for the load log: the linear layers' bytes a step against the checkpoint's size, and how many
    layers run each method (e.g. "q4 x 81, q6+q4 x 28"): what `auto` made of the file's types."""
    linears = model.linears() if hasattr(model, "linears") else {}
    if not linears:
        return "no linear-layer summary for this model"
    methods = Counter(linear.method for linear in linears.values())
    gigabytes = model.weight_bytes() / 1e9
    file_gb = path.stat().st_size / 1e9 if path.is_file() else 0.0
    against = f" ({gigabytes / file_gb:.2f}x the {file_gb:.2f} GB file)" if file_gb else ""
    layers = ", ".join(f"{method} x {count}" for method, count in methods.most_common())
    return f"linear weights {gigabytes:.2f} GB{against}: {layers}"


def freeze_loaded_heap() -> int:
    """Move every object alive now into the collector's permanent generation (gc.freeze); returns
    how many were frozen. For a process that keeps one engine for its life (`tokenmill serve` calls it
    once its engine has loaded; a Ray Serve replica would qualify too but does not call it yet): the
    ~190,000 container objects a load leaves (tokenizer tables, modules, config) were otherwise walked
    by every full collection, which the garbage of decode steps triggers every few seconds: ~2-3% of a
    batch-16 step on a 2-core Zen 5 (docs/performance.md). Not for the in-process API, where a process
    may load several engines one after another and a frozen one's cycles would never be freed."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def resolve_compute_dtype(config: EngineConfig, source_format: str) -> EngineConfig:
    """`dtype=auto` on a CPU whose auto dtype is bfloat16, for a GGUF under native quantized kernels:
    float32 activations and (kv_cache_dtype auto) a float32 KV cache.

    The quantized kernels take and return float32 (a bf16 model converts in and out of every matrix),
    and the native decoder stack (a decode step in one call) runs only float32 models: on a Zen 4
    host, bf16 served Qwen2.5-Coder-0.5B at 0.65x of float32 at batch 1 and 0.89x at 4 and 16
    (docs/performance.md). The KV cache follows: a bf16 cache moved Qwen2.5-Coder-0.5B's next-token
    top-1 agreement with the float32 reference to 0.896 (fp16: 0.987, fp32: 0.992; the release gate
    is 0.99): its keys carry large per-channel biases, and an 8-bit mantissa rounds away the small
    differences between keys that decide the attention weights (docs/quantization.md)."""
    from tokenmill.kernels import quant_kernels

    model = config.model
    device = model.torch_device()
    if (model.dtype != "auto" or device.type != "cpu" or source_format != "gguf" or model.quantization == "none"
            or auto_dtype(device) != torch.bfloat16 or quant_kernels() is None):
        return config
    log.info("dtype auto: float32 activations and KV cache for the quantized kernels")
    return replace(config, model=replace(model, dtype="float32"))


def eos_ids(loaded: LoadedEngine) -> tuple[int, ...]:
    """Every id that ends generation: the tokenizer's end-of-generation ids and the model's."""
    ids = dict.fromkeys(loaded.tokenizer.eos_token_ids)
    ids.update(dict.fromkeys(loaded.core.arch.eos_token_ids))
    return tuple(ids)
