"""Cross-request lookup (`--speculative suffix`) against prompt lookup (`ngram`) and no speculation, in one
process on one engine, on workloads whose answers repeat across requests (benchmarks/repeat_prompts.py):
JSON extraction, agent tool calls, short code functions.

Each round runs, per mode (rotated so none always goes first), the workload's --requests prompts in
waves of --concurrency (a wave waits for the one before, so later requests can draw on earlier ones'
outputs); the suffix cache is emptied before each of its runs, so it only ever holds outputs of the
same run (never the answer being generated: no two prompts of a run are equal). A deployment's cache
is warm from earlier traffic: this measures a cold one. Prefixes are warmed for every mode alike first.
Reported per workload: output tokens/s of each mode (median over rounds), the ratios, acceptance and
mean accepted length, and whether the greedy tokens of all three matched.

    flock /tmp/tokenmill-bench.lock python benchmarks/suffix_cache.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import common  # type: ignore[import-not-found]
from repeat_prompts import WORKLOADS  # type: ignore[import-not-found]
from spec_measure import StepCounter  # type: ignore[import-not-found]

MODES = ("plain", "ngram", "suffix")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--requests", type=int, default=24, help="prompts a workload runs each round (at most 24 distinct)")
    p.add_argument("--concurrency", type=int, default=1, help="requests at once (a wave)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tag", default="")
    return p.parse_args()


def run_workload(llm: Any, speculators: dict[str, Any], name: str, args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill import SamplingParams

    prompt, max_tokens = WORKLOADS[name]
    messages = [prompt(i) for i in range(args.requests)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    llm.core.speculator = None
    llm.chat(messages, SamplingParams(max_tokens=1, temperature=0.0))  # every prefix cached for every mode
    counter = StepCounter(llm.core)
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    tokens: dict[str, list[list[int]]] = {}
    stats = {m: {"drafts": 0, "draft_tokens": 0, "accepted": 0} for m in MODES}
    for round_index in range(args.rounds):
        shift = round_index % len(MODES)
        for mode in MODES[shift:] + MODES[:shift]:
            llm.core.speculator = speculators.get(mode)
            if mode == "suffix":
                speculators[mode].proposer.cache.clear()
            counter.reset()
            outs, start = [], time.perf_counter()
            for w in range(0, len(messages), args.concurrency):
                outs += llm.chat(messages[w:w + args.concurrency], params)
            elapsed = time.perf_counter() - start
            tokens[mode] = [o.outputs[0].token_ids for o in outs]
            rates[mode].append(sum(len(t) for t in tokens[mode]) / elapsed)
            stats[mode]["drafts"] += counter.drafts
            stats[mode]["draft_tokens"] += counter.draft_tokens
            stats[mode]["accepted"] += counter.accepted
    llm.core.step = counter.inner
    median = {m: statistics.median(r) for m, r in rates.items()}
    row: dict[str, Any] = {"workload": name, "requests": args.requests, "concurrency": args.concurrency,
                           "tokens": sum(len(t) for t in tokens["plain"]), "rates": rates,
                           "greedy_identical": tokens["ngram"] == tokens["plain"] == tokens["suffix"]}
    for mode in MODES:
        row[f"{mode}_tok_s"] = median[mode]
    for mode in ("ngram", "suffix"):
        s = stats[mode]
        row[mode] = {"ratio": median[mode] / median["plain"],
                     "acceptance_rate": s["accepted"] / max(s["draft_tokens"], 1),
                     "mean_accepted_length": 1 + s["accepted"] / max(s["drafts"], 1), **s}
    row["suffix_over_ngram"] = median["suffix"] / median["ngram"]
    controller = speculators["suffix"].controller
    row["suffix_acceptance_by_bucket"] = {str(b): r for b, r in controller.acceptance.rates(
        controller.bucket_prior).items()}
    print(f"{name}: plain {median['plain']:.1f}, ngram {median['ngram']:.1f} ({row['ngram']['ratio']:.2f}x), "
          f"suffix {median['suffix']:.1f} tok/s ({row['suffix']['ratio']:.2f}x), same tokens: "
          f"{row['greedy_identical']}", flush=True)
    return row


def main() -> None:
    args = parse_args()
    common.pin_threads(args.threads)
    from tokenmill import LLM
    from tokenmill.config import SpeculativeConfig
    from tokenmill.engine.spec.ngram import NgramProposer
    from tokenmill.engine.spec.speculator import Speculator

    llm = LLM(args.model, speculative="suffix", num_threads=args.threads, quantization=args.quantization,
              max_num_seqs=max(64, args.concurrency))
    suffix = llm.core.speculator
    assert suffix is not None
    ngram = Speculator(SpeculativeConfig("ngram"), NgramProposer(suffix.config.ngram_min, suffix.config.ngram_max),
                       suffix.max_model_len)
    speculators = {"ngram": ngram, "suffix": suffix}
    rows = [run_workload(llm, speculators, name, args) for name in args.workloads]
    common.print_table(
        ["workload", "conc", "plain tok/s", "ngram", "suffix", "suffix/ngram", "accept", "mean len", "same"],
        [[r["workload"], r["concurrency"], r["plain_tok_s"], r["ngram"]["ratio"], r["suffix"]["ratio"],
          r["suffix_over_ngram"], r["suffix"]["acceptance_rate"], r["suffix"]["mean_accepted_length"],
          r["greedy_identical"]] for r in rows])
    name = f"{args.model}_c{args.concurrency}" + (f"_{args.tag}" if args.tag else "")
    common.save_json("suffix_cache", name, {"args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
