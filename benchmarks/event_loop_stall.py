"""How long another Python thread of the engine's process waits while the engine computes.

The server's event loop shares the process with the engine thread; whatever holds the GIL during a
step (a native call that does not release it) stalls reading requests and streaming tokens. This runs
a burst of prompts through one engine (prefill steps of the whole token budget, then a few decodes)
while a ticker thread sleeps 1 ms in a loop, and reports the ticker's gaps: P50 ~1.1 ms when nothing
holds the GIL for long, up to a whole native call when something does.

    flock /tmp/tokenmill-bench.lock python benchmarks/event_loop_stall.py --model qwen2.5-coder-0.5b

Before and after a change: the same script with `PYTHONPATH=/tmp/base` (a `git worktree` of the
other revision: an importable tokenmill on PYTHONPATH wins over this checkout's).

Writes benchmarks/results/event_loop_stall_<model>_<date>.json.
"""

from __future__ import annotations

import argparse
import threading
import time

import common  # type: ignore[import-not-found]

from tokenmill.engine.request import SamplingParams
from tokenmill.llm import LLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=110)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    llm = LLM(args.model, num_threads=args.threads, max_num_seqs=max(8, args.prompts),
              num_kv_blocks=args.prompts * (args.prompt_len // 16 + 2) + 16)
    prompts = common.build_prompts(llm.tokenizer.encode, args.prompts, args.prompt_len,
                                   common.prompt_bos(llm.tokenizer))
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    for i, prompt in enumerate(prompts):
        llm.core.add_request(f"r{i}", prompt, params, ())
    gaps: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    thread = threading.Thread(target=ticker)
    steps: list[tuple[int, float]] = []
    thread.start()
    started = time.perf_counter()
    while llm.core.has_unfinished:
        t0 = time.perf_counter()
        result = llm.core.step()
        steps.append((result.stats.num_scheduled_tokens, time.perf_counter() - t0))
    wall = time.perf_counter() - started
    stop.set()
    thread.join()
    p50, p99, worst = common.nearest_rank(gaps, 0.5), common.nearest_rank(gaps, 0.99), max(gaps)
    summary = {"ticks": len(gaps), "wall_s": wall, "gap_p50_s": p50, "gap_p99_s": p99,
               "gap_max_s": worst, "steps": [{"tokens": n, "s": s} for n, s in steps]}
    print(f"{args.model}: {len(steps)} steps in {wall:.1f} s ({', '.join(f'{n} tok {s:.2f} s' for n, s in steps)})")
    print(f"ticker: {len(gaps)} ticks (of ~{wall / 0.0011:.0f} unhindered), gaps P50 {p50 * 1e3:.1f} ms, "
          f"P99 {p99 * 1e3:.1f} ms, max {worst * 1e3:.1f} ms")
    common.save_json("event_loop_stall", args.model, {"args": vars(args), **summary})


if __name__ == "__main__":
    main()
