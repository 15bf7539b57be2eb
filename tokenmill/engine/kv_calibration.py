"""The int8 KV cache's smoothing, fitted once at load (layers/kv_smoothing.py; docs/quantization.md).

A fixed calibration text (kv_calibration.txt: prose, a dialogue, letters, code in a few languages
with docstrings, JSON; written for this and disjoint from the eval corpora, which are Python stdlib
docstrings and code) runs as one prefill through the model into a temporary float32 cache, cut into
sequences of CALIBRATION_SEQ_LEN tokens from position 0 each; each layer's keys (after RoPE, as the
cache stores them) and values are read back from it and give that layer's μ, σ and ν, τ per (kv
head, channel). The fit is then attached to every int8 layer cache before it holds a token, and the
native decoder stack rebinds to pick it up.

Why sequences and not one long one: a key channel pair whose RoPE frequency turns it slowly carries
its bias at an angle that depends on the position, so μ and σ describe the positions they were
fitted on. Short sequences fit the early positions every request has; at positions far beyond them
a slowly turning biased channel drifts from μ by up to twice its bias, which widens that row's int8
scale back towards what unsmoothed int8 would use: the loss grows towards the unsmoothed cache's
(not measured at long context). Values are not rotated, so ν and τ carry no such caveat.

The fit is cached on disk, so only a model's first start pays for the prefill (Qwen2.5-Coder-0.5B:
~20-40 s on 2 shared Zen 3 cores; SmolLM2-135M ~17 s):

    $TOKENMILL_HOME/kv_smoothing/<model stem>-<key hash>.pt     μ, σ (and ν, τ) per layer, float32

    key = the model files' identity (name, size, mtime, inode), the dtype and quantization mode, the
          calibration text's hash, CALIBRATION_TOKENS and the sequence length, keys only or both,
          FIT_VERSION

A file that cannot be read or does not fit the model is ignored (and rewritten); entries whose model
file is gone are deleted when another is written; `TOKENMILL_KV_SMOOTHING_CACHE=0` turns the cache off.

Not fitted: caches that are not int8, models with an attention logit softcap (the shift q · μ is not
softmax-invariant under cap · tanh(s / cap)), and `TOKENMILL_KV_SMOOTHING=0` (int8 as before, for
A/B measurements; `keys`: keys only).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import torch

from tokenmill.engine.interfaces import ScheduledRequest
from tokenmill.engine.model_input import build_model_input
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.layers.kv_cache import Int8KVCache, kv_cache_spec
from tokenmill.layers.kv_smoothing import ChannelSmoothing, KVSmoothing, fit_smoothing
from tokenmill.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

SMOOTHING_ENV = "TOKENMILL_KV_SMOOTHING"
CACHE_ENV = "TOKENMILL_KV_SMOOTHING_CACHE"
FIT_VERSION = 1  # bump when the fit's math or the calibration prefill changes
# The calibration prefill: at most CALIBRATION_TOKENS tokens of the text (~2,250 in Qwen2.5's tokenizer),
# which bounds load time and the temporary cache (Qwen2.5-Coder-1.5B: ~56 KiB of fp32 keys and values
# per token), in sequences of CALIBRATION_SEQ_LEN.
CALIBRATION_TOKENS = 2560
CALIBRATION_SEQ_LEN = 512


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


def calibration_sequences(token_ids: list[int], seq_len: int = CALIBRATION_SEQ_LEN) -> list[list[int]]:
    """`token_ids` cut into sequences of `seq_len` tokens (the last one may be shorter)."""
    return [token_ids[i:i + seq_len] for i in range(0, len(token_ids), seq_len)]


@torch.inference_mode()
def calibration_kv(model: LlamaForCausalLM, sequences: list[list[int]],
                   block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys and values [N, KVH, hd] (float32, keys after RoPE; N the tokens of all
    sequences, in order) for `sequences` run as one prefill, each from position 0, into a temporary
    float32 cache and read back from it."""
    arch, device = model.arch, model.device
    scheduled, slots, first = [], [], 0
    for i, ids in enumerate(sequences):
        n, num_blocks = len(ids), -(-len(ids) // block_size)
        request = Request(f"kv-calibration-{i}", list(ids), SamplingParams(max_tokens=1))
        scheduled.append(ScheduledRequest(request, 0, n, list(range(first, first + num_blocks))))
        slots.append(torch.arange(first * block_size, first * block_size + n))  # its blocks are consecutive
        first += num_blocks
    spec = kv_cache_spec("fp32", torch.float32)
    caches = [spec.allocate(first, block_size, arch.num_kv_heads, arch.head_dim, device)
              for _ in range(arch.num_layers)]
    inp = build_model_input(scheduled, block_size, arch.sliding_window, device)
    model(inp.input_ids, inp.positions, caches, inp.meta)
    index = torch.cat(slots).to(device)
    shape = (-1, arch.num_kv_heads, arch.head_dim)
    return [(cache.k.view(shape).index_select(0, index), cache.v.view(shape).index_select(0, index))
            for cache in caches]


def calibrate_kv_smoothing(runner: ModelRunner, sequences: list[list[int]], values: bool = True) -> list[KVSmoothing]:
    """Fit each layer's smoothing (keys, and values unless `values` is False) on the calibration
    `sequences` and attach it to the runner's int8 caches. Call before the caches hold any token a
    request will read."""
    if not any(sequences):
        raise ValueError("KV smoothing needs calibration tokens")
    rows = calibration_kv(runner.model, [s for s in sequences if s], runner.block_size)
    heads = runner.arch.num_heads
    fits = [KVSmoothing(fit_smoothing(k, heads), fit_smoothing(v, heads) if values else None) for k, v in rows]
    return _attach(runner, fits)


def fit_kv_smoothing(runner: ModelRunner, encode: Callable[[str], list[int]], max_tokens: int,
                     cache_key: dict[str, object] | None = None) -> bool:
    """At load: smooth the int8 cache's keys and values from the calibration text (`encode`: the model's
    tokenizer). False, with the reason logged, where smoothing does not apply. `cache_key`: what
    identifies the model and its numerics (`model_cache_key`); None: no disk cache."""
    why = smoothing_skipped(runner)
    if why is not None:
        if why != "not an int8 cache":
            log.info("KV cache: int8 keys and values not smoothed: %s", why)
        return False
    started = time.monotonic()
    values = os.environ.get(SMOOTHING_ENV, "").strip() != "keys"
    text = calibration_text()
    token_ids = encode(text)[:CALIBRATION_TOKENS]
    seq_len = min(CALIBRATION_SEQ_LEN, max_tokens)
    path = None
    if cache_key is not None and os.environ.get(CACHE_ENV, "1").strip() != "0":
        key = {**cache_key, "text": hashlib.sha256(text.encode()).hexdigest(), "tokens": len(token_ids),
               "seq_len": seq_len, "values": values, "version": FIT_VERSION}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        path = _cache_dir() / f"{Path(str(cache_key.get('model', 'model'))).stem}-{digest}.pt"
        fits = _read_fits(path, runner, values)
        if fits is not None:
            _attach(runner, fits)
            log.info("KV cache: int8 %s smoothed per channel (fit read from %s)",
                     "keys and values" if values else "keys", path)
            return True
    sequences = calibration_sequences(token_ids, seq_len)
    fits = calibrate_kv_smoothing(runner, sequences, values)
    if path is not None and cache_key is not None:
        _write_fits(path, fits, str(cache_key.get("model", "")))
    log.info("KV cache: int8 %s smoothed per channel (mean and spread from %d calibration tokens in %d "
             "sequences, %.1f s)", "keys and values" if values else "keys", len(token_ids), len(sequences),
             time.monotonic() - started)
    return True


def model_cache_key(path: Path, dtype: str, quantization: str) -> dict[str, object]:
    """The identity of a model's files (a GGUF file, or a directory's *.safetensors) and its numerics."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    stamps = [[f.name, f.stat().st_size, f.stat().st_mtime_ns, f.stat().st_ino] for f in files]
    return {"model": str(path), "files": stamps, "dtype": dtype, "quantization": quantization}


def _cache_dir() -> Path:
    from tokenmill.models.pull import tokenmill_home

    return tokenmill_home() / "kv_smoothing"


def _attach(runner: ModelRunner, fits: list[KVSmoothing]) -> list[KVSmoothing]:
    """Give each int8 layer cache its fit, on the cache's device (fits are fitted on the CPU); the fits as
    attached."""
    attached = [fit.to(cache.k.device) for cache, fit in zip(runner.kv_caches, fits, strict=True)]
    for cache, fit in zip(runner.kv_caches, attached, strict=True):
        if isinstance(cache, Int8KVCache):
            cache.smoothing = fit
    if runner.model.native_stack is not None:
        runner.model.native_stack.unbind()
    return attached


def _write_fits(path: Path, fits: list[KVSmoothing], model: str) -> None:
    """Write the fit (and the model's path: entries whose model is gone are deleted on the next write)."""
    tensors: dict[str, torch.Tensor | str] = {"model": model}
    for i, fit in enumerate(fits):
        for part, sm in (("keys", fit.keys), ("values", fit.values)):
            if sm is not None:
                tensors[f"{i}.{part}.shift"], tensors[f"{i}.{part}.sigma"] = sm.shift.cpu(), sm.sigma.cpu()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        torch.save(tensors, temporary)
        temporary.replace(path)  # readers never see a half-written file
    except OSError as e:
        log.warning("KV smoothing fit not cached (%s): the next start fits it again", e)
        return
    for other in path.parent.glob("*.pt"):  # entries of deleted models (tests' temporary ones, say)
        try:
            owner = torch.load(other, map_location="cpu", weights_only=True)["model"]
            gone = other != path and not Path(owner).exists()
        except Exception:  # unreadable: rewritten by its own model's next load, or stale
            gone = other != path
        if gone:
            other.unlink(missing_ok=True)


def _read_fits(path: Path, runner: ModelRunner, values: bool) -> list[KVSmoothing] | None:
    """The cached fit, or None where there is none or it does not fit this model (then it is rewritten)."""
    arch = runner.arch
    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
        fits = []
        for i in range(arch.num_layers):
            parts: list[ChannelSmoothing | None] = []
            for part in ("keys", "values") if values else ("keys",):
                shift, sigma = tensors[f"{i}.{part}.shift"], tensors[f"{i}.{part}.sigma"]
                if shift.shape != (arch.num_kv_heads, arch.head_dim) or sigma.shape != shift.shape:
                    raise ValueError(f"layer {i} {part}: shape {tuple(shift.shape)}")
                if not bool((torch.exp2(torch.round(torch.log2(sigma))) == sigma).all()):
                    raise ValueError(f"layer {i} {part}: sigma not powers of two")
                parts.append(ChannelSmoothing.from_sigma(shift, sigma, arch.num_heads))
            fits.append(KVSmoothing(parts[0], parts[1] if values else None))  # type: ignore[arg-type]
        return fits
    except FileNotFoundError:
        return None
    except Exception as e:  # a truncated or foreign file: fit again, never fail the load
        log.warning("KV smoothing cache %s unreadable (%s): fitting again", path, e)
        return None
