"""Speculative decoding against plain decoding, side by side in one process, same engine.

  ngram  Qwen2.5-Coder-0.5B (--ngram-model), code-editing prompts ("rewrite this function with
         type hints": the answer copies most of the prompt), at each --concurrency
  draft  Qwen2.5-Coder-1.5B (--target) with Qwen2.5-Coder-0.5B (--draft) proposing, batch 1, a
         code-editing and a chat prompt

Each engine is loaded once; speculation is toggled on the same engine (same weights, same KV
pool) and the two runs alternate for --rounds rounds, so machine noise hits both. Reported:
output tokens/s of each (median over rounds), their ratio, acceptance rate and mean accepted
length, and whether the greedy tokens matched. Greedy decoding throughout.

Run it under the shared lock (one benchmark at a time on this machine):

    flock /tmp/tokenmill-bench.lock python benchmarks/speculative.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import common  # type: ignore[import-not-found]

FUNCTIONS = [
    '''def merge_intervals(intervals):
    intervals.sort(key=lambda x: x[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
''',
    '''def word_counts(path, min_len=1):
    counts = {}
    with open(path) as f:
        for line in f:
            for word in line.lower().split():
                word = word.strip(".,;:!?")
                if len(word) >= min_len:
                    counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])
''',
    '''def binary_search(items, target):
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
''',
]
CHAT = "Explain in three short paragraphs how a hash map handles collisions."


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ngram-model", default="qwen2.5-coder-0.5b")
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--ngram-tokens", type=int, default=96, help="max_tokens per request (ngram)")
    p.add_argument("--draft-tokens", type=int, default=32, help="max_tokens per request (draft; the 1.5B is slow)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="ngram: requests at once")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--skip", choices=["ngram", "draft"], action="append", default=[])
    return p.parse_args()


def edit_prompt(i: int) -> list[dict[str, str]]:
    code = FUNCTIONS[i % len(FUNCTIONS)]
    return [{"role": "user", "content": f"Rewrite this function with type hints. Change nothing else.\n\n{code}"}]


class StepCounter:
    """Wraps EngineCore.step to sum the speculation counters of the steps it ran."""

    def __init__(self, core: Any) -> None:
        self.core, self.inner = core, core.step
        self.drafts = self.draft_tokens = self.accepted = self.steps = self.off_steps = 0
        core.step = self

    def __call__(self) -> Any:
        result = self.inner()
        s = result.stats
        self.steps += 1
        self.off_steps += s.spec_is_on is False
        self.drafts += s.spec_num_drafts
        self.draft_tokens += s.spec_num_draft_tokens
        self.accepted += s.spec_num_accepted_tokens
        return result

    def reset(self) -> None:
        self.drafts = self.draft_tokens = self.accepted = self.steps = self.off_steps = 0


def measure(llm: Any, messages: list[list[dict[str, str]]], max_tokens: int, rounds: int) -> dict[str, Any]:
    from tokenmill import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    speculator = llm.core.speculator
    counter = StepCounter(llm.core)
    llm.chat(messages[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up: kernels, allocator
    rates: dict[str, list[float]] = {"spec": [], "plain": []}
    tokens: dict[str, list[list[int]]] = {}
    stats = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "steps": 0, "controller_off_steps": 0}
    for _ in range(rounds):
        for mode in ("spec", "plain"):
            llm.core.speculator = speculator if mode == "spec" else None
            counter.reset()
            start = time.perf_counter()
            outs = llm.chat(messages, params)
            elapsed = time.perf_counter() - start
            tokens[mode] = [o.outputs[0].token_ids for o in outs]
            rates[mode].append(sum(len(t) for t in tokens[mode]) / elapsed)
            if mode == "spec":
                for key, value in (("drafts", counter.drafts), ("draft_tokens", counter.draft_tokens),
                                   ("accepted", counter.accepted), ("steps", counter.steps),
                                   ("controller_off_steps", counter.off_steps)):
                    stats[key] += value
    llm.core.speculator = speculator
    spec, plain = statistics.median(rates["spec"]), statistics.median(rates["plain"])
    return {
        "spec_tok_s": spec, "plain_tok_s": plain, "ratio": spec / plain, "rates": rates,
        "acceptance_rate": stats["accepted"] / max(stats["draft_tokens"], 1),
        "mean_accepted_length": 1 + stats["accepted"] / max(stats["drafts"], 1),
        "greedy_identical": tokens["spec"] == tokens["plain"], **stats,
    }


def run_ngram(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tokenmill import LLM

    llm = LLM(args.ngram_model, speculative="ngram", num_speculative_tokens=args.k, num_kv_blocks=512,
              max_model_len=2048, num_threads=args.threads)
    rows = []
    for c in args.concurrency:
        result = measure(llm, [edit_prompt(i) for i in range(c)], args.ngram_tokens, args.rounds)
        rows.append({"method": "ngram", "model": args.ngram_model, "concurrency": c, **result})
        print(f"ngram c={c}: {result['spec_tok_s']:.1f} vs {result['plain_tok_s']:.1f} tok/s = "
              f"{result['ratio']:.2f}x, acceptance {result['acceptance_rate']:.2f}", flush=True)
    return rows


def run_draft(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tokenmill import LLM

    llm = LLM(args.target, speculative="draft", draft_model=args.draft, num_speculative_tokens=args.k,
              num_kv_blocks=128, max_model_len=1024, num_threads=args.threads)
    rows = []
    for name, messages in (("code-edit", [edit_prompt(0)]), ("chat", [[{"role": "user", "content": CHAT}]])):
        result = measure(llm, messages, args.draft_tokens, args.rounds)
        rows.append({"method": "draft", "model": f"{args.target} <- {args.draft}", "prompt": name,
                     "concurrency": 1, **result})
        print(f"draft {name}: {result['spec_tok_s']:.2f} vs {result['plain_tok_s']:.2f} tok/s = "
              f"{result['ratio']:.2f}x, acceptance {result['acceptance_rate']:.2f}", flush=True)
    return rows


def main() -> None:
    args = parse_args()
    common.pin_threads(args.threads)
    rows: list[dict[str, Any]] = []
    if "ngram" not in args.skip:
        rows += run_ngram(args)
    if "draft" not in args.skip:
        rows += run_draft(args)
    common.print_table(
        ["method", "model", "prompt", "conc", "spec tok/s", "plain tok/s", "ratio", "accept", "mean len", "same"],
        [[r["method"], r["model"], r.get("prompt", "code-edit"), r["concurrency"], r["spec_tok_s"], r["plain_tok_s"],
          r["ratio"], r["acceptance_rate"], r["mean_accepted_length"], r["greedy_identical"]] for r in rows])
    common.save_json("speculative", args.ngram_model if "ngram" not in args.skip else args.target,
                     {"args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
