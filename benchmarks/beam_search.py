"""What beam search costs (engine/beam_search.py): seconds per search of width W against a greedy answer of
the same length, same engine, and against transformers' generate(num_beams=W) on the same prompts.

Each step of a search scores every live beam as its own one-token request (the prompt, then the beam): the
prefix cache serves the full blocks, so a step is W prefills of the beam's last partial block (up to the
block size + 1 tokens each) where a greedy step is one decode row. Rounds alternate the modes on the same
chat prompts; every answer runs its --tokens (ignore_eos), so lengths match. transformers runs once per
prompt and width (fp32 weights, the reference implementation; --no-transformers skips it). Printed and
saved: median seconds per answer, beam / greedy, and transformers / tokenmill.

    flock /tmp/tokenmill-bench.lock python benchmarks/beam_search.py --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import common

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain in two sentences what a hash map is."]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=common.MODELS, default="qwen2.5-coder-0.5b")
    p.add_argument("--widths", type=int, nargs="+", default=[2, 4])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--tag", default="")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    from tokenmill import LLM, SamplingParams
    from tokenmill.engine.beam_search import BeamSearchParams

    llm = LLM(args.model, num_threads=args.threads)
    prompts = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                                      add_generation_prompt=True),
                                    add_special_tokens=False) for text in PROMPTS]
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    modes: dict[str, Any] = {"greedy": lambda p: llm.generate([p], greedy)}
    for width in args.widths:
        params = BeamSearchParams(width, args.tokens, ignore_eos=True)
        modes[f"beam{width}"] = lambda p, params=params: llm.beam_search([p], params)
    for run in modes.values():  # warm-up: kernels and the prompts' cached blocks for every mode
        run(prompts[0])
    seconds: dict[str, list[float]] = {name: [] for name in modes}
    names = list(modes)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for prompt in prompts:
                started = time.perf_counter()
                modes[name](prompt)
                seconds[name].append(time.perf_counter() - started)
    rows: dict[str, Any] = {name: {"median_s": statistics.median(s)} for name, s in seconds.items()}
    for width in args.widths:
        rows[f"beam{width}"]["over_greedy"] = rows[f"beam{width}"]["median_s"] / rows["greedy"]["median_s"]
    if not args.no_transformers:
        for width, ref_s in _transformers(args.model, prompts, args.widths, args.tokens, args.threads).items():
            rows[f"beam{width}"]["transformers_s"] = ref_s
            rows[f"beam{width}"]["transformers_over_tokenmill"] = ref_s / rows[f"beam{width}"]["median_s"]
    for name, row in rows.items():
        print(f"{name:8s} " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()))
    common.save_json("beam_search", args.model + (f"_{args.tag}" if args.tag else ""),
                     {"config": vars(args), "rows": rows})


def _transformers(model: str, prompts: list[list[int]], widths: list[int], tokens: int,
                  threads: int) -> dict[int, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from tokenmill.models.resolve import resolve_model

    torch.set_num_threads(threads)
    path = resolve_model(model).path
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    out: dict[int, float] = {}
    for width in widths:
        times = []
        for prompt in prompts:
            started = time.perf_counter()
            hf.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens, num_beams=width,
                        do_sample=False, pad_token_id=0)
            times.append(time.perf_counter() - started)
        out[width] = statistics.median(times)
    return out


if __name__ == "__main__":
    main()
