"""Which int8 KV-cache scheme keeps a model's next-token distribution: a diagnosis, by simulation.

The model runs with a float32 KV cache whose writes are replaced by quantize-then-dequantize under
one scheme at a time (the attention math is then exactly what a cache of that scheme would give),
and each scheme's next-token top-1 agreement, KL and perplexity are measured against the plain
float32 cache on the eval's own passages (held-out prose and stdlib code, `tokenmill.eval`).
Schemes:
  int8        keys and values int8 with one scale per (token, kv head): `--kv-cache-dtype int8` today
  keys        keys only (values float32)
  values      values only (keys float32)
  layer<N>    keys of layer N only (`--layers`: one scheme per layer, to find the sensitive ones)
  smooth      keys stored as (k - mu) / sigma (per layer, kv head and channel; mu, sigma from a calibration
              pass: `--calibration engine` (default) the engine's own calibration text and sequences,
              `docstrings` passages of the bench's docstring prose, disjoint from the scored passages;
              fitted by the library's ChannelMoments as the engine does at load: sigma a power of two),
              values as int8.
              Exact if queries are multiplied by sigma: q.(k - mu) differs from q.k by q.mu, the
              same for every key of a query, so the softmax is unchanged
  smooth+v    smooth, and values stored as v - nu (nu: their calibrated mean; the attention output
              gets nu back, since the softmax weights sum to 1)
  smooth+vs   smooth, and values stored as (v - nu) / tau per channel (tau: their spread, a power of two;
              the attention output would be multiplied by tau and get nu back)

    flock /tmp/tokenmill-bench.lock python benchmarks/kv_int8_schemes.py --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from typing import Any

import common
import torch

from tokenmill.layers.kv_smoothing import ChannelMoments, ChannelSmoothing

SCHEMES = ("int8", "keys", "values", "smooth", "smooth+v", "smooth+vs")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--layers", action="store_true", help="also quantize each layer's keys alone")
    p.add_argument("--passages", type=int, default=12, help="scored passages (half prose, half code)")
    p.add_argument("--calibration", choices=("engine", "docstrings"), default="engine",
                   help="engine: the engine's own calibration text, one prefill of its first CALIBRATION_TOKENS "
                   "tokens (engine/kv_calibration.py); docstrings: passages of the bench's docstring prose")
    p.add_argument("--calibration-passages", type=int, default=8)
    p.add_argument("--calibration-len", type=int, default=None,
                   help="engine: tokens per calibration sequence (default: the engine's CALIBRATION_SEQ_LEN)")
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def fake_int8(x: torch.Tensor) -> torch.Tensor:
    """Round trip through the int8 cache's own rounding (one fp16 scale per row of the last dim)."""
    from tokenmill.layers.kv_cache import dequantize_int8, quantize_int8

    return dequantize_int8(*quantize_int8(x), torch.float32)


class Stats:
    """Per-layer statistics of the calibration pass: the keys' moments (the library's own fit,
    layers/kv_smoothing.py, as the engine's load-time calibration uses) and the values' sums."""

    def __init__(self, num_heads: int) -> None:
        self.num_heads = num_heads
        self.keys: dict[int, ChannelMoments] = {}
        self.values: dict[int, ChannelMoments] = {}  # the same moments, of the values

    def add(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keys.setdefault(layer, ChannelMoments()).add(k)
        self.values.setdefault(layer, ChannelMoments()).add(v)

    def smoothing(self, layer: int) -> tuple[ChannelSmoothing, ChannelSmoothing]:
        """The layer's key smoothing (μ, σ per channel) and the same fit of its values (ν, τ)."""
        return self.keys[layer].fit(self.num_heads), self.values[layer].fit(self.num_heads)


def scheme_fn(name: str, stats: Stats) -> Callable[[int, torch.Tensor, torch.Tensor],
                                                   tuple[torch.Tensor, torch.Tensor]]:
    smoothing = {layer: stats.smoothing(layer) for layer in stats.keys}  # fitted once, not per write

    def apply(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if name == "int8":
            return fake_int8(k), fake_int8(v)
        if name == "keys":
            return fake_int8(k), v
        if name == "values":
            return k, fake_int8(v)
        if name.startswith("layer"):
            return (fake_int8(k) if layer == int(name[5:]) else k), v
        keys, values = smoothing[layer]
        k = keys.restore(fake_int8(keys.normalize(k)))
        if name == "smooth+v":
            v = fake_int8(v - values.shift) + values.shift
        elif name == "smooth+vs":
            v = values.restore(fake_int8(values.normalize(v)))
        else:
            v = fake_int8(v)
        return k, v
    return apply


def main() -> None:
    args = parse_args()
    common.pin_threads(args.threads)
    from tokenmill.engine.kv_calibration import (
        CALIBRATION_SEQ_LEN,
        CALIBRATION_TOKENS,
        calibration_sequences,
        calibration_text,
    )
    from tokenmill.eval.engine_backend import EngineBackend
    from tokenmill.eval.metrics import top1, topk_kl
    from tokenmill.eval.tasks.base import score_texts
    from tokenmill.eval.texts import corpus, passages
    from tokenmill.layers import kv_cache

    state: dict[str, Any] = {"fn": None, "layers": {}}
    original = kv_cache.DenseKVCache.write

    def write(self: kv_cache.DenseKVCache, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        layer = state["layers"].setdefault(id(self), len(state["layers"]))  # caches are written in layer order
        if state["fn"] is not None:
            k, v = state["fn"](layer, k.float(), v.float())
        original(self, slots, k, v)

    kv_cache.DenseKVCache.write = write  # type: ignore[method-assign]
    # Prefix caching off: a scheme must not reuse blocks another scheme wrote.
    backend = EngineBackend(args.model, {"kv_cache_dtype": "fp32", "enable_prefix_caching": False,
                                         "num_threads": args.threads})

    class Quiet:
        def start(self, total: int) -> None: ...
        def advance(self, count: int) -> None: ...

    scored = [backend.tokenize(t) for t in passages(corpus("heldout"), (args.passages + 1) // 2, 600)]
    scored += [backend.tokenize(t) for t in passages(corpus("code"), args.passages // 2, 600)]
    reference = score_texts(backend, scored, 20, Quiet())
    stats = Stats(backend.llm.core.arch.num_heads)

    def record(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        stats.add(layer, k, v)
        return k, v

    state["fn"] = record
    if args.calibration == "engine":  # the text and the cut of engine/kv_calibration.py
        calibration = calibration_sequences(backend.tokenize(calibration_text())[:CALIBRATION_TOKENS],
                                            args.calibration_len or CALIBRATION_SEQ_LEN)
    else:
        calibration = [backend.tokenize(t) for t in passages(corpus("docstrings"), args.calibration_passages, 1200)]
    score_texts(backend, calibration, 20, Quiet())
    names = args.schemes.split(",")
    if args.layers:
        names += [f"layer{i}" for i in range(len(stats.keys))]
    rows, results = [], []
    for name in names:
        state["fn"] = scheme_fn(name, stats)
        start = time.perf_counter()
        candidate = score_texts(backend, scored, 20, Quiet())
        agree = n = 0
        kl = ref_lp = cand_lp = 0.0
        for ref_item, cand_item in zip(reference, candidate, strict=True):
            for r, c in zip(ref_item, cand_item, strict=True):
                agree += top1(r.top) == top1(c.top)
                kl += topk_kl(r.top, c.top)
                ref_lp, cand_lp, n = ref_lp + r.logprob, cand_lp + c.logprob, n + 1
        result = {"scheme": name, "top1_agreement": agree / n, "kl_mean": kl / n,
                  "ppl_delta_pct": 100 * (math.exp((ref_lp - cand_lp) / n) - 1), "positions": n,
                  "seconds": time.perf_counter() - start}
        results.append(result)
        rows.append([name, f"{result['top1_agreement']:.4f}", f"{result['kl_mean']:.2e}",
                     f"{result['ppl_delta_pct']:+.2f}%", n])
    common.print_table(["scheme", "top-1 agreement", "KL", "ppl delta", "positions"], rows)
    common.save_json("kv_int8_schemes", args.model, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
