"""Asynchronous scheduling (engine/pipeline.py) against synchronous steps, on one engine in one process.

The engine runs with `async_scheduling="on"`, so every step executes on its device thread either way;
rounds of --steps decode steps alternate between overlapped steps (step N + 1 scheduled and built
while step N runs) and synchronous ones (`EngineCore.overlap_steps = False`: schedule, run, update in
turn), on the same running requests, so machine drift hits both alike. A step's figure is the wall
time of `LLMEngine.step()` (output processing included), median over all rounds:

    speed-up = synchronous ms / overlapped ms

First, greedy outputs of both modes (8 prompts, 24 tokens, batched) are compared token for token.
On a CPU the overlapped host work runs beside the compute threads: with as many compute threads as
cores it takes a core from them, so run it with --threads below the core count to see the overlap
itself (the host's share of a step, `benchmarks/host_overhead.py`, is the most it can save).

    flock /tmp/tokenmill-bench.lock python benchmarks/async_scheduling.py --model smollm2-135m --threads 1
    flock /tmp/tokenmill-bench.lock python benchmarks/async_scheduling.py --model smollm2-135m --threads 2
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import common


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=common.MODELS, default="smollm2-135m")
    p.add_argument("--quantization", default="auto", choices=["none", "auto"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=16, help="steps per round")
    p.add_argument("--rounds", type=int, default=5, help="overlapped/synchronous alternations per batch size")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quiet-wait-s", type=float, default=30.0)
    p.add_argument("--tag", default="")
    return p.parse_args()


def greedy_identical(llm: Any) -> bool:
    from tokenmill.engine.request import SamplingParams

    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    prompts = [f"Question {i}: what is {i} times {i + 3}? Answer:" for i in range(8)]
    tokens = {}
    for overlap in (False, True):
        llm.core.overlap_steps = overlap
        tokens[overlap] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return tokens[False] == tokens[True]


def decode_rounds(llm: Any, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.engine.request import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=2 * args.rounds * args.steps + 16, ignore_eos=True, temperature=0.0)
    vocab = llm.core.arch.vocab_size
    for i in range(batch):
        prompt = [1 + (i * 131 + j * 17) % (vocab - 2) for j in range(args.prompt_len)]
        engine.add_request(f"d{batch}-{i}", engine.encode(prompt), params)
    while llm.core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                            for r in llm.core.scheduler.running):
        engine.step()
    step_s: dict[str, list[float]] = {"sync": [], "overlap": []}
    for _ in range(args.rounds):
        for mode in ("sync", "overlap"):
            llm.core.overlap_steps = mode == "overlap"
            engine.step()  # the switch: drains or fills the pipeline
            for _ in range(args.steps):
                started = time.perf_counter()
                engine.step()
                step_s[mode].append(time.perf_counter() - started)
    for request_id in list(llm.core.scheduler.requests):
        engine.abort(request_id)
    while engine.has_unfinished:
        engine.step()
    return {mode: {"step_ms": common.Stats.of(values).median * 1e3, "steps": len(values)}
            for mode, values in step_s.items()}


def main() -> None:
    from tokenmill.llm import LLM

    args = parse_args()
    common.pin_threads(args.threads)
    llm = LLM(args.model, quantization=args.quantization, num_threads=args.threads, async_scheduling="on",
              max_num_seqs=max(args.batch_sizes), enable_prefix_caching=False, kv_cache_bytes=1 << 30)
    identical = greedy_identical(llm)
    shapes = {}
    for batch in args.batch_sizes:
        shapes[f"decode batch={batch}"] = common.after_quiet(lambda b=batch: decode_rounds(llm, b, args),
                                                             args.quiet_wait_s)
    print(f"greedy outputs identical overlapped and synchronous: {identical}")
    cpu = common.environment()["cpu"]
    print(f"{args.model} --quantization {args.quantization}, {args.threads} compute threads, cpu: {cpu}")
    rows = [[key, f"{s['sync']['step_ms']:.2f}", f"{s['overlap']['step_ms']:.2f}",
             f"{s['sync']['step_ms'] / s['overlap']['step_ms']:.3f}x", f"{s['others_cores']:.2f}"]
            for key, s in shapes.items()]
    common.print_table(["shape", "sync step ms", "overlapped step ms", "speed-up", "others cores"], rows)
    suffix = f"threads{args.threads}" + (f"_{args.tag}" if args.tag else "")
    common.save_json("async_scheduling", f"{args.model}_{suffix}",
                     {"args": vars(args), "greedy_identical": identical, "shapes": shapes})


if __name__ == "__main__":
    main()
