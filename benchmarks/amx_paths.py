"""The quant kernel's AMX paths against its AVX-512 VNNI path, on one loaded model, in one run.

Variants (each QuantLinear switched in place by the model's `set_quant_path`, the native stack rebound; the lm_head
keeps integer rounding in every variant, as the engine builds it):
  vnni      `avx512vnni`: vpdpwssd tiles at every M (the path before AMX)
  amx-int8  `amx` as served by default: AMX-INT8 tiles from amx_min_rows() rows (bit-identical to vnni)
  amx       `amx` with --amx-bf16 (opt-in): plus bf16 tiles from amx_bf16_rows() rows
Measured per variant, rounds interleaved (this VM drifts within minutes: the figure is the median of
per-round ratios against vnni):
  prefill   `--prefill-prompts` prompts of `--prefill-len` tokens, 1 output token each: prompt tokens/s
            (chunked by the scheduler's token budget, so the GEMMs see budget-sized M)
  decode    `--batch-sizes` requests decoding together: the median step, as tokens/s

    flock /tmp/tokenmill-bench.lock python benchmarks/amx_paths.py --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import common

VARIANTS = {"vnni": ("avx512vnni", False), "amx-int8": ("amx", False), "amx": ("amx", True)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill-prompts", type=int, default=8)
    p.add_argument("--prefill-len", type=int, default=256)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens of the decode runs")
    p.add_argument("--rounds", type=int, default=3)
    return p.parse_args()


def prefill_tok_s(llm: Any, prompts: list[list[int]], name: str) -> float:
    from tokenmill.engine.loader import eos_ids
    from tokenmill.engine.request import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    for i, prompt in enumerate(prompts):
        llm.core.add_request(f"{name}-{i}", prompt, params, eos_ids(llm.loaded))
    started = time.perf_counter()
    while llm.core.has_unfinished:
        llm.core.step()
    return sum(len(p) for p in prompts) / (time.perf_counter() - started)


def main() -> None:
    from quant_decode import batch_decode

    from tokenmill.kernels import available_quant_isas, quant_kernels
    from tokenmill.llm import LLM

    args = parse_args()
    if "amx" not in available_quant_isas():
        raise SystemExit("this CPU (or OS) grants no AMX: nothing to compare")
    common.pin_threads(args.threads)
    max_batch = max(args.batch_sizes)
    seq_tokens = max(args.prompt_len + args.output_len, args.prefill_len + 1) + 16
    llm = LLM(args.model, dtype="float32", num_threads=args.threads,
              max_num_seqs=max(max_batch, args.prefill_prompts),
              num_kv_blocks=max(max_batch, args.prefill_prompts) * (-(-seq_tokens // 16)) + 8)
    model = llm.core.runner.model
    kernels = quant_kernels()
    bos = common.prompt_bos(llm.tokenizer)
    long_prompts = common.build_prompts(llm.tokenizer.encode, args.prefill_prompts, args.prefill_len, bos)
    short_prompts = common.build_prompts(llm.tokenizer.encode, max_batch, args.prompt_len, bos)
    figures: dict[str, dict[str, list[float]]] = {v: {} for v in VARIANTS}
    for rnd in range(args.rounds):
        order = list(VARIANTS) if rnd % 2 == 0 else list(reversed(VARIANTS))
        for variant in order:
            isa, bf16 = VARIANTS[variant]
            model.set_quant_path(bf16, isa)  # the lm_head keeps the integer rounding
            prefill_tok_s(llm, long_prompts[:1], f"warm-{variant}-{rnd}")
            row = figures[variant]
            row.setdefault("prefill", []).append(prefill_tok_s(llm, long_prompts, f"p-{variant}-{rnd}"))
            for batch in args.batch_sizes:
                step = batch_decode(llm, short_prompts[:batch], args.output_len, f"d-{variant}-{batch}-{rnd}")
                row.setdefault(f"decode{batch}", []).append(batch / step.median)
            print(f"round {rnd} {variant}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in row.items()), flush=True)
    metrics = list(figures["vnni"])
    table = []
    for metric in metrics:
        cells: list[object] = [metric]
        for variant in VARIANTS:
            ratios = [a / b for a, b in zip(figures[variant][metric], figures["vnni"][metric], strict=True)]
            cells += [f"{statistics.median(figures[variant][metric]):.1f}", f"{statistics.median(ratios):.2f}x"]
        table.append(cells)
    env = common.environment()
    print(f"CPU: {env.get('cpu')}; model {args.model}; amx_min_rows {kernels.amx_min_rows()}, "
          f"amx_bf16_rows {kernels.amx_bf16_rows()}; tokens/s, median of {args.rounds} rounds; "
          "x: per-round ratio to vnni")
    common.print_table(["metric", *[f"{v} {c}" for v in VARIANTS for c in ("tok/s", "ratio")]], table)
    path = common.save_json("amx_paths", args.model, {"config": vars(args), "environment": env,
                                                      "figures": figures, "table": table})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
