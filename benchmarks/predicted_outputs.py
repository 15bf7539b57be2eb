"""Predicted outputs (OpenAI's `prediction`) against prompt lookup alone and no speculation, batch 1, one
engine in one process, on code edits whose callers know most of the answer: the code being edited.

Prompts: the three "rewrite this function with type hints" edits of spec_prompts.py, and whole-file
edits (the three functions as one file, one small change asked for, the whole file to be returned), each
with the original code as its prediction, as a code editor sends it; and regenerations (a request asked
again with a small change, its earlier answer as the prediction: text the new prompt does not hold).
Modes, rotated each round so none always goes first: `plain` (no speculation), `ngram` (prompt lookup),
`prediction` (the same engine and method, the prediction on each request) and `prediction-only` (the
speculator an engine without --speculative builds for predictions: no lookup). Greedy; answers end at
EOS (or --max-tokens), and the three modes' tokens must match. --context-tokens N puts N tokens of other
Python source first (a system message, as an agent's repository context): prompt lookup then has more
places to copy from, the prediction's cursor follows the one text it was given.

    flock /tmp/tokenmill-bench.lock python benchmarks/predicted_outputs.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import common  # type: ignore[import-not-found]
from spec_measure import StepCounter  # type: ignore[import-not-found]
from spec_prompts import FUNCTIONS, code_context  # type: ignore[import-not-found]

MODES = ("plain", "ngram", "prediction", "prediction-only")
FILE = "\n\n".join(f.rstrip("\n") for f in FUNCTIONS) + "\n"
FILE_EDITS = ["In binary_search, rename the parameter `items` to `values`.",
              "In word_counts, change the default of `min_len` from 1 to 2.",
              "Add a one-line docstring to merge_intervals."]


def cases(context: str) -> list[tuple[str, list[dict[str, str]], str]]:
    """(name, chat messages, prediction) per prompt; `context`: a system message's source code, or none."""
    system = [{"role": "system", "content": f"Files of the repository you are working in:\n\n{context}"}]
    first = system if context else []
    out = []
    for i, code in enumerate(FUNCTIONS):
        ask = f"Rewrite this function with type hints. Change nothing else.\n\n{code}"
        out.append((f"type-hints-{i}", [*first, {"role": "user", "content": ask}], code))
    for i, edit in enumerate(FILE_EDITS):
        ask = f"{edit} Return the whole file and nothing else, in one code block.\n\n```python\n{FILE}```"
        out.append((f"file-edit-{i}", [*first, {"role": "user", "content": ask}], f"```python\n{FILE}```"))
    return out


# Regenerations: the caller asks again with a small change, predicting the answer it already has
# (computed first, greedy, from the base request); the prediction is not in the new prompt.
REGENERATIONS = [
    ("Write a Python function that merges overlapping intervals.",
     "Write a Python function that merges overlapping intervals. Name it merge_ranges."),
    ("Write a Python function that counts the words in a text file.",
     "Write a Python function that counts the words in a text file, ignoring case."),
    ("Write a Python class for a stack with push, pop and peek.",
     "Write a Python class for a stack with push, pop, peek and is_empty."),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=320)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context-tokens", type=int, default=0, help="other source code first, in tokens")
    p.add_argument("--only-k", type=int, default=None, help="K of the prediction-only mode (default: its own)")
    p.add_argument("--tag", default="")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    common.pin_threads(args.threads)
    from tokenmill import LLM, SamplingParams

    llm = LLM(args.model, speculative="ngram", num_threads=args.threads,
              max_model_len=2048 + args.context_tokens, num_kv_blocks=max(1024, (args.context_tokens + 2048) // 8))
    context = code_context(llm.tokenizer.encode, args.context_tokens) if args.context_tokens else ""
    from tokenmill.engine.spec.speculator import predictions_only_speculator

    speculator = llm.core.speculator
    speculators = {"plain": None, "ngram": speculator, "prediction": speculator,
                   "prediction-only": predictions_only_speculator(llm.core.max_model_len, *(
                       [args.only_k] if args.only_k else []))}
    counter = StepCounter(llm.core)
    base = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rows = []
    regenerations = []
    for i, (before, after) in enumerate(REGENERATIONS):
        [first] = llm.chat([{"role": "user", "content": before}], base)
        regenerations.append((f"regenerate-{i}", [{"role": "user", "content": after}], first.outputs[0].text))
    for name, messages, text in [*cases(context), *regenerations]:
        prediction = llm.tokenizer.encode(text, add_special_tokens=False)
        llm.chat(messages, SamplingParams(max_tokens=4, temperature=0.0))  # prefix cached for every mode alike
        rates: dict[str, list[float]] = {m: [] for m in MODES}
        tokens: dict[str, list[int]] = {}
        taken: dict[str, int] = dict.fromkeys(MODES, 0)
        for round_index in range(args.rounds):
            shift = round_index % len(MODES)
            for mode in MODES[shift:] + MODES[:shift]:
                llm.core.speculator = speculators[mode]
                params = replace(base, prediction=prediction) if mode.startswith("prediction") else base
                counter.reset()
                start = time.perf_counter()
                [out] = llm.chat(messages, params)
                elapsed = time.perf_counter() - start
                tokens[mode] = list(out.outputs[0].token_ids)
                rates[mode].append(len(tokens[mode]) / elapsed)
                taken[mode] += counter.accepted
        llm.core.speculator = speculator
        median = {m: statistics.median(r) for m, r in rates.items()}
        row = {"case": name, "output_tokens": len(tokens["plain"]), "plain_tok_s": median["plain"],
               **{m: median[m] / median["plain"] for m in MODES[1:]},
               "prediction_over_ngram": median["prediction"] / median["ngram"],
               "accepted_per_round": {m: taken[m] / args.rounds for m in MODES[1:]}, "rates": rates,
               "greedy_identical": all(tokens[m] == tokens["plain"] for m in MODES)}
        print(f"{name}: plain {median['plain']:.1f} tok/s, ngram {row['ngram']:.2f}x, prediction "
              f"{row['prediction']:.2f}x, prediction-only {row['prediction-only']:.2f}x, "
              f"same: {row['greedy_identical']}", flush=True)
        rows.append(row)
    common.print_table(
        ["case", "tokens", "plain tok/s", "ngram", "prediction", "pred-only", "pred/ngram", "accepted ngram",
         "accepted pred", "same"],
        [[r["case"], r["output_tokens"], r["plain_tok_s"], r["ngram"], r["prediction"], r["prediction-only"],
          r["prediction_over_ngram"], r["accepted_per_round"]["ngram"], r["accepted_per_round"]["prediction"],
          r["greedy_identical"]] for r in rows])
    geo = {m: statistics.geometric_mean([r[m] for r in rows]) for m in MODES[1:]}
    print("geometric mean over the cases: " + ", ".join(f"{m} {g:.2f}x" for m, g in geo.items()) + " plain")
    name = args.model + (f"_ctx{args.context_tokens}" if args.context_tokens else "") + (
        f"_{args.tag}" if args.tag else "")
    common.save_json("predicted_outputs", name, {"args": vars(args), "results": rows, "geomean": geo})


if __name__ == "__main__":
    main()
