"""torch.compile on CPU (models/compiled.py): eager vs compiled decoder stack, in one run.

One process and one engine per --quantization mode (each built with `compile="on"`); the variants
are switched on that engine between rounds, so machine drift hits them alike:

    eager       the engine as shipped: the native decode stack for decode steps it takes, the Python
                layers with native glue kernels for the rest
    compiled    the same, with the compiled stack for the steps the native stack does not take
    python/*    decode with the native stack off: the Python layers (native glue) against the
                compiled stack (Inductor's fused ATen glue) for every decode step

Shapes: a --prefill-len token prefill (time per step) and decode at each --batch-sizes (tokens/s).
Ratios are compiled / eager time (below 1: compiled faster). Greedy tokens of both variants are
compared first. Compile time is measured in two child processes sharing a fresh Inductor cache:
the first compiles cold, the second finds the FX graph cache warm (Dynamo still re-traces).

    flock /tmp/tokenmill-bench.lock python benchmarks/compile_cpu.py --quantization auto none
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import common


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Gemma 3 has no native decode stack: every one of its steps takes the compiled path when on.
    p.add_argument("--model", choices=(*common.MODELS, "gemma3-270m"), default="smollm2-135m")
    p.add_argument("--quantization", nargs="+", default=["auto", "none"], choices=["auto", "none", "q8", "q4"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=64, help="prompt of each decoding request")
    p.add_argument("--steps", type=int, default=8, help="decode steps per round")
    p.add_argument("--prefills", type=int, default=2, help="prefill steps per round")
    p.add_argument("--rounds", type=int, default=3, help="alternations of the variants per shape")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quiet-wait-s", type=float, default=30.0)
    p.add_argument("--compile-time-child", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def make_llm(args: argparse.Namespace, quantization: str) -> Any:
    from tokenmill.llm import LLM

    common.pin_threads(args.threads)
    return LLM(args.model, quantization=quantization, num_threads=args.threads, compile="on",
               max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=max(2048, args.prefill_len),
               enable_prefix_caching=False, kv_cache_bytes=1 << 30)


_STACKS: dict[int, Any] = {}


def set_variant(llm: Any, compiled: bool, native: bool = True) -> None:
    model = llm.core.runner.model
    stack = _STACKS.setdefault(id(model), model.compiled)
    if stack is None:
        raise SystemExit("the model has no compiled stack (see the log: torch.compile declined or failed)")
    if stack.failed:
        raise SystemExit("the compiled stack failed (see the warning above)")
    model.compiled = stack if compiled else None
    if model.native_stack is not None:
        model.native_stack.enabled = native


def timed_steps(llm: Any, num_steps: int) -> list[float]:
    times = []
    for _ in range(num_steps):
        if not llm.engine.has_unfinished:
            break
        started = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - started)
    return times


def prompt_ids(llm: Any, n: int, length: int) -> Any:
    vocab = llm.core.arch.vocab_size
    # distinct prompts: no prefix-cache hits
    return llm.engine.encode([1 + (n * 7919 + j * 31) % (vocab - 2) for j in range(length)])


def prefill_shape(llm: Any, args: argparse.Namespace, variants: dict[str, tuple[bool, bool]]) -> dict[str, Any]:
    from tokenmill.engine.request import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    times: dict[str, list[float]] = {v: [] for v in variants}
    n = 0
    for r in range(args.rounds + 1):  # round 0 warms up (compiles) and is not kept
        for label, variant in variants.items():
            set_variant(llm, *variant)
            for _ in range(args.prefills if r else 1):
                n += 1
                llm.engine.add_request(f"p{n}", prompt_ids(llm, n, args.prefill_len), params)
                step = timed_steps(llm, 1)
                if r:
                    times[label] += step
                while llm.engine.has_unfinished:
                    llm.engine.step()
    return {label: common.Stats.of(t).median * 1e3 for label, t in times.items()}


def decode_shape(llm: Any, batch: int, args: argparse.Namespace,
                 variants: dict[str, tuple[bool, bool]]) -> dict[str, Any]:
    from tokenmill.engine.request import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=(args.rounds + 1) * len(variants) * args.steps + 8, ignore_eos=True,
                            temperature=0.0)
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", prompt_ids(llm, 10_000 + i, args.prompt_len), params)
    while llm.core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                            for r in llm.core.scheduler.running):
        engine.step()
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds + 1):
        for label, variant in variants.items():
            set_variant(llm, *variant)
            step = timed_steps(llm, args.steps if r else 2)
            if r:
                times[label] += step
    for request_id in list(llm.core.scheduler.requests):
        engine.abort(request_id)
    return {label: batch / common.Stats.of(t).median for label, t in times.items()}  # tokens/s


def greedy_identical(llm: Any) -> bool:
    from tokenmill.engine.request import SamplingParams

    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    prompts = [f"Question {i}: what is {i} times {i + 3}? Answer:" for i in range(8)]
    tokens = {}
    for compiled in (False, True):
        set_variant(llm, compiled, native=False)  # every step through the variant under test
        tokens[compiled] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    set_variant(llm, True)
    return tokens[False] == tokens[True]


def compile_time_child(args: argparse.Namespace) -> None:
    """In a child process: seconds of the first compiled prefill and decode step over an eager one."""
    from tokenmill.engine.request import SamplingParams

    llm = make_llm(args, args.compile_time_child)
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
    result = {}
    for label, compiled in (("eager", False), ("compiled", True)):
        set_variant(llm, compiled, native=False)
        llm.engine.add_request(f"c-{label}", prompt_ids(llm, 777 if compiled else 778, args.prefill_len), params)
        prefill, decode = timed_steps(llm, 2)
        result[label] = {"prefill_s": prefill, "decode_s": decode}
    print(json.dumps(result))


def compile_times(args: argparse.Namespace, quantization: str) -> dict[str, Any]:
    times: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": str(args.threads)}
        for label in ("cold", "warm"):
            argv = [sys.executable, __file__, "--model", args.model, "--compile-time-child", quantization,
                    "--prefill-len", str(args.prefill_len), "--threads", str(args.threads)]
            started = time.perf_counter()
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
            run = json.loads(proc.stdout.strip().splitlines()[-1])
            c, e = run["compiled"], run["eager"]
            times[label] = {"process_s": time.perf_counter() - started,
                            "prefill_compile_s": c["prefill_s"] - e["prefill_s"],
                            "decode_compile_s": c["decode_s"] - e["decode_s"], "steps": run}
    return times


def run_mode(args: argparse.Namespace, quantization: str) -> dict[str, Any]:
    llm = make_llm(args, quantization)
    result: dict[str, Any] = {"linear_methods": common.weight_bytes(llm.core.runner.model)["dtypes"],
                              "native_stack": llm.core.runner.model.native_stack is not None,
                              "greedy_identical": greedy_identical(llm)}
    shipped = {"eager": (False, True), "compiled": (True, True)}
    python = {"python/eager": (False, False), "python/compiled": (True, False)}
    if args.prefill_len:
        result[f"prefill {args.prefill_len} ms"] = common.after_quiet(lambda: prefill_shape(llm, args, shipped),
                                                                      args.quiet_wait_s)
    for batch in args.batch_sizes:
        result[f"decode batch={batch} tok/s"] = common.after_quiet(
            lambda b=batch: decode_shape(llm, b, args, {**shipped, **python}), args.quiet_wait_s)
    result["compile_time"] = compile_times(args, quantization)
    return result


def main() -> None:
    args = parse_args()
    if args.compile_time_child:
        compile_time_child(args)
        return
    results = {q: run_mode(args, q) for q in args.quantization}
    cpu = common.environment()["cpu"]
    print(f"{args.model}, {args.threads} threads, cpu: {cpu}")
    rows = []
    for q, r in results.items():
        for shape, v in r.items():
            if shape.startswith("prefill"):
                rows.append([q, shape, "eager / compiled", f"{v['eager']:.1f} / {v['compiled']:.1f}",
                             f"{v['compiled'] / v['eager']:.2f}", f"{v['others_cores']:.2f}"])
            elif shape.startswith("decode"):
                for a, b in (("eager", "compiled"), ("python/eager", "python/compiled")):
                    rows.append([q, shape, f"{a} / {b}", f"{v[a]:.1f} / {v[b]:.1f}", f"{v[a] / v[b]:.2f}",
                                 f"{v['others_cores']:.2f}"])
        ct = r["compile_time"]
        print(f"{q}: greedy identical {r['greedy_identical']}, native stack {r['native_stack']}, linears "
              f"{r['linear_methods']}; compile s cold: prefill {ct['cold']['prefill_compile_s']:.1f} decode "
              f"{ct['cold']['decode_compile_s']:.1f}; warm (FX cache): prefill {ct['warm']['prefill_compile_s']:.1f} "
              f"decode {ct['warm']['decode_compile_s']:.1f}")
    common.print_table(["quantization", "shape", "variants", "values", "time compiled/eager", "others cores"], rows)
    common.save_json("compile_cpu", args.model, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
