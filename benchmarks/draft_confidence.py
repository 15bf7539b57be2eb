"""How well a draft model's confidence predicts that the target accepts its guess (offline).

The target (--target) answers each prompt greedily; the draft (--draft, on --draft-quantization
weights) then reads prompt + answer in one forward (teacher forcing) and, at every answer position,
its top-1 token and that token's probability p are compared with the target's token. Printed: per
bin of p (the controller's CONFIDENCE_EDGES), how many guesses fell there and the fraction equal to
the target's token, for the chat prompts and the code edits apart. This is what the draft gate's
per-bin priors rest on (engine/spec/controller.py, docs/speculative.md).

    flock /tmp/tokenmill-bench.lock python benchmarks/draft_confidence.py
"""

from __future__ import annotations

import argparse
import itertools
import math
from typing import Any

import common  # type: ignore[import-not-found]
from spec_prompts import CHATS, edit_prompt  # type: ignore[import-not-found]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--draft-quantization", default="q4")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def answers(args: argparse.Namespace) -> dict[str, list[tuple[list[int], list[int]]]]:
    """{kind: [(prompt ids, the target's greedy answer ids)]}."""
    from tokenmill import LLM, SamplingParams

    target = LLM(args.target, num_threads=args.threads, num_kv_blocks=256, max_model_len=1024)
    conversations = {"chat": [[{"role": "user", "content": c}] for c in CHATS],
                     "code-edit": [edit_prompt(i) for i in range(2)]}
    out: dict[str, list[tuple[list[int], list[int]]]] = {}
    for kind, convs in conversations.items():
        for conv in convs:
            prompt = target.tokenizer.encode(target.tokenizer.apply_chat_template(conv, add_generation_prompt=True))
            [result] = target.generate([prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
            out.setdefault(kind, []).append((prompt, list(result.outputs[0].token_ids)))
    return out


def guesses(args: argparse.Namespace, pairs: dict[str, list[tuple[list[int], list[int]]]]) -> dict[str, list[Any]]:
    """{kind: [(p, draft's top-1 == target's token)]} over every answer position."""
    from tokenmill import LLM, SamplingParams

    draft = LLM(args.draft, num_threads=args.threads, num_kv_blocks=256, max_model_len=1024,
                quantization=args.draft_quantization)
    out: dict[str, list[Any]] = {}
    for kind, items in pairs.items():
        for prompt, answer in items:
            params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
            [result] = draft.generate([prompt + answer], params)
            logprobs = result.prompt_logprobs  # entry i: the distribution over token i given tokens < i
            assert logprobs is not None
            for i, token in enumerate(answer):
                entry = logprobs[len(prompt) + i]
                assert entry is not None
                top_token, top_logprob = entry.top[0]
                out.setdefault(kind, []).append((math.exp(top_logprob), top_token == token))
    return out


def main() -> None:
    from tokenmill.engine.spec.controller import CONFIDENCE_EDGES

    args = parse_args()
    common.pin_threads(args.threads)
    by_kind = guesses(args, answers(args))
    edges = (0.0, *CONFIDENCE_EDGES, 1.0 + 1e-9)
    rows, table = [], []
    for kind, pairs in by_kind.items():
        for b, (lo, hi) in enumerate(itertools.pairwise(edges)):
            inside = [ok for p, ok in pairs if lo <= p < hi]
            rate = sum(inside) / len(inside) if inside else None
            rows.append({"kind": kind, "bin": b, "p_from": lo, "p_to": min(hi, 1.0), "guesses": len(inside),
                         "accepted": rate})
            table.append([kind, f"[{lo:.2f}, {min(hi, 1.0):.2f})", len(inside), "-" if rate is None else rate])
        table.append([kind, "all", len(pairs), sum(ok for _, ok in pairs) / max(len(pairs), 1)])
    common.print_table(["prompts", "draft p", "guesses", "target agrees"], table)
    common.save_json("draft_confidence", f"{args.draft}_for_{args.target}", {"args": vars(args), "bins": rows})


if __name__ == "__main__":
    main()
