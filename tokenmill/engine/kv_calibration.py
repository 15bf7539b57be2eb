"""The int8 KV cache's key smoothing, fitted once at load (layers/kv_smoothing.py; docs/quantization.md).

A fixed calibration text (kv_calibration.txt: prose, a dialogue, letters, code in a few languages,
JSON; written for this and disjoint from the eval corpora, which are Python stdlib docstrings and
code) runs as one prefill through the model into a temporary float32 cache; each layer's keys are
read back from it (after RoPE, as the cache stores them) and give that layer's μ and σ per (kv head,
channel). The fit is then attached to every int8 layer cache before it holds a token, and the
native decoder stack rebinds to pick it up.

Not fitted: caches that are not int8, models with an attention logit softcap (the shift q · μ is not
softmax-invariant under cap · tanh(s / cap)), and `TOKENMILL_KV_SMOOTHING=0` (int8 as before, for
A/B measurements).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from importlib import resources

import torch

from tokenmill.engine.interfaces import ScheduledRequest
from tokenmill.engine.model_input import build_model_input
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.layers.kv_cache import Int8KVCache, kv_cache_spec
from tokenmill.layers.kv_smoothing import KeySmoothing, fit_key_smoothing
from tokenmill.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

SMOOTHING_ENV = "TOKENMILL_KV_SMOOTHING"
# The calibration prefill's length: the whole text is ~1,300-1,500 tokens in the catalog's tokenizers;
# the prefix taken keeps load time and the temporary cache small (Qwen2.5-Coder-1.5B: ~56 KiB of fp32
# keys and values per token).
CALIBRATION_TOKENS = 1024


def calibration_text() -> str:
    return resources.files("tokenmill.engine").joinpath("kv_calibration.txt").read_text(encoding="utf-8")


def smoothing_skipped(runner: ModelRunner) -> str | None:
    """Why `runner`'s KV cache gets no key smoothing, or None when it does."""
    if not any(isinstance(cache, Int8KVCache) for cache in runner.kv_caches):
        return "not an int8 cache"
    if os.environ.get(SMOOTHING_ENV, "").strip() == "0":
        return f"{SMOOTHING_ENV}=0"
    if runner.model.attn.logit_softcap is not None:
        return "attention logit softcap (not shift-invariant)"
    return None


@torch.inference_mode()
def calibration_keys(model: LlamaForCausalLM, token_ids: list[int], block_size: int) -> list[torch.Tensor]:
    """Each layer's keys [N, KVH, hd] (float32, after RoPE) for `token_ids` run as one prefill from
    position 0 into a temporary float32 cache, read back from it."""
    arch, device = model.arch, model.device
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    spec = kv_cache_spec("fp32", torch.float32)
    caches = [spec.allocate(num_blocks, block_size, arch.num_kv_heads, arch.head_dim, device)
              for _ in range(arch.num_layers)]
    request = Request("kv-calibration", list(token_ids), SamplingParams(max_tokens=1))
    blocks = list(range(num_blocks))  # block b holds positions [b * bs, (b + 1) * bs): slot = position
    inp = build_model_input([ScheduledRequest(request, 0, n, blocks)], block_size, arch.sliding_window, device)
    model(inp.input_ids, inp.positions, caches, inp.meta)
    return [cache.k.view(-1, arch.num_kv_heads, arch.head_dim)[:n] for cache in caches]


def calibrate_key_smoothing(runner: ModelRunner, token_ids: list[int]) -> list[KeySmoothing]:
    """Fit each layer's smoothing on `token_ids` and attach it to the runner's int8 caches.
    Call before the caches hold any token a request will read."""
    if not token_ids:
        raise ValueError("key smoothing needs calibration tokens")
    keys = calibration_keys(runner.model, token_ids, runner.block_size)
    fits = [fit_key_smoothing(k, runner.arch.num_heads) for k in keys]
    for cache, fit in zip(runner.kv_caches, fits, strict=True):
        if isinstance(cache, Int8KVCache):
            cache.smoothing = fit
    if runner.model.native_stack is not None:
        runner.model.native_stack.unbind()
    return fits


def fit_kv_smoothing(runner: ModelRunner, encode: Callable[[str], list[int]], max_tokens: int) -> bool:
    """At load: smooth the int8 cache's keys from the calibration text (`encode`: the model's
    tokenizer). False, with the reason logged, where smoothing does not apply."""
    why = smoothing_skipped(runner)
    if why is not None:
        if why != "not an int8 cache":
            log.info("KV cache: int8 keys not smoothed: %s", why)
        return False
    started = time.monotonic()
    token_ids = encode(calibration_text())[:min(CALIBRATION_TOKENS, max_tokens)]
    calibrate_key_smoothing(runner, token_ids)
    log.info("KV cache: int8 keys smoothed per channel (mean and spread from %d calibration tokens, %.1f s)",
             len(token_ids), time.monotonic() - started)
    return True
