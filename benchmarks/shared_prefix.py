"""A burst of requests that share a long prompt prefix (one system prompt, or n > 1 samples of one prompt),
arriving together with a cold prefix cache: with the scheduler's shared-prefix wait (SchedulerConfig.
shared_prefix_wait_tokens, default 128) against without (0), on one engine, rounds alternating.

Without the wait, every request admitted in the first steps computes the shared prefix itself (it is cached
only once computed); with it, the first computes it and its siblings take it from the cache a step later.
Printed and saved per mode: the burst's wall time, TTFT P50 / max, and the prompt tokens computed; and the
ratio wait / no wait of each.

    flock /tmp/tokenmill-bench.lock python benchmarks/shared_prefix.py --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import common


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=common.MODELS, default="qwen2.5-coder-0.5b")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--shared-tokens", type=int, default=512)
    p.add_argument("--unique-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    from tokenmill import LLM, SamplingParams

    llm = LLM(args.model, num_threads=args.threads)
    encode = llm.tokenizer.encode
    shared = common.build_prompts(encode, 1, args.shared_tokens, common.prompt_bos(llm.tokenizer))[0]
    tail = "x" * args.unique_tokens
    prompts = [shared + encode(f" Request {i}: {tail}", add_special_tokens=False)[:args.unique_tokens]
               for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    scheduler = llm.core.scheduler
    base = scheduler.config
    modes = {"wait": base.shared_prefix_wait_tokens or 128, "no_wait": 0}

    def burst(wait_tokens: int) -> dict[str, float]:
        assert llm.core.kv.reset_prefix_cache(), "blocks still held between rounds"
        scheduler.config = dataclasses.replace(base, shared_prefix_wait_tokens=wait_tokens)
        stats = llm.core.kv.pool.stats
        queries, hits = stats.queries, stats.hits
        started = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - started
        ttfts = [o.metrics.ttft_s for o in outs if o.metrics is not None and o.metrics.ttft_s is not None]
        return {"wall_s": wall, "ttft_p50_s": statistics.median(ttfts), "ttft_max_s": max(ttfts),
                "prompt_tokens_computed": (stats.queries - queries) - (stats.hits - hits)}

    burst(modes["wait"])  # warm-up
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in modes}
    for r in range(args.rounds):
        for name in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
            runs[name].append(burst(modes[name]))
    scheduler.config = base
    summary: dict[str, Any] = {name: {k: statistics.median(run[k] for run in rows) for k in rows[0]}
                               for name, rows in runs.items()}
    summary["wait_over_no_wait"] = {k: summary["wait"][k] / summary["no_wait"][k] for k in summary["wait"]}
    for name, row in summary.items():
        print(f"{name:18s} " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()))
    common.save_json("shared_prefix", args.model, {"config": vars(args), "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
