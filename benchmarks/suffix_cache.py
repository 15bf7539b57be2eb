"""Cross-request lookup (`--speculative suffix`) against prompt lookup (`ngram`) and no speculation, in one
process on one engine, on workloads whose answers repeat across requests (benchmarks/repeat_prompts.py):
JSON extraction, agent tool calls, short code functions.

Each round runs, per mode (rotated so none always goes first), the workload's --requests prompts in
waves of --concurrency (a wave waits for the one before, so later requests can draw on earlier ones'
outputs); the suffix cache is emptied before each of its runs, so it only ever holds outputs of the
same run (never the answer being generated: no two prompts of a run are equal). A deployment's cache
is warm from earlier traffic: this measures a cold one. Prefixes are warmed for every mode alike first.
Reported per workload: output tokens/s of each mode (median over rounds), the ratios, acceptance and
mean accepted length, and whether the greedy tokens of all modes matched.

--schema constrains the answers to each workload's JSON schema (structured outputs; workloads without one
are skipped) and adds ngram and suffix without the grammar's forced tokens (`ngram-nf`, `suffix-nf`),
so the gain of proposing what the grammar forces is measured apart.

--draft MODEL adds `suffix-draft` (the same lookups, and the draft model proposing where neither the
request's own context nor the cache has a 3+ token match): the engine loads with it, and the `suffix`
mode uses the hybrid's own lookup proposer (one cache, emptied before each run of either).

    flock /tmp/tokenmill-bench.lock python benchmarks/suffix_cache.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import common  # type: ignore[import-not-found]
from repeat_prompts import SCHEMAS, WORKLOADS  # type: ignore[import-not-found]
from spec_measure import StepCounter  # type: ignore[import-not-found]

BASE_MODES = ("plain", "ngram", "suffix")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--requests", type=int, default=24, help="prompts a workload runs each round (at most 24 distinct)")
    p.add_argument("--concurrency", type=int, default=1, help="requests at once (a wave)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--schema", action="store_true", help="answers constrained to the workload's JSON schema")
    p.add_argument("--draft", default=None, help="a draft model: adds the suffix-draft mode")
    p.add_argument("--tag", default="")
    return p.parse_args()


def run_workload(llm: Any, speculators: dict[str, Any], name: str, args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill import SamplingParams
    from tokenmill.engine.structured import StructuredOutputParams

    prompt, max_tokens = WORKLOADS[name]
    messages = [prompt(i) for i in range(args.requests)]
    structured = StructuredOutputParams.json(SCHEMAS[name]) if args.schema else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=structured)
    modes = (*BASE_MODES, *(("suffix-draft",) if "suffix-draft" in speculators else ()),
             *(("ngram-nf", "suffix-nf") if args.schema else ()))
    suffix = speculators["suffix"]
    grammar = suffix.grammar
    llm.core.speculator = None
    # every prefix cached for every mode, and the grammar compiled
    llm.chat(messages, SamplingParams(max_tokens=1, temperature=0.0, structured=structured))
    counter = StepCounter(llm.core)
    rates: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, list[list[int]]] = {}
    stats = {m: {"drafts": 0, "draft_tokens": 0, "accepted": 0} for m in modes}
    for round_index in range(args.rounds):
        shift = round_index % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            llm.core.speculator = speculators.get(mode.removesuffix("-nf"))
            for speculator in speculators.values():
                speculator.grammar = None if mode.endswith("-nf") else grammar
            if mode.startswith("suffix"):
                suffix.proposer.cache.clear()
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
    for speculator in speculators.values():
        speculator.grammar = grammar
    median = {m: statistics.median(r) for m, r in rates.items()}
    row: dict[str, Any] = {"workload": name, "requests": args.requests, "concurrency": args.concurrency,
                           "schema": args.schema, "tokens": sum(len(t) for t in tokens["plain"]), "rates": rates,
                           "greedy_identical": all(tokens[m] == tokens["plain"] for m in modes)}
    for mode in modes:
        row[f"{mode}_tok_s"] = median[mode]
    for mode in modes[1:]:
        s = stats[mode]
        row[mode] = {"ratio": median[mode] / median["plain"],
                     "acceptance_rate": s["accepted"] / max(s["draft_tokens"], 1),
                     "mean_accepted_length": 1 + s["accepted"] / max(s["drafts"], 1), **s}
    row["suffix_over_ngram"] = median["suffix"] / median["ngram"]
    controller = speculators["suffix"].controller
    row["suffix_acceptance_by_bucket"] = {str(b): r for b, r in controller.acceptance.rates(
        controller.bucket_prior).items()}
    print(f"{name}: plain {median['plain']:.1f} tok/s, " + ", ".join(
        f"{m} {median[m]:.1f} ({row[m]['ratio']:.2f}x)" for m in modes[1:])
        + f", same tokens: {row['greedy_identical']}", flush=True)
    return row


def main() -> None:
    args = parse_args()
    common.pin_threads(args.threads)
    from tokenmill import LLM
    from tokenmill.config import SpeculativeConfig
    from tokenmill.engine.spec.ngram import NgramProposer
    from tokenmill.engine.spec.speculator import Speculator

    llm = LLM(args.model, speculative="suffix-draft" if args.draft else "suffix", draft_model=args.draft,
              num_threads=args.threads, quantization=args.quantization, max_num_seqs=max(64, args.concurrency))
    loaded = llm.core.speculator
    assert loaded is not None
    suffix = Speculator(SpeculativeConfig("suffix"), loaded.proposer.lookup, loaded.max_model_len
                        ) if args.draft else loaded
    ngram = Speculator(SpeculativeConfig("ngram"), NgramProposer(loaded.config.ngram_min, loaded.config.ngram_max),
                       loaded.max_model_len)
    ngram.grammar = suffix.grammar = loaded.grammar  # a grammar's forced tokens (--schema) go to all alike
    speculators = {"ngram": ngram, "suffix": suffix, **({"suffix-draft": loaded} if args.draft else {})}
    rows = [run_workload(llm, speculators, name, args) for name in args.workloads
            if not args.schema or name in SCHEMAS]
    common.print_table(
        ["workload", "conc", "plain tok/s", "ngram", "suffix", "suffix/ngram", "suffix-draft", "ngram-nf",
         "suffix-nf", "accept", "mean len", "same"],
        [[r["workload"], r["concurrency"], r["plain_tok_s"], r["ngram"]["ratio"], r["suffix"]["ratio"],
          r["suffix_over_ngram"],
          *(r[m]["ratio"] if m in r else "-" for m in ("suffix-draft", "ngram-nf", "suffix-nf")),
          r["suffix"]["acceptance_rate"], r["suffix"]["mean_accepted_length"], r["greedy_identical"]] for r in rows])
    name = f"{args.model}_c{args.concurrency}" + ("_schema" if args.schema else "")
    name += f"_draft-{args.draft}" if args.draft else ""
    name += f"_{args.tag}" if args.tag else ""
    common.save_json("suffix_cache", name, {"args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
