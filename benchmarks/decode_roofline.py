"""Batch-1 decode speed as a fraction of the memory roofline.

One request (a --prompt-len prompt, --output-len tokens, greedy, EOS ignored) is driven through
`EngineCore.step()` by hand so every step is timed alone. The figure is the median time of the
decode steps (one token each; the prefill step is excluded).

    roofline s/token = weight bytes read per decode step / memory bandwidth

Weight bytes: every weight tensor of the model as the engine stores it (fused qkv, o, gate_up,
down, norms, lm_head), each tensor once; the embedding lookup reads one row and counts as 0
(unless the lm_head is tied to it, then it is counted once as the lm_head). KV-cache reads are
left out of the roofline and reported beside it. Bandwidth: a 1 GiB `dst.copy_(src)` measured
in the same run, counting read + write bytes; the median of samples taken before and after the
decode run.

    python benchmarks/decode_roofline.py --model qwen2.5-coder-0.5b [--profile-steps 20]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from typing import Any

import common


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=common.MODELS, default="smollm2-135m")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--copy-gib", type=float, default=1.0, help="size of the bandwidth probe")
    p.add_argument("--copy-repeats", type=int, default=5, help="bandwidth samples before and after the run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--profile-steps", type=int, default=20, help="decode steps to profile afterwards (0: none)")
    p.add_argument("--quiet-wait-s", type=float, default=120.0)
    p.add_argument("--attempts", type=int, default=3, help="reruns of a measurement that others disturbed")
    p.add_argument("--noise-limit", type=float, default=0.1, help="cores others may use during a valid run")
    return p.parse_args()


# ---------------------------------------------------------------- the roofline's two terms


class BandwidthProbe:
    """Bytes moved per second by a large tensor copy (read src + write dst), and by a pure read.
    Sampled before and after the decode run, so a drift of the host shows in the spread."""

    def __init__(self, gib: float) -> None:
        import torch

        self.numel = int(gib * (1 << 30)) // 4
        self.src = torch.ones(self.numel, dtype=torch.float32)  # touch every page before timing
        self.dst = torch.zeros_like(self.src)
        self.dst.copy_(self.src)
        self.copy_s: list[float] = []
        self.read_s: list[float] = []

    def sample(self, repeats: int) -> None:
        for _ in range(repeats):
            with common.Timer() as t:
                self.dst.copy_(self.src)
            self.copy_s.append(t.elapsed_s)
            with common.Timer() as t:
                self.src.sum()
            self.read_s.append(t.elapsed_s)

    def result(self) -> dict[str, Any]:
        nbytes = self.numel * 4
        copy = common.Stats.of([2 * nbytes / s for s in self.copy_s])
        read = common.Stats.of([nbytes / s for s in self.read_s])
        return {"copy_bytes_per_s": copy.median, "copy_stats": copy, "read_bytes_per_s": read.median,
                "read_stats": read, "probe_bytes": nbytes}


# ---------------------------------------------------------------- decode timing


def timed_request(llm: Any, prompt: list[int], output_len: int, name: str) -> list[tuple[int, float]]:
    """Run one request alone; (scheduled tokens, seconds) for each engine step."""
    from tokenmill.engine.loader import eos_ids
    from tokenmill.engine.request import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
    llm.core.add_request(name, prompt, params, eos_ids(llm.loaded))
    steps: list[tuple[int, float]] = []
    while llm.core.has_unfinished:
        started = time.perf_counter()
        result = llm.core.step()
        steps.append((result.stats.num_scheduled_tokens, time.perf_counter() - started))
    return steps


def profile_decode(llm: Any, prompt: list[int], num_steps: int) -> dict[str, Any]:
    """torch.profiler (ops, self CPU time) and cProfile (Python functions) over decode steps."""
    from torch.profiler import ProfilerActivity, profile

    from tokenmill.engine.loader import eos_ids
    from tokenmill.engine.request import SamplingParams

    llm.core.add_request("profiled", prompt, SamplingParams(max_tokens=2 * num_steps + 2, ignore_eos=True,
                                                            temperature=0), eos_ids(llm.loaded))
    llm.core.step()  # prefill, not profiled
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            llm.core.step()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = sum(e.self_cpu_time_total for e in ops)
    top_ops = [{"op": e.key, "calls_per_step": e.count / num_steps, "self_us_per_step": e.self_cpu_time_total
                / num_steps, "share": e.self_cpu_time_total / total_us} for e in ops[:15]]
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(num_steps):
        llm.core.step()
    profiler.disable()
    while llm.core.has_unfinished:
        llm.core.step()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
    return {"num_steps": num_steps, "torch_ops": top_ops, "cprofile_tottime": _trim_pstats(text.getvalue())}


def _trim_pstats(text: str) -> list[str]:
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    return lines[start:]


# ---------------------------------------------------------------- main


def main() -> None:
    args = parse_args()
    common.pin_threads(args.threads)
    from tokenmill.llm import LLM

    blocks = 2 * -(-(args.prompt_len + args.output_len + 64) // 16) + 8
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, max_num_seqs=4, num_kv_blocks=blocks)
    prompts = common.build_prompts(llm.tokenizer.encode, 3, args.prompt_len, common.prompt_bos(llm.tokenizer))
    model = llm.core.runner.model
    weights = common.weight_bytes(model)
    timed_request(llm, prompts[1], 16, "warmup")
    tries = iter(range(args.attempts))

    def attempt() -> tuple[dict[str, Any], list[tuple[int, float]], float]:
        llm.core.kv.reset_prefix_cache()  # every try prefills the prompt again
        noise = common.NoiseMeter()
        probe = BandwidthProbe(args.copy_gib)
        probe.sample(args.copy_repeats)
        steps = timed_request(llm, prompts[0], args.output_len, f"timed-{next(tries)}")
        probe.sample(args.copy_repeats)
        return probe.result(), steps, noise.others_cores()

    (bandwidth, steps, others), noises = common.quietest(attempt, lambda r: r[2], args.attempts, args.noise_limit,
                                                         args.quiet_wait_s)
    decode_s = [s for n, s in steps if n == 1]
    stats = common.Stats.of(decode_s)
    bw = bandwidth["copy_bytes_per_s"]
    roofline_s = weights["bytes"] / bw
    kv_tok = common.kv_bytes_per_token(llm.core.arch, model.dtype)
    mid_context = args.prompt_len + args.output_len // 2
    result = {
        "config": vars(args), "weights": weights, "bandwidth": bandwidth, "decode_step_s": stats,
        "prefill_s": [s for n, s in steps if n > 1], "num_decode_steps": len(decode_s),
        "achieved_tok_s": 1 / stats.median, "roofline_tok_s": 1 / roofline_s, "fraction_of_roofline":
        roofline_s / stats.median, "others_cores": others, "attempts_others_cores": noises,
        "kv_bytes_per_token": kv_tok, "kv_bytes_read_at_mid_context": kv_tok * mid_context,
        "effective_weight_bytes_per_s": weights["bytes"] / stats.median,
        "step_times_s": decode_s,
    }
    report(args, result)
    if args.profile_steps:
        result["profile"] = profile_decode(llm, prompts[2], args.profile_steps)
        print_profile(result["profile"])
    common.save_json("decode_roofline", args.model, result)
    plot(args.model, decode_s, roofline_s, stats.median)


def report(args: argparse.Namespace, r: dict[str, Any]) -> None:
    w, bw = r["weights"], r["bandwidth"]
    print(f"\nmodel {args.model}, batch 1, {args.prompt_len}-token prompt, {args.output_len} decode tokens, "
          f"{args.threads} threads, weights {w['dtypes']}")
    rows = [
        ("weight bytes / decode step (MB)", w["bytes"] / 1e6),
        ("KV bytes read at mid context (MB)", r["kv_bytes_read_at_mid_context"] / 1e6),
        ("copy bandwidth, read+write (GB/s)", bw["copy_bytes_per_s"] / 1e9),
        ("read-only bandwidth, sum() (GB/s)", bw["read_bytes_per_s"] / 1e9),
        ("median decode step (ms)", r["decode_step_s"].median * 1e3),
        ("p90 decode step (ms)", r["decode_step_s"].p90 * 1e3),
        ("achieved tok/s", r["achieved_tok_s"]),
        ("roofline tok/s", r["roofline_tok_s"]),
        ("fraction of roofline", r["fraction_of_roofline"]),
        ("effective weight GB/s", r["effective_weight_bytes_per_s"] / 1e9),
        ("others' CPU use meanwhile (cores)", r["others_cores"]),
    ]
    common.print_table(["figure", "value"], rows)


def print_profile(prof: dict[str, Any]) -> None:
    print(f"\ntop torch ops by self CPU time, per decode step ({prof['num_steps']} steps profiled):")
    common.print_table(["op", "calls/step", "self us/step", "share"],
                       [(o["op"], o["calls_per_step"], o["self_us_per_step"], f"{o['share']:.1%}")
                        for o in prof["torch_ops"]])
    print("\ncProfile, top Python functions by own time:")
    print("\n".join(prof["cprofile_tottime"][:22]))


def plot(model: str, decode_s: list[float], roofline_s: float, median_s: float) -> None:
    fig, ax, path = common.new_figure("decode_roofline", model)
    ax.plot(range(1, len(decode_s) + 1), [s * 1e3 for s in decode_s], lw=0.8, color="#264653", label="decode step")
    ax.axhline(median_s * 1e3, color="#e76f51", ls="--", label=f"median {median_s * 1e3:.1f} ms")
    ax.axhline(roofline_s * 1e3, color="#2a9d8f", ls="-", label=f"memory roofline {roofline_s * 1e3:.1f} ms")
    ax.set_xlabel("decode step")
    ax.set_ylabel("ms / token")
    ax.set_ylim(bottom=0)
    ax.set_title(f"batch-1 decode, {model}: {roofline_s / median_s:.0%} of the memory roofline")
    ax.legend()
    common.save_figure(fig, path)


if __name__ == "__main__":
    main()
