"""CPU kernel choices, measured side by side in one process: the figures behind the `auto` defaults.

  gemm       y = x Wᵀ for every weight shape of the model at several row counts (1 = batch-1
             decode, 64 = a full decode batch, 2048 = a prefill chunk): aten (`F.linear`, MKL)
             against oneDNN (`mkldnn::_linear_pointwise`), the native skinny kernel at 1-4 rows,
             and the kernel `auto` picks. Each weight is timed alone, so it stays in cache: the
             native kernel's win (threads streaming W from memory) shows in decode_roofline.py.
  attention  decode attention of S sequences over the paged cache: gather + SDPA (the portable
             path) against the native kernel reading blocks in place (tokenmill/kernels), warm
             (the same call repeated: the rows stay in cache) and cold (a 64 MiB buffer streamed
             between calls, as a real step's weights stream between one layer's attention and the
             next step's). Cold, the native kernel's effective KV bandwidth (cache bytes it must read
             / time) is printed next to the copy bandwidth of the same run.

  prefill    prefill attention of one chunk of Q queries at the end of a K-key context: gather + mask +
             SDPA (what AVX2-only hosts run) against the native flash kernel (kernels/prefill_avx512.h, AVX-512
             builds only; skipped elsewhere), warm.

Each figure is the best of 3 rounds of N calls, the two sides interleaved round by round so a
noisy neighbour hurts both; ratios > 1 favour the second kernel.

    python benchmarks/cpu_kernels.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import common  # type: ignore[import-not-found]
from decode_roofline import BandwidthProbe  # type: ignore[import-not-found]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", choices=common.MODELS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,16,64,2048", help="GEMM row counts")
    p.add_argument("--seqs", default="1,16,64", help="decode batch sizes for attention")
    p.add_argument("--contexts", default="100,400,1000", help="keys per sequence for attention")
    p.add_argument("--prefill", default="512:512,512:2048,512:4096,110:110",
                   help="prefill attention shapes, queries:keys (one sequence; empty: none)")
    return p.parse_args()


def best_ms(fns: list[Callable[[], Any]], calls: int = 8, rounds: int = 3) -> list[float]:
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / calls * 1e3)
    return best


def gemm_rows(arch: Any, rows: list[int]) -> list[dict[str, Any]]:
    import torch

    from tokenmill.kernels import cpu_kernels
    from tokenmill.layers.dense_kernels import SKINNY_MAX_ROWS, kernel_name, linear_kernel

    module = cpu_kernels()
    skinny = None if module is None else module.skinny_linear

    hd = arch.head_dim
    shapes = {"qkv": ((arch.num_heads + 2 * arch.num_kv_heads) * hd, arch.hidden_size),
              "o": (arch.hidden_size, arch.num_heads * hd),
              "gate_up": (2 * arch.intermediate_size, arch.hidden_size),
              "down": (arch.hidden_size, arch.intermediate_size),
              "lm_head": (arch.vocab_size, arch.hidden_size)}
    results = []
    for name, (out_f, in_f) in shapes.items():
        w = torch.randn(out_f, in_f)
        aten, onednn = linear_kernel(w, "aten"), linear_kernel(w, "onednn")
        for m in rows:
            if name == "lm_head" and m > 256:  # logits are computed for sampled rows only
                continue
            x = torch.randn(m, in_f)
            fns = [partial(aten, x, w, None), partial(onednn, x, w, None)]
            if skinny is not None and m <= SKINNY_MAX_ROWS:
                fns.append(partial(skinny, x, w, None))
            times = best_ms(fns)
            native = times[2] if len(times) > 2 else None
            results.append({"weight": name, "shape": [out_f, in_f], "rows": m, "aten_ms": times[0],
                            "onednn_ms": times[1], "onednn_speedup": times[0] / times[1], "native_ms": native,
                            "native_speedup": None if native is None else times[0] / native,
                            "auto": kernel_name(linear_kernel(w))})
    return results


def cold_ms(fns: list[Callable[[], Any]], calls: int = 30) -> list[float]:
    """Median ms of each call after a 64 MiB write evicts the caches (the sides interleaved)."""
    import torch

    flush = torch.zeros(64 << 20, dtype=torch.uint8)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(calls):
        for i, fn in enumerate(fns):
            flush.add_(1)
            start = time.perf_counter()
            fn()
            times[i].append((time.perf_counter() - start) * 1e3)
    return [common.Stats.of(t).median for t in times]


def attention_rows(arch: Any, seqs: list[int], contexts: list[int]) -> list[dict[str, Any]]:
    import torch

    from tokenmill.layers.attention import AttentionMetadata, GroupMetadata, PagedAttention, decode_kernel
    from tokenmill.layers.kv_cache import DenseKVCache

    kernel = decode_kernel("native", torch.device("cpu"))
    h, kvh, hd, bs = arch.num_heads, arch.num_kv_heads, arch.head_dim, 16
    results = []
    for s in seqs:
        for context in contexts:
            nb = -(-context // bs)
            cache_blocks = s * nb + 8
            k_cache = torch.randn(cache_blocks, bs, kvh, hd)
            v_cache = torch.randn(cache_blocks, bs, kvh, hd)
            cache = DenseKVCache(k_cache, v_cache)
            table = torch.randperm(cache_blocks)[:s * nb].view(s, nb)  # shuffled, as the pool hands them out
            lens = torch.full((s,), context, dtype=torch.int64)
            mask = (torch.arange(nb * bs)[None, :] < lens[:, None]).view(s, 1, 1, nb * bs)
            group = GroupMetadata(table, lens, mask, None, 0, s, 1, None)
            q = torch.randn(s, h, hd)
            scale = hd**-0.5
            sdpa = PagedAttention(h, kvh, hd, scale, None)
            native = PagedAttention(h, kvh, hd, scale, None, decode_kernel=kernel)
            meta = AttentionMetadata(torch.empty(0, dtype=torch.int64), group, None)
            ref = sdpa._group(q, cache, meta.decode, False)  # type: ignore[arg-type]
            out = native._group(q, cache, meta.decode, False)  # type: ignore[arg-type]
            sides = [partial(sdpa._group, q, cache, group, False), partial(native._group, q, cache, group, False)]
            a, n = best_ms(sides, calls=20)
            ca, cn = cold_ms(sides)
            kv_bytes = 2 * s * context * kvh * hd * 4
            results.append({"seqs": s, "context": context, "sdpa_ms": a, "native_ms": n, "native_speedup": a / n,
                            "cold_sdpa_ms": ca, "cold_native_ms": cn, "cold_native_speedup": ca / cn,
                            "cold_native_kv_gbps": kv_bytes / cn / 1e6,
                            "max_abs_diff": float((ref - out).abs().max())})
    return results


def prefill_rows(arch: Any, shapes: list[tuple[int, int]]) -> list[dict[str, Any]]:
    import torch

    from tokenmill.kernels import cpu_kernels
    from tokenmill.layers.attention import GroupMetadata, PagedAttention, decode_kernel
    from tokenmill.layers.kv_cache import DenseKVCache

    module = cpu_kernels()
    if module is None or not module.wide_attention_built():
        return []
    kernel = decode_kernel("native", torch.device("cpu"))
    h, kvh, hd, bs = arch.num_heads, arch.num_kv_heads, arch.head_dim, 16
    results = []
    for nq, keys in shapes:
        nb = -(-keys // bs)
        cache = DenseKVCache(torch.randn(nb + 8, bs, kvh, hd), torch.randn(nb + 8, bs, kvh, hd))
        table = torch.randperm(nb + 8)[:nb].view(1, nb)
        q_pos, k_pos = torch.arange(keys - nq, keys)[:, None], torch.arange(nb * bs)[None, :]
        mask = (k_pos <= q_pos).view(1, 1, nq, nb * bs)
        group = GroupMetadata(table, torch.tensor([keys]), mask, None, 0, nq, nq, None, torch.tensor([nq]))
        attn = PagedAttention(h, kvh, hd, hd**-0.5, None, decode_kernel=kernel)
        q = torch.randn(nq, h, hd)

        def run(wide: bool, q: torch.Tensor = q, attn: PagedAttention = attn, cache: DenseKVCache = cache,
                group: GroupMetadata = group) -> torch.Tensor:
            module.set_wide_attention(wide)
            return attn._group(q, cache, group, False)

        ref, out = run(False), run(True)
        sdpa_ms, native_ms = best_ms([partial(run, False), partial(run, True)], calls=4)
        module.set_wide_attention(True)
        results.append({"queries": nq, "keys": keys, "sdpa_ms": sdpa_ms, "native_ms": native_ms,
                        "native_speedup": sdpa_ms / native_ms, "max_abs_diff": float((ref - out).abs().max())})
    return results


def main() -> None:
    args = parse_args()
    common.pin_threads(args.threads)
    arch = common.gguf_arch(args.model)
    noise = common.NoiseMeter()
    gemm = gemm_rows(arch, [int(r) for r in args.rows.split(",")])
    attention = attention_rows(arch, [int(s) for s in args.seqs.split(",")],
                               [int(c) for c in args.contexts.split(",")])
    prefill = prefill_rows(arch, [(int(a), int(b)) for a, b in (x.split(":") for x in args.prefill.split(",") if x)])
    probe = BandwidthProbe(0.25)
    probe.sample(5)
    bandwidth = probe.result()
    copy_gbps, read_gbps = bandwidth["copy_bytes_per_s"] / 1e9, bandwidth["read_bytes_per_s"] / 1e9
    others = noise.others_cores()
    common.print_table(["weight", "rows", "aten ms", "onednn ms", "onednn speedup", "native speedup", "auto"],
                       [[g["weight"], g["rows"], g["aten_ms"], g["onednn_ms"], g["onednn_speedup"],
                         "-" if g["native_speedup"] is None else g["native_speedup"], g["auto"]] for g in gemm])
    print()
    common.print_table(["seqs", "context", "gather+sdpa ms", "native ms", "native speedup", "cold sdpa ms",
                        "cold native ms", "cold speedup", "cold native KV GB/s"],
                       [[a["seqs"], a["context"], a["sdpa_ms"], a["native_ms"], a["native_speedup"],
                         a["cold_sdpa_ms"], a["cold_native_ms"], a["cold_native_speedup"], a["cold_native_kv_gbps"]]
                        for a in attention])
    if prefill:
        print()
        common.print_table(["queries", "keys", "gather+mask+sdpa ms", "native ms", "native speedup", "max abs diff"],
                           [[r["queries"], r["keys"], r["sdpa_ms"], r["native_ms"], r["native_speedup"],
                             r["max_abs_diff"]] for r in prefill])
    print(f"copy bandwidth (read + write) {copy_gbps:.1f} GB/s, read {read_gbps:.1f} GB/s; "
          f"others_cores during the run: {others:.2f}")
    common.save_json("cpu_kernels", args.model, {"config": vars(args), "gemm": gemm, "attention": attention,
                                                 "prefill": prefill,
                                                 "copy_gbps": copy_gbps, "read_gbps": read_gbps,
                                                 "others_cores": others,
                                                 "environment": common.environment()})


if __name__ == "__main__":
    main()
