"""Peak resident memory of tokenmill while it serves many concurrent requests.

Reads VmRSS / VmHWM from /proc/self/status. The high-water mark is reset (write 5 to
/proc/self/clear_refs) before loading and again before generating, so the report separates:

  baseline        Python + torch imported, nothing loaded
  load peak       the highest RSS while the checkpoint is read and converted
  after load      RSS with the model resident (weights + tokenizer; KV pages not yet touched)
  generate peak   the highest RSS while --num-prompts requests run concurrently

A background thread samples RSS every --sample-ms for the plot.

    python benchmarks/peak_memory.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import gc
import threading
import time
from typing import Any

import common

MB = 1e6
_BYTE_FIGURES = ("baseline_rss", "load_peak_hwm", "after_load_rss", "generate_peak_hwm", "after_generate_rss",
                 "weight_bytes", "kv_bytes_needed", "kv_bytes_reserved_virtual")


def status_bytes(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field_name} missing from /proc/self/status")


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False when the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssSampler:
    """Samples (seconds since start, RSS bytes, phase) on a daemon thread."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.phase = "baseline"
        self.samples: list[tuple[float, int, str]] = []
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic() - self._started, status_bytes("VmRSS"), self.phase))
            self._stop.wait(self.interval_s)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.workload_arguments(p)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--quantization", default=None, choices=["auto", "none", "q8", "q4"],
                   help="weights (default: the engine's); auto/q8/q4 reuse $TOKENMILL_HOME/repack when warm")
    p.add_argument("--sample-ms", type=float, default=20.0)
    return p.parse_args()


def measure(args: argparse.Namespace, sampler: RssSampler) -> dict[str, Any]:
    from tokenmill.engine.request import SamplingParams
    from tokenmill.llm import LLM

    gc.collect()
    figures: dict[str, Any] = {"baseline_rss": status_bytes("VmRSS"), "hwm_reset_supported": reset_peak()}
    sampler.phase = "load"
    # Engine defaults (KV budget a fraction of free memory, lazily zeroed): the figure is what a user gets.
    quant = {} if args.quantization is None else {"quantization": args.quantization}
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, max_num_seqs=args.num_prompts, **quant)
    prompts = common.build_prompts(llm.tokenizer.encode, args.num_prompts, args.prompt_len,
                                   common.prompt_bos(llm.tokenizer))
    gc.collect()
    figures |= {"load_peak_hwm": status_bytes("VmHWM"), "after_load_rss": status_bytes("VmRSS")}
    reset_peak()
    sampler.phase = "generate"
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    with common.Timer() as t:
        outs = llm.generate(prompts, params)
    sampler.phase = "done"
    figures |= {"generate_peak_hwm": status_bytes("VmHWM"), "after_generate_rss": status_bytes("VmRSS"),
                "generate_s": t.elapsed_s, "num_output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
    figures |= model_budget(llm, args)
    return figures


def model_budget(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """What the engine should need: weights as stored, plus the KV of every token in flight."""
    model = llm.core.runner.model
    weights = common.weight_bytes(model)
    embed_extra = 0 if weights["lm_head_tied_to_embedding"] else weights["embedding_bytes"]
    kv_token = common.kv_bytes_per_token(llm.core.arch, model.dtype)
    caches = llm.core.runner.kv_caches
    return {
        "weight_bytes": weights["bytes"] + embed_extra,
        "kv_bytes_needed": kv_token * args.num_prompts * (args.prompt_len + args.output_len),
        "kv_bytes_reserved_virtual": sum(layer.nbytes for layer in caches),
        "weight_dtypes": weights["dtypes"],
    }


def report(args: argparse.Namespace, f: dict[str, Any]) -> None:
    print(f"\nmodel {args.model}: {args.num_prompts} concurrent requests, {args.prompt_len}-token prompts, "
          f"{args.output_len} outputs each, {f['weight_dtypes']} weights ({args.quantization or 'default'} mode)")
    rows = [
        ("RSS baseline (torch imported)", f["baseline_rss"] / MB),
        ("VmHWM during load", f["load_peak_hwm"] / MB),
        ("RSS after load", f["after_load_rss"] / MB),
        ("VmHWM during generate (peak)", f["generate_peak_hwm"] / MB),
        ("RSS after generate", f["after_generate_rss"] / MB),
        ("peak over baseline", (f["generate_peak_hwm"] - f["baseline_rss"]) / MB),
        ("weights as stored", f["weight_bytes"] / MB),
        ("KV needed by the requests", f["kv_bytes_needed"] / MB),
        ("KV reserved (virtual, lazily zeroed)", f["kv_bytes_reserved_virtual"] / MB),
    ]
    common.print_table(["figure", "MB"], rows)
    if not f["hwm_reset_supported"]:
        print("note: this kernel refused to reset VmHWM: the generate peak includes the load peak")
    print(f"generation: {f['num_output_tokens']} tokens in {f['generate_s']:.1f} s")


def plot(args: argparse.Namespace, samples: list[tuple[float, int, str]], f: dict[str, Any]) -> None:
    fig, ax, path = common.new_figure("peak_memory", args.model)
    colors = {"baseline": "#8d99ae", "load": "#e76f51", "generate": "#2a9d8f", "done": "#8d99ae"}
    for phase, color in colors.items():
        points = [(t, rss / MB) for t, rss, p in samples if p == phase]
        if points:
            ax.plot(*zip(*points, strict=True), color=color, lw=1.2, label=phase if phase != "done" else None)
    ax.axhline(f["generate_peak_hwm"] / MB, color="#264653", ls="--",
               label=f"generate peak {f['generate_peak_hwm'] / MB:.0f} MB")
    ax.set_xlabel("s")
    ax.set_ylabel("RSS (MB)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"resident memory, {args.model}, {args.num_prompts} concurrent requests")
    ax.legend()
    common.save_figure(fig, path)


def main() -> None:
    args = parse_args()
    common.pin_threads(args.threads)
    with RssSampler(args.sample_ms / 1e3) as sampler:
        figures = measure(args, sampler)
    report(args, figures)
    series = [(round(t, 3), rss, p) for t, rss, p in sampler.samples]
    in_mb = {k: figures[k] / MB for k in _BYTE_FIGURES}
    tag = args.model if args.quantization is None else f"{args.model}-{args.quantization}"
    common.save_json("peak_memory", tag, {"config": vars(args), "figures_mb": in_mb,
                                                 "figures": figures, "rss_samples": series})
    plot(args, sampler.samples, figures)


if __name__ == "__main__":
    main()
