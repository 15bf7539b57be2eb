"""A burst of requests that share a long prompt prefix (one system prompt, or n > 1 samples of one prompt),
arriving together with a cold prefix cache: with the scheduler's shared-prefix wait (SchedulerConfig.
shared_prefix_wait_tokens, `--wait-tokens`, default 32) against without (0): two engines of one process
(`LLM(shared_prefix_wait_tokens=...)`), rounds alternating.

Without the wait, every request admitted in the first steps computes the shared prefix itself (it is cached
only once computed); with it, the first computes it and its siblings take it from the cache a step later.
Printed and saved per mode: the burst's wall time, TTFT P50 / max, and the prompt tokens computed; and the
ratio wait / no wait of each.

    flock /tmp/tokenmill-bench.lock python benchmarks/shared_prefix.py --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--wait-tokens", type=int, default=None,
                   help="the threshold of the wait mode (default: the engine's)")
    p.add_argument("--tag", default="", help="suffix of the result file name")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    from tokenmill import LLM, SamplingParams

    # Two engines: the threshold is fixed when an engine is built (a scheduler's config swapped at run time
    # did not reach it: both modes of this benchmark waited from 2026-12-07's refactor until this one).
    wait = {} if args.wait_tokens is None else {"shared_prefix_wait_tokens": args.wait_tokens}
    engines = {"wait": LLM(args.model, num_threads=args.threads, **wait),
               "no_wait": LLM(args.model, num_threads=args.threads, shared_prefix_wait_tokens=0)}
    llm = engines["wait"]
    assert llm.core.scheduler.config.shared_prefix_wait_tokens > 0, "the wait mode must wait"
    encode = llm.tokenizer.encode
    shared = common.build_prompts(encode, 1, args.shared_tokens, common.prompt_bos(llm.tokenizer))[0]
    tail = "x" * args.unique_tokens
    prompts = [shared + encode(f" Request {i}: {tail}", add_special_tokens=False)[:args.unique_tokens]
               for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def burst(mode: str) -> dict[str, float]:
        llm = engines[mode]
        assert llm.core.kv.reset_prefix_cache(), "blocks still held between rounds"
        stats = llm.core.kv.pool.stats
        queries, hits = stats.queries, stats.hits
        started = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - started
        ttfts = [o.metrics.ttft_s for o in outs if o.metrics is not None and o.metrics.ttft_s is not None]
        return {"wall_s": wall, "ttft_p50_s": statistics.median(ttfts), "ttft_max_s": max(ttfts),
                "prompt_tokens_computed": (stats.queries - queries) - (stats.hits - hits)}

    for mode in engines:  # warm-up
        burst(mode)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            runs[name].append(burst(name))
    summary: dict[str, Any] = {name: {k: statistics.median(run[k] for run in rows) for k in rows[0]}
                               for name, rows in runs.items()}
    summary["wait_over_no_wait"] = {k: summary["wait"][k] / summary["no_wait"][k] for k in summary["wait"]}
    for name, row in summary.items():
        print(f"{name:18s} " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()))
    config = {**vars(args), "wait_tokens": llm.core.scheduler.config.shared_prefix_wait_tokens}
    common.save_json("shared_prefix", args.model + (f"_{args.tag}" if args.tag else ""),
                     {"config": config, "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
