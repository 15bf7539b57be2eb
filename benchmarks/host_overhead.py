"""Host overhead of an engine step: everything but the model's forward and lm_head, old path vs new.

One process, one engine per (model, quantization). For each shape (decode at each --batch-sizes,
one --prefill-len prefill) the script alternates rounds of --steps steps on the previous host path
(block tables rebuilt from Python lists every step, dense masks for every group, every sampling
row through the per-request path) and on the current one (persistent block tables updated
incrementally, no mask for the decode kernel's group, batched sampling for plain rows), on the
same requests, so machine drift hits both alike. Every step is timed per phase by the engine's
PhaseTimer (engine/profiling.py):

    host = step - forward - logits        host fraction = host / step

Figures are medians over all rounds; ratios are old / new in the same run. First, greedy outputs
of both paths (8 prompts, 24 tokens, batched) are compared token for token.

`--compare glue` puts the native decoder-layer glue against the ATen ops it replaced, on the same
engine: RMSNorm with the fused residual add and RoPE (glue_kernels.cpp), the SwiGLU silu·mul and the
KV write (cpu_kernels.cpp). Outputs then agree to float rounding, not bit for bit (the greedy check
says whether a token moved); the step time is the figure, since the glue runs inside the forward.
Both sides then run the Python layers (the native stack off).

`--compare stack` puts the one-call native decoder stack (models/native_stack.py) against the
Python layers driving the same kernels: bit-identical outputs, so the greedy check must hold; the
step time is the figure (the prefill shape runs the Python layers on both sides).

    flock /tmp/tokenmill-bench.lock python benchmarks/host_overhead.py --model smollm2-135m --quantization none
    flock /tmp/tokenmill-bench.lock python benchmarks/host_overhead.py --compare glue --quantization auto \
        --prefill-len 0
    flock /tmp/tokenmill-bench.lock python benchmarks/host_overhead.py --compare stack --quantization auto \
        --prefill-len 0
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import common


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=common.MODELS, default="smollm2-135m")
    p.add_argument("--quantization", default="none", choices=["none", "auto"])
    p.add_argument("--compare", default="host", choices=["host", "glue", "stack"],
                   help="host: the old host path vs the new; glue: ATen glue ops vs the native glue kernels; "
                        "stack: the Python layers vs the one-call native decoder stack")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prefill-len", type=int, default=512, help="0: no prefill shape")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt of each decoding request")
    p.add_argument("--steps", type=int, default=8, help="steps per round")
    p.add_argument("--rounds", type=int, default=3, help="old/new alternations per shape")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quiet-wait-s", type=float, default=30.0)
    return p.parse_args()


def set_path(llm: Any, new: bool) -> None:
    stack = llm.core.runner.model.native_stack
    if COMPARE[0] == "stack":
        if stack is None:
            raise SystemExit("this model has no native decoder stack (see models/native_stack.py)")
        stack.enabled = new
        return
    if stack is not None:
        stack.enabled = False  # the other comparisons are about the Python layers' paths
    if COMPARE[0] == "glue":
        set_glue(llm, new)
        return
    runner = llm.core.runner
    runner.persistent_inputs = new
    runner.sampler.fast_path = new


COMPARE = ["host"]  # set by main() from --compare
_GLUE: dict[int, tuple[Any, str, Any]] = {}  # id(holder, name) → (holder, attribute, native module)


def set_glue(llm: Any, native: bool) -> None:
    """Point every layer's glue hook at its native kernel or at None (the ATen ops), remembering the
    kernels the load chose so they can be put back."""
    if not _GLUE:
        model, runner = llm.core.runner.model, llm.core.runner
        holders: list[tuple[Any, str]] = [(model.norm, "native")]
        for layer in model.layers:
            holders += [(layer.input_layernorm, "native"), (layer.post_attention_layernorm, "native"),
                        (layer, "rope_kernel"), (layer, "silu_mul_kernel")]
        holders += [(cache, "writer") for cache in runner.kv_caches]
        for holder, name in holders:
            _GLUE[hash((id(holder), name))] = (holder, name, getattr(holder, name))
    for holder, name, module in _GLUE.values():
        setattr(holder, name, module if native else None)


def timed_steps(llm: Any, num_steps: int) -> list[dict[str, Any]]:
    """Run steps with the phase timer on; per step: wall time and phases (seconds)."""
    engine, timer = llm.engine, llm.core.timer
    records = []
    for _ in range(num_steps):
        if not engine.has_unfinished:
            break
        timer.enabled = True
        timer.take()
        started = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - started
        timer.enabled = False
        phases, shape = timer.take()
        records.append({"step_s": elapsed, "phases": phases, "shape": None if shape is None else shape.key})
    return records


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    def med(values: list[float]) -> float:
        return common.Stats.of(values).median if values else 0.0

    step = med([r["step_s"] for r in records])
    forward = med([r["phases"].get("forward", 0.0) + r["phases"].get("logits", 0.0) for r in records])
    host = med([r["step_s"] - r["phases"].get("forward", 0.0) - r["phases"].get("logits", 0.0) for r in records])
    names = sorted({k for r in records for k in r["phases"]})
    return {"steps": len(records), "step_ms": step * 1e3, "forward_ms": forward * 1e3, "host_ms": host * 1e3,
            "host_fraction": host / step if step else 0.0,
            "phases_ms": {k: med([r["phases"].get(k, 0.0) for r in records]) * 1e3 for k in names}}


def decode_shape(llm: Any, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.engine.request import SamplingParams

    engine = llm.engine
    total_steps = 2 * args.rounds * args.steps + 4
    params = SamplingParams(max_tokens=total_steps + 8, ignore_eos=True, temperature=0.0)
    vocab = llm.core.arch.vocab_size
    prompts = [[1 + (i * 131 + j * 17) % (vocab - 2) for j in range(args.prompt_len)] for i in range(batch)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{batch}-{i}", engine.encode(prompt), params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in llm.core.scheduler.running) \
            or llm.core.scheduler.waiting:
        engine.step()
    for _ in range(2):
        engine.step()
    rounds: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    for _ in range(args.rounds):
        for label in ("old", "new"):
            set_path(llm, label == "new")
            rounds[label] += timed_steps(llm, args.steps)
    set_path(llm, True)
    requests = list(llm.core.scheduler.requests.values())
    outputs = {r.request_id: r.output_token_ids for r in requests}
    for r in requests:
        engine.abort(r.request_id)
    return {"old": summarize(rounds["old"]), "new": summarize(rounds["new"]), "outputs": outputs}


def prefill_shape(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.engine.request import SamplingParams

    engine = llm.engine
    vocab = llm.core.arch.vocab_size
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    rounds: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    n = 0
    for _ in range(args.rounds):
        for label in ("old", "new"):
            set_path(llm, label == "new")
            for _ in range(max(1, args.steps // 4)):
                prompt = [1 + (n * 7919 + j * 31) % (vocab - 2) for j in range(args.prefill_len)]  # no cache hits
                n += 1
                engine.add_request(f"p{n}", engine.encode(prompt), params)
                rounds[label] += timed_steps(llm, 1)
                while engine.has_unfinished:
                    engine.step()
    set_path(llm, True)
    return {"old": summarize(rounds["old"]), "new": summarize(rounds["new"])}


def greedy_identical(llm: Any) -> bool:
    from tokenmill.engine.request import SamplingParams

    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    prompts = [f"Question {i}: what is {i} times {i + 3}? Answer:" for i in range(8)]
    texts = {}
    for new in (False, True):
        set_path(llm, new)
        texts[new] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    set_path(llm, True)
    return texts[False] == texts[True]


def run_model(args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    from tokenmill.llm import LLM

    common.pin_threads(args.threads)
    llm = LLM(args.model, quantization=args.quantization, num_threads=args.threads,
              max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=max(2048, args.prefill_len),
              enable_prefix_caching=False, kv_cache_bytes=1 << 30)
    shapes: dict[str, Any] = {}
    identical = greedy_identical(llm)
    for batch in args.batch_sizes:
        shapes[f"decode batch={batch}"] = common.after_quiet(lambda b=batch: decode_shape(llm, b, args),
                                                             args.quiet_wait_s)
    if args.prefill_len:
        shapes[f"prefill {args.prefill_len}"] = common.after_quiet(lambda: prefill_shape(llm, args),
                                                                   args.quiet_wait_s)
    return identical, shapes


def main() -> None:
    args = parse_args()
    COMPARE[0] = args.compare
    identical, shapes = run_model(args)
    rows = []
    old_name, new_name = {"glue": ("ATen glue ops", "native glue kernels"),
                          "stack": ("Python layers", "native decoder stack")}.get(
        args.compare, ("old host path", "current host path"))
    print(f"old = {old_name}, new = {new_name}")
    print(f"greedy outputs identical on both paths: {identical}")
    for key, s in shapes.items():
        old, new = s["old"], s["new"]
        rows.append([key, f"{old['step_ms']:.1f}", f"{new['step_ms']:.1f}", f"{old['step_ms'] / new['step_ms']:.2f}x",
                     f"{new['forward_ms']:.1f}",
                     f"{old['host_ms']:.2f}", f"{new['host_ms']:.2f}",
                     f"{old['host_ms'] / new['host_ms']:.2f}x" if new["host_ms"] else "-",
                     f"{old['host_fraction']:.1%}", f"{new['host_fraction']:.1%}", f"{s['others_cores']:.2f}"])
    cpu = common.environment()["cpu"]
    print(f"{args.model} --quantization {args.quantization}, {args.threads} threads, cpu: {cpu}")
    common.print_table(["shape", "old step ms", "new step ms", "step old/new", "forward ms", "old host ms",
                        "new host ms",
                        "host old/new", "old host %", "new host %", "others cores"], rows)
    for key, s in shapes.items():
        print(f"{key} new-path phases (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in s["new"]["phases_ms"].items()))
    payload = {"args": vars(args), "greedy_identical": identical, "shapes": shapes}
    suffix = "" if args.compare == "host" else f"_{args.compare}"
    common.save_json("host_overhead", f"{args.model}_{args.quantization}{suffix}", payload)


if __name__ == "__main__":
    main()
