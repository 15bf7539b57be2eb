"""Quantized execution vs tokenmill's fp32 path, side by side in one run, from the same GGUF file.

1. Decode tokens/s at each `--batch-sizes` (greedy requests, EOS ignored, driven through
   EngineCore.step(); the median of steps where every request decodes, prefill excluded):
   `--quantization none` (dequantized to fp32), `auto` with one int8 activation pass (`auto-1pass`,
   the kernel before two-pass rounding) and `auto` (two passes, the default). The two `auto` variants
   share one loaded model (QuantLinear.set_passes switches between them). Next to it: the effective
   weight bandwidth (weight bytes a step reads / step time), the measured copy bandwidth (a tensor
   copy, read + write) and the quant ISA that ran.
2. The GEMM alone at M = 1, 16, 64 rows: layer 0's gate/up matrix as each mode stores it
   (quantized kernel, 1 and 2 passes, vs the dense fp32 kernel the engine picks: native skinny / oneDNN).
3. `--llama-bench PATH`: llama.cpp's `llama-bench -m FILE -p 0 -n 128 -t THREADS` on the same file,
   run in the same script; its tg tokens/s next to tokenmill's batch-1 `auto`. Then a head-to-head of
   `--peer-rounds` rounds, tokenmill's batch-1 `auto` decode and llama-bench back to back (their order
   alternating), one ratio per round: this VM's speed drifts by 1.5x within minutes, so the median
   of these paired ratios is the figure, the single pair above only a first look.
4. `--memory MODEL`: resident memory (VmRSS, VmHWM) of a process that loads MODEL with
   `--memory-quantization` and serves a few requests (a fresh subprocess per mode).

    flock /tmp/tokenmill-bench.lock python benchmarks/quant_decode.py --models smollm2-135m qwen2.5-coder-0.5b
    flock /tmp/tokenmill-bench.lock python benchmarks/quant_decode.py --models none --memory qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common
from decode_roofline import BandwidthProbe, timed_request

MODES = ("none", "auto-1pass", "auto")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"],
                   help="catalog models or .gguf files ('none': skip the decode comparison)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--llama-bench", default=None, help="path of llama.cpp's llama-bench binary (optional)")
    p.add_argument("--peer-rounds", type=int, default=3, help="paired tokenmill / llama-bench rounds (0: none)")
    p.add_argument("--gemm-rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--gemm-repeats", type=int, default=15)
    p.add_argument("--copy-gib", type=float, default=0.5)
    p.add_argument("--memory", default=None, help="also measure resident memory serving this model")
    p.add_argument("--tag", default="", help="suffix of the result file name (runs of one shape on one day "
                                              "otherwise overwrite each other)")
    p.add_argument("--memory-quantization", nargs="+", default=["q4", "auto"])
    p.add_argument("--memory-child", nargs=2, default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def decode_runs(model_name: str, quantization: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """{mode: result} for `none`, or for both `auto` variants from one loaded model."""
    from tokenmill.layers.linear import QuantLinear
    from tokenmill.llm import LLM

    max_batch = max(args.batch_sizes)
    blocks = max_batch * (-(-(args.prompt_len + args.output_len + 16) // 16)) + 8
    started = time.perf_counter()
    llm = LLM(model_name, dtype="float32", num_threads=args.threads, max_num_seqs=max_batch, num_kv_blocks=blocks,
              quantization=quantization)
    load_s = time.perf_counter() - started
    model = llm.core.runner.model
    prompts = common.build_prompts(llm.tokenizer.encode, max_batch + 1, args.prompt_len,
                                   common.prompt_bos(llm.tokenizer))
    timed_request(llm, prompts[-1], 8, "warmup")
    variants = {"none": None} if quantization == "none" else {"auto-1pass": 1, "auto": 2}
    quant = [lin for lin in model.linears().values() if isinstance(lin, QuantLinear)]
    out = {}
    for mode, passes in variants.items():
        for lin in quant:
            lin.set_passes(passes or lin.passes)
        model.rebind_native_stack()  # the stack holds the plans the passes just replaced
        weights = common.weight_bytes(model)
        result: dict[str, Any] = {"mode": mode, "load_s": load_s, "weights": weights, "batch": {}}
        for batch in args.batch_sizes:
            decode = batch_decode(llm, prompts[:batch], args.output_len, f"{mode}-{batch}")
            result["batch"][str(batch)] = {"decode_step_s": decode, "tok_s": batch / decode.median,
                                           "effective_weight_bytes_per_s": weights["bytes"] / decode.median}
        result["tok_s"] = result["batch"][str(args.batch_sizes[0])]["tok_s"]
        result["gemm"] = gemm_times(model.layers[0].gate_up_proj, args)
        out[mode] = result
    for lin in quant:
        lin.set_passes(2)
    del llm, model, quant
    gc.collect()
    return out


def batch_decode(llm: Any, prompts: list[list[int]], output_len: int, name: str) -> Any:
    """Median step time over the steps where all len(prompts) requests decode one token each."""
    from tokenmill.engine.loader import eos_ids
    from tokenmill.engine.request import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
    for i, prompt in enumerate(prompts):
        llm.core.add_request(f"{name}-{i}", prompt, params, eos_ids(llm.loaded))
    times = []
    while llm.core.has_unfinished:
        started = time.perf_counter()
        result = llm.core.step()
        if result.stats.num_scheduled_tokens == len(prompts):
            times.append(time.perf_counter() - started)
    return common.Stats.of(times)


def llama_bench(binary: str, model_name: str, threads: int) -> dict[str, Any]:
    """llama.cpp's batch-1 generation speed (tg) on the same GGUF file and thread count."""
    from tokenmill.models.resolve import resolve_model

    path = str(resolve_model(model_name).path)
    command = [binary, "-m", path, "-p", "0", "-n", "128", "-t", str(threads), "-o", "json"]
    proc = subprocess.run(command, capture_output=True, text=True, check=True)
    rows = json.loads(proc.stdout)
    tg = next(r for r in rows if r.get("n_gen", 0) > 0)
    return {"command": command, "tg_tok_s": tg["avg_ts"], "tg_stddev_tok_s": tg.get("stddev_ts"),
            "build": {k: tg.get(k) for k in ("build_commit", "cpu_info", "backends", "n_threads", "type")}}


def head_to_head(model_name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Batch-1 `auto` decode and llama-bench's tg back to back, `--peer-rounds` times (order alternating)."""
    from tokenmill.llm import LLM

    blocks = -(-(args.prompt_len + args.output_len + 16) // 16) + 8
    llm = LLM(model_name, dtype="float32", num_threads=args.threads, max_num_seqs=1, num_kv_blocks=blocks)
    prompt = common.build_prompts(llm.tokenizer.encode, 1, args.prompt_len, common.prompt_bos(llm.tokenizer))[0]
    timed_request(llm, prompt, 8, "h2h-warmup")
    rounds = []
    for r in range(args.peer_rounds):
        pair: dict[str, float] = {}
        for who in (("tokenmill", "llama") if r % 2 == 0 else ("llama", "tokenmill")):
            if who == "llama":
                pair["llama_tg_tok_s"] = llama_bench(args.llama_bench, model_name, args.threads)["tg_tok_s"]
            else:
                pair["tokenmill_tok_s"] = 1.0 / batch_decode(llm, [prompt], args.output_len, f"h2h-{r}").median
        pair["ratio"] = pair["tokenmill_tok_s"] / pair["llama_tg_tok_s"]
        rounds.append(pair)
    del llm
    gc.collect()
    return {"rounds": rounds, "median_ratio": statistics.median(p["ratio"] for p in rounds)}


def gemm_times(linear: Any, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"method": linear.method, "shape": [linear.out_features, linear.in_features],
                           "bytes": linear.nbytes}
    # Median of calls alternating with nothing else (the engine is idle): M rows of random activations.
    for rows in args.gemm_rows:
        x = torch.randn(rows, linear.in_features)
        for _ in range(3):
            linear(x)
        times = []
        for _ in range(args.gemm_repeats):
            with common.Timer() as t:
                linear(x)
            times.append(t.elapsed_s)
        out[f"m{rows}_s"] = common.Stats.of(times).median
    return out


def memory_child(model_name: str, mode: str) -> None:
    """Runs in a fresh process: load, serve 4 short requests, report /proc/self/status."""
    from tokenmill.engine.request import SamplingParams
    from tokenmill.llm import LLM

    started = time.perf_counter()
    llm = LLM(model_name, quantization=mode, num_kv_blocks=256, max_model_len=2048)
    load_s = time.perf_counter() - started
    after_load = _status()
    llm.generate(["def quicksort(xs):", "The three laws of", "import numpy as np\n", "Once upon a time"],
                 SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    print(json.dumps({"model": model_name, "quantization": mode, "load_s": load_s, "after_load": after_load,
                      "after_requests": _status(), "weight_bytes": llm.core.runner.model.weight_bytes()}))


def _status() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def measure_memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tokenmill.models.resolve import resolve_model

    file_bytes = Path(resolve_model(args.memory).path).stat().st_size
    results = []
    for mode in args.memory_quantization:
        proc = subprocess.run([sys.executable, __file__, "--memory-child", args.memory, mode],
                              capture_output=True, text=True, check=True)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["gguf_file_bytes"] = file_bytes
        results.append(result)
    return results


def main() -> None:
    args = parse_args()
    if args.memory_child:
        memory_child(*args.memory_child)
        return
    common.pin_threads(args.threads)
    from tokenmill.kernels import quant_isa

    result: dict[str, Any] = {"config": vars(args), "quant_isa": quant_isa(), "models": {}}
    probe = BandwidthProbe(args.copy_gib)
    probe.sample(3)
    models = [m for m in args.models if m != "none"]
    for model_name in models:
        runs: dict[str, Any] = {**decode_runs(model_name, "none", args), **decode_runs(model_name, "auto", args)}
        runs["ratio_tok_s"] = runs["auto"]["tok_s"] / runs["none"]["tok_s"]
        runs["ratios"] = {f"{mode}/none@{b}": runs[mode]["batch"][b]["tok_s"] / runs["none"]["batch"][b]["tok_s"]
                          for mode in MODES[1:] for b in runs["none"]["batch"]}
        if args.llama_bench:
            peer = llama_bench(args.llama_bench, model_name, args.threads)
            peer["tokenmill_auto_over_llama_tg"] = runs["auto"]["batch"]["1"]["tok_s"] / peer["tg_tok_s"] \
                if "1" in runs["auto"]["batch"] else None
            runs["llama_bench"] = peer
            if args.peer_rounds:
                runs["head_to_head"] = head_to_head(model_name, args)
        result["models"][model_name] = runs
    probe.sample(3)
    result["bandwidth"] = probe.result()
    if args.memory:
        result["memory"] = measure_memory(args)
    report(result)
    # Decode and memory runs of one model on one day get their own files (they overwrote each other).
    def label(model: str) -> str:  # a catalog name, or a .gguf path's file name
        return Path(model).name.removesuffix(".gguf")

    parts = ["+".join(label(m) for m in models)] if models else []
    parts += [f"memory-{label(args.memory)}"] if args.memory else []
    parts += [args.tag] if args.tag else []
    common.save_json("quant_decode", f"{'_'.join(parts) or 'none'}_t{args.threads}", result)


def report(result: dict[str, Any]) -> None:
    bw = result["bandwidth"]["copy_bytes_per_s"]
    print(f"\nquant ISA {result['quant_isa']}; copy bandwidth {bw / 1e9:.1f} GB/s (read + write)")
    rows = []
    for name, runs in result["models"].items():
        for mode in MODES:
            r = runs[mode]
            for batch, b in r["batch"].items():
                rows.append((name, mode, batch, "/".join(r["weights"]["dtypes"]), r["weights"]["bytes"] / 1e6,
                             b["decode_step_s"].median * 1e3, b["tok_s"], b["effective_weight_bytes_per_s"] / 1e9,
                             f"{b['tok_s'] / runs['none']['batch'][batch]['tok_s']:.2f}x"))
    if rows:
        common.print_table(["model", "quantization", "batch", "kernels", "weight MB/step", "ms/step", "tok/s",
                            "eff. weight GB/s", "vs none"], rows)
        for name, runs in result["models"].items():
            peer = runs.get("llama_bench")
            if peer:
                print(f"{name}: llama-bench tg {peer['tg_tok_s']:.1f} tok/s; tokenmill auto batch 1 / llama.cpp "
                      f"{peer['tokenmill_auto_over_llama_tg']:.2f}x")
            h2h = runs.get("head_to_head")
            if h2h:
                pairs = ", ".join(f"{p['tokenmill_tok_s']:.1f}/{p['llama_tg_tok_s']:.1f}" for p in h2h["rounds"])
                print(f"{name}: head-to-head tokenmill/llama-bench tok/s per round {pairs}; "
                      f"median ratio {h2h['median_ratio']:.2f}x")
        gemm_rows = []
        for name, runs in result["models"].items():
            for rows_m in result["config"]["gemm_rows"]:
                key = f"m{rows_m}_s"
                d = runs["none"]["gemm"]
                for mode in MODES[1:]:
                    q = runs[mode]["gemm"]
                    gemm_rows.append((name, f"{q['shape'][0]}x{q['shape'][1]}", rows_m, q["method"], q[key] * 1e6,
                                      d["method"], d[key] * 1e6, f"{d[key] / q[key]:.2f}x"))
        print("\nlayer-0 gate/up GEMM alone:")
        common.print_table(["model", "N x K", "M", "quant", "quant us", "dense", "fp32 us", "speedup"], gemm_rows)
    for m in result.get("memory", []):
        print(f"\nresident memory, {m['model']} --quantization {m['quantization']}: after load VmRSS "
              f"{m['after_load']['VmRSS'] / 1e9:.2f} GB; after 4 requests VmRSS "
              f"{m['after_requests']['VmRSS'] / 1e9:.2f}"
              f" GB, VmHWM {m['after_requests']['VmHWM'] / 1e9:.2f} GB; weights {m['weight_bytes'] / 1e9:.2f} GB "
              f"({m['weight_bytes'] / m['gguf_file_bytes']:.2f}x the {m['gguf_file_bytes'] / 1e9:.2f} GB file); "
              f"load {m['load_s']:.1f} s")


if __name__ == "__main__":
    main()
