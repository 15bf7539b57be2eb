"""What sampling costs a decode: output tokens/s of sampled requests against greedy ones, same engine.

A chat API's default is temperature 1 (often with top-p), not greedy, so the sampler runs on every
token of most requests. One engine per model; for each --batch-sizes, rounds rotate through the
modes (greedy; temperature 1; temperature 1 with a seed, the per-request path; temperature 0.7 with
top-p 0.9; temperature 0.7 with top-k 40 and min-p 0.05) on the same prompts, --tokens each
(ignore_eos), so machine drift hits all alike. Printed and saved: the median tokens/s of each mode
and its ratio to greedy's (1.0 = sampling costs nothing).

    flock /tmp/tokenmill-bench.lock python benchmarks/sampling_cost.py --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import common

MODES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "t1": {"temperature": 1.0},
    "t1-seeded": {"temperature": 1.0, "seed": 7},
    "t0.7-top-p0.9": {"temperature": 0.7, "top_p": 0.9},
    "t0.7-top-k40-min-p": {"temperature": 0.7, "top_k": 40, "min_p": 0.05},
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=common.MODELS, default="qwen2.5-coder-0.5b")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--tokens", type=int, default=48, help="output tokens per request and round")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tag", default="")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    from tokenmill import LLM, SamplingParams

    llm = LLM(args.model, num_threads=args.threads, max_num_seqs=max(args.batch_sizes))
    rows = []
    for batch in args.batch_sizes:
        prompts = common.build_prompts(llm.tokenizer.encode, batch, args.prompt_len, common.prompt_bos(llm.tokenizer))
        params = {name: SamplingParams(max_tokens=args.tokens, ignore_eos=True, **kw) for name, kw in MODES.items()}
        llm.generate(prompts, params["greedy"])  # warm-up: kernels, the prefix cache every mode then hits
        rates: dict[str, list[float]] = {name: [] for name in MODES}
        names = list(MODES)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotated: none always goes first
                started = time.perf_counter()
                outs = llm.generate(prompts, params[name])
                elapsed = time.perf_counter() - started
                rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
        greedy = statistics.median(rates["greedy"])
        for name in MODES:
            rate = statistics.median(rates[name])
            rows.append({"batch": batch, "mode": name, "tok_s": rate, "vs_greedy": rate / greedy,
                         "rounds": rates[name]})
            print(f"batch {batch:3d} {name:20s} {rate:8.1f} tok/s  {rate / greedy:.3f}x greedy", flush=True)
    common.save_json("sampling_cost", f"{args.model}{'_' + args.tag if args.tag else ''}", {"args": vars(args),
                                                                                          "results": rows})


if __name__ == "__main__":
    main()
