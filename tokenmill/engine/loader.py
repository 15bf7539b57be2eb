"""From a model name to a running EngineCore plus its tokenizer: the one place that wires them."""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

from tokenmill.config import EngineConfig
from tokenmill.engine.core import EngineCore
from tokenmill.layers.weight_arena import release_free_memory
from tokenmill.models.loading.tokenizer import Tokenizer
from tokenmill.models.loading.weights import load_checkpoint
from tokenmill.models.resolve import ModelSource, resolve_model
from tokenmill.platform import retain_freed_memory

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
    tokenizer = load_tokenizer(source)
    checkpoint = load_checkpoint(source.path, source.format)
    core = EngineCore(config, checkpoint.arch, checkpoint.tensors)
    del checkpoint  # the loader's tensors (and a repack cache's packed copies) are garbage now
    gc.collect()
    release_free_memory()
    if config.retain_freed_memory:  # before the engine thread starts: it then shares the main arena
        retain_freed_memory()
    elapsed = time.monotonic() - started
    log.info("loaded %s from %s in %.1f s", source.name, source.path, elapsed)
    return LoadedEngine(core, tokenizer, source, elapsed)


def eos_ids(loaded: LoadedEngine) -> tuple[int, ...]:
    """Every id that ends generation: the tokenizer's end-of-generation ids and the model's."""
    ids = dict.fromkeys(loaded.tokenizer.eos_token_ids)
    ids.update(dict.fromkeys(loaded.core.arch.eos_token_ids))
    return tuple(ids)
