"""Quantized execution vs tokenmill's fp32 path, side by side in one run, from the same GGUF file.

1. Batch-1 decode tokens/s: `--quantization auto` (the GGUF's own 4/8-bit blocks, native integer
   kernels) against `--quantization none` (dequantized to fp32, today's path): median decode step of
   one greedy request (EOS ignored) driven through EngineCore.step(), prefill excluded. Next to it:
   the effective weight bandwidth (weight bytes a step reads / step time) and the measured copy
   bandwidth (a 1 GiB tensor copy, read + write), and the quant ISA that ran.
2. The GEMM alone at M = 1, 16, 64 rows: layer 0's gate/up matrix as each mode stores it
   (quantized kernel vs the dense fp32 kernel the engine picks: native skinny / oneDNN).
3. `--memory MODEL`: resident memory (VmRSS, VmHWM) of a process that loads MODEL with
   `--memory-quantization` and serves a few requests (a fresh subprocess per mode).

    flock /tmp/tokenmill-bench.lock python benchmarks/quant_decode.py --models smollm2-135m qwen2.5-coder-0.5b
    flock /tmp/tokenmill-bench.lock python benchmarks/quant_decode.py --models none --memory qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common
from decode_roofline import BandwidthProbe, timed_request

MODES = ("none", "auto")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"],
                   help="catalog models ('none': skip the decode comparison)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gemm-rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--gemm-repeats", type=int, default=15)
    p.add_argument("--copy-gib", type=float, default=0.5)
    p.add_argument("--memory", default=None, help="also measure resident memory serving this model")
    p.add_argument("--memory-quantization", nargs="+", default=["q4", "auto"])
    p.add_argument("--memory-child", nargs=2, default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def decode_run(model_name: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.llm import LLM

    blocks = 2 * -(-(args.prompt_len + args.output_len + 64) // 16) + 8
    started = time.perf_counter()
    llm = LLM(model_name, dtype="float32", num_threads=args.threads, max_num_seqs=4, num_kv_blocks=blocks,
              quantization=mode)
    load_s = time.perf_counter() - started
    model = llm.core.runner.model
    prompts = common.build_prompts(llm.tokenizer.encode, 2, args.prompt_len, common.prompt_bos(llm.tokenizer))
    timed_request(llm, prompts[1], 8, "warmup")
    steps = timed_request(llm, prompts[0], args.output_len, "timed")
    decode = common.Stats.of([s for n, s in steps if n == 1])
    weights = common.weight_bytes(model)
    gemm = gemm_times(model.layers[0].gate_up_proj, args)
    del llm, model
    gc.collect()
    return {"mode": mode, "load_s": load_s, "decode_step_s": decode, "tok_s": 1 / decode.median,
            "weights": weights, "effective_weight_bytes_per_s": weights["bytes"] / decode.median, "gemm": gemm}


def gemm_times(linear: Any, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"method": linear.method, "shape": [linear.out_features, linear.in_features],
                           "bytes": linear.nbytes}
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
        runs = {mode: decode_run(model_name, mode, args) for mode in MODES}
        runs["ratio_tok_s"] = runs["auto"]["tok_s"] / runs["none"]["tok_s"]
        result["models"][model_name] = runs
    probe.sample(3)
    result["bandwidth"] = probe.result()
    if args.memory:
        result["memory"] = measure_memory(args)
    report(result)
    common.save_json("quant_decode", f"{'+'.join(models) or args.memory or 'none'}_t{args.threads}", result)


def report(result: dict[str, Any]) -> None:
    bw = result["bandwidth"]["copy_bytes_per_s"]
    print(f"\nquant ISA {result['quant_isa']}; copy bandwidth {bw / 1e9:.1f} GB/s (read + write)")
    rows = []
    for name, runs in result["models"].items():
        for mode in MODES:
            r = runs[mode]
            rows.append((name, mode, "/".join(r["weights"]["dtypes"]), r["weights"]["bytes"] / 1e6,
                         r["decode_step_s"].median * 1e3, r["tok_s"], r["effective_weight_bytes_per_s"] / 1e9,
                         f"{runs['ratio_tok_s']:.2f}x" if mode == "auto" else ""))
    if rows:
        common.print_table(["model", "quantization", "kernels", "weight MB/step", "ms/token", "tok/s",
                            "eff. weight GB/s", "auto / none"], rows)
        gemm_rows = []
        for name, runs in result["models"].items():
            for rows_m in result["config"]["gemm_rows"]:
                key = f"m{rows_m}_s"
                q, d = runs["auto"]["gemm"], runs["none"]["gemm"]
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
