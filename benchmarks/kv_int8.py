"""The int8 KV cache against the fp32 and bf16 caches, side by side in one process.

  capacity    sequences of --seq-len tokens that fit a fixed KV budget (--budget-mib), from the
              engine's own sizing (bytes per block, scales included)
  kernel      native decode attention over --seqs sequences x --contexts keys with the model's head
              layout: fp32 cache, bf16 cache (fp32 queries) and int8 cache, called in turn (order
              alternating) --calls times; the best time of each and the median of the per-call
              fp32/int8 ratios (a neighbour's burst hits both calls of a pair); gather + SDPA over
              the int8 cache once for reference
  perplexity  prompt-logprob perplexity through the engine on local prose and code
              (tokenmill.bench.corpus), model-dtype cache against int8 and bf16, and the top-1
              next-token agreement with the model-dtype cache at every prompt position

Run it under the shared lock (one benchmark at a time on this machine):

    flock /tmp/tokenmill-bench.lock python benchmarks/kv_int8.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import common  # type: ignore[import-not-found]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", choices=common.MODELS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget-mib", type=int, default=1024, help="KV budget for the capacity table")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence for the capacity table")
    p.add_argument("--seqs", type=int, default=64, help="decode batch of the kernel timing")
    p.add_argument("--contexts", default="256,1024", help="keys per sequence of the kernel timing")
    p.add_argument("--calls", type=int, default=40, help="calls per cache type and context")
    p.add_argument("--windows", type=int, default=3, help="perplexity windows per text kind")
    p.add_argument("--window-tokens", type=int, default=768)
    p.add_argument("--skip-perplexity", action="store_true")
    return p.parse_args()


def alternating_ms(fns: list[Callable[[], Any]], calls: int) -> list[list[float]]:
    """Each function called once per turn, the order reversed every other turn; every call's ms."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for turn in range(calls):
        order = range(len(fns)) if turn % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            start = time.perf_counter()
            fns[i]()
            times[i].append((time.perf_counter() - start) * 1e3)
    return times


def capacity(arch: Any, budget: int, seq_len: int) -> list[dict[str, Any]]:
    import torch

    from tokenmill.config import CacheConfig
    from tokenmill.engine.model_runner import kv_bytes_per_block, num_kv_blocks
    from tokenmill.layers.kv_cache import kv_cache_spec

    cache = CacheConfig(kv_cache_bytes=budget)
    blocks_per_seq = -(-seq_len // cache.block_size)
    rows = []
    for name in ("fp32", "bf16", "int8"):
        spec = kv_cache_spec(name, torch.float32)
        blocks = num_kv_blocks(arch, cache, spec, torch.device("cpu"))
        rows.append({"kv_cache_dtype": name, "bytes_per_token": kv_bytes_per_block(arch, 1, spec),
                     "blocks": blocks, "tokens": blocks * cache.block_size, "sequences": blocks // blocks_per_seq})
    int8 = rows[-1]["sequences"]
    for row in rows:
        row["int8_gain"] = int8 / row["sequences"]
    return rows


def kernel_times(arch: Any, seqs: int, context: int, calls: int) -> dict[str, Any]:
    import statistics

    import torch

    from tokenmill.layers.attention import GroupMetadata, PagedAttention, decode_kernel
    from tokenmill.layers.kv_cache import kv_cache_spec

    kernels = decode_kernel("native", torch.device("cpu"))
    h, kvh, hd, bs = arch.num_heads, arch.num_kv_heads, arch.head_dim, 16
    nb = -(-context // bs)
    num_blocks = seqs * nb + 8
    g = torch.Generator().manual_seed(0)
    slots = torch.arange(num_blocks * bs)
    k, v = torch.randn(len(slots), kvh, hd, generator=g), torch.randn(len(slots), kvh, hd, generator=g)
    table = torch.randperm(num_blocks, generator=g)[:seqs * nb].view(seqs, nb)
    lens = torch.full((seqs,), context, dtype=torch.int64)
    mask = (torch.arange(nb * bs)[None, :] < lens[:, None]).view(seqs, 1, 1, nb * bs)
    group = GroupMetadata(table, lens, mask, None, 0, seqs, 1, None)
    q = torch.randn(seqs, h, hd, generator=g)
    native = PagedAttention(h, kvh, hd, hd**-0.5, None, decode_kernel=kernels)
    sdpa = PagedAttention(h, kvh, hd, hd**-0.5, None)
    caches = {}
    for name in ("fp32", "bf16", "int8"):
        caches[name] = kv_cache_spec(name, torch.float32).allocate(num_blocks, bs, kvh, hd, torch.device("cpu"))
        caches[name].write(slots, k, v)
    ref = native._group(q, caches["fp32"], group, False)
    fns = [partial(native._group, q, caches[n], group, False) for n in ("fp32", "bf16", "int8")]
    fp32, bf16, int8 = alternating_ms(fns, calls)
    int8_sdpa = min(alternating_ms([partial(sdpa._group, q, caches["int8"], group, False)], 3)[0])
    return {"seqs": seqs, "context": context, "heads": h, "kv_heads": kvh, "head_dim": hd, "calls": calls,
            "fp32_ms": min(fp32), "bf16_ms": min(bf16), "int8_ms": min(int8), "int8_sdpa_ms": int8_sdpa,
            "int8_speedup_vs_fp32": statistics.median(a / b for a, b in zip(fp32, int8, strict=True)),
            "int8_speedup_vs_bf16": statistics.median(a / b for a, b in zip(bf16, int8, strict=True)),
            "kv_mib": {n: c.nbytes / 2**20 for n, c in caches.items()},
            "int8_max_abs_diff_vs_fp32": float((native._group(q, caches["int8"], group, False) - ref).abs().max())}


def perplexities(model: str, windows: int, window_tokens: int) -> list[dict[str, Any]]:
    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.corpus import TextKind, corpus_text

    rows = []
    for kind in (TextKind.PROSE, TextKind.CODE):
        ppl: dict[str, float] = {}
        top1: dict[str, list[int]] = {}
        for kv in ("auto", "bf16", "int8"):
            llm = LLM(model, device="cpu", max_model_len=max(1024, window_tokens + 16),
                      num_kv_blocks=windows * (window_tokens // 16 + 1) + 16, max_num_batched_tokens=1024,
                      kv_cache_dtype=kv)
            tokens = llm.tokenizer.encode(corpus_text(kind))
            chunks = [tokens[i * window_tokens:(i + 1) * window_tokens] for i in range(windows)]
            outs = llm.generate(chunks, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
            entries = [lp for o in outs for lp in (o.prompt_logprobs or [])[1:] if lp is not None]
            lps = [lp.logprob for lp in entries]
            ppl[kv] = math.exp(-sum(lps) / len(lps))
            top1[kv] = [lp.top[0][0] for lp in entries]
            model_dtype = str(llm.core.runner.dtype).removeprefix("torch.")
            del llm
        rows.append({"text": kind.value, "positions": len(lps), "model_dtype": model_dtype,
                     "ppl_model_dtype_kv": ppl["auto"], "ppl_bf16_kv": ppl["bf16"], "ppl_int8_kv": ppl["int8"],
                     "int8_top1_agreement": _agreement(top1["auto"], top1["int8"]),
                     "bf16_top1_agreement": _agreement(top1["auto"], top1["bf16"]),
                     "int8_delta_pct": 100 * (ppl["int8"] / ppl["auto"] - 1),
                     "bf16_delta_pct": 100 * (ppl["bf16"] / ppl["auto"] - 1)})
    return rows


def _agreement(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def main() -> None:
    args = parse_args()
    common.pin_threads(args.threads)
    arch = common.gguf_arch(args.model)
    noise = common.NoiseMeter()
    cap = capacity(arch, args.budget_mib << 20, args.seq_len)
    kern = [kernel_times(arch, args.seqs, int(c), args.calls) for c in args.contexts.split(",")]
    ppl = [] if args.skip_perplexity else perplexities(args.model, args.windows, args.window_tokens)
    others = noise.others_cores()
    print(f"\n{args.model}: KV capacity in {args.budget_mib} MiB, sequences of {args.seq_len} tokens")
    common.print_table(["kv cache", "bytes/token", "blocks", "tokens", "sequences", "int8 gain"],
                       [[c["kv_cache_dtype"], c["bytes_per_token"], c["blocks"], c["tokens"], c["sequences"],
                         c["int8_gain"]] for c in cap])
    k0 = kern[0]
    print(f"\ndecode attention, {k0['seqs']} seqs, {k0['heads']}/{k0['kv_heads']} heads x {k0['head_dim']}, "
          f"{args.threads} threads (native kernel: best ms, median per-call ratio; last: gather + SDPA, int8)")
    common.print_table(["keys", "fp32 ms", "bf16 ms", "int8 ms", "int8 vs fp32", "int8 vs bf16", "int8 sdpa ms"],
                       [[k["context"], k["fp32_ms"], k["bf16_ms"], k["int8_ms"], k["int8_speedup_vs_fp32"],
                         k["int8_speedup_vs_bf16"], k["int8_sdpa_ms"]] for k in kern])
    if ppl:
        print(f"\nperplexity through the engine ({args.windows} x {args.window_tokens}-token windows per text)")
        common.print_table(["text", "positions", "model-dtype kv", "bf16 kv", "int8 kv", "int8 delta %",
                            "bf16 delta %", "int8 top-1 agree", "bf16 top-1 agree"],
                           [[p["text"], p["positions"], p["ppl_model_dtype_kv"], p["ppl_bf16_kv"], p["ppl_int8_kv"],
                             p["int8_delta_pct"], p["bf16_delta_pct"], p["int8_top1_agreement"],
                             p["bf16_top1_agreement"]] for p in ppl])
    print(f"others_cores during the run: {others:.2f}")
    common.save_json("kv_int8", args.model, {"config": vars(args), "capacity": cap, "kernel": kern,
                                             "perplexity": ppl, "others_cores": others})


if __name__ == "__main__":
    main()
