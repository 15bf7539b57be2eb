"""Decode speed while another process keeps a CPU busy: fixed threads against the thread governor.

One process, one engine: each round measures batch-1 and batch-B decode steps (median of the steps
where every request decodes) alone, then with a busy loop (`python -c "while True: pass"`) beside
the engine, once with the configured threads fixed (the governor off) and once with the governor
(engine/cpu_share.py) given a few seconds to see the neighbour; the two contended modes alternate
in order from round to round. Printed and saved: medians per mode and the ratios fixed / governed
under contention (> 1: the governor helps) and governed / alone.

    flock /tmp/tokenmill-bench.lock python benchmarks/cpu_contention.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Any

import common
from kernel_ab import decode_round


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", choices=common.MODELS)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64, help="tokens per request and measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--settle-s", type=float, default=3.5, help="steps run before a governed measurement")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    import torch

    from tokenmill.engine.cpu_share import build_governor
    from tokenmill.llm import LLM

    common.wait_for_quiet(60)
    llm = LLM(args.model, num_threads=args.threads, max_num_seqs=max(args.batch_sizes))
    prompt = common.build_prompts(llm.tokenizer.encode, 1, args.prompt_len, common.prompt_bos(llm.tokenizer))[0]
    core = llm.core

    def fixed() -> None:
        core.governor = None
        torch.set_num_threads(args.threads)

    def governed() -> int:
        fixed()
        core.governor = build_governor(torch.device("cpu"), True)
        deadline = time.monotonic() + args.settle_s
        while time.monotonic() < deadline:  # let it see the neighbour (an interval, then a decision)
            decode_round(llm, [prompt], 16, "settle")
        assert core.governor is not None
        return core.governor.threads

    def measure(mode: str) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": mode}
        if mode == "governed":
            out["threads"] = governed()
        else:
            fixed()
            out["threads"] = args.threads
        for b in args.batch_sizes:
            out[f"b{b}_ms"] = 1e3 * decode_round(llm, [prompt] * b, args.output_len, f"{mode}-{b}")[0]
        return out

    decode_round(llm, [prompt], 8, "warmup")
    rounds = []
    for r in range(args.rounds):
        row: dict[str, Any] = {"alone": measure("alone")}
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.5)
            for mode in (("fixed", "governed") if r % 2 == 0 else ("governed", "fixed")):
                row[mode] = measure(mode)
        finally:
            busy.kill()
            busy.wait()
        rounds.append(row)
        print(f"round {r}: " + ", ".join(f"{m} {row[m]['threads']}t " + " ".join(
            f"b{b} {row[m][f'b{b}_ms']:.1f}" for b in args.batch_sizes) for m in ("alone", "fixed", "governed")))
    fixed()
    summary: dict[str, Any] = {}
    table = []
    for b in args.batch_sizes:
        med = {m: statistics.median(row[m][f"b{b}_ms"] for row in rounds) for m in ("alone", "fixed", "governed")}
        ratio = statistics.median(row["fixed"][f"b{b}_ms"] / row["governed"][f"b{b}_ms"] for row in rounds)
        summary[f"b{b}"] = {**{f"{m}_ms": v for m, v in med.items()}, "fixed_over_governed": ratio,
                            "governed_over_alone": med["governed"] / med["alone"]}
        table.append((b, med["alone"], med["fixed"], med["governed"], ratio, med["governed"] / med["alone"]))
    common.print_table(["batch", "alone ms", "busy beside, fixed ms", "busy beside, governed ms",
                        "fixed / governed", "governed / alone"], table)
    common.save_json("cpu_contention", args.model, {"config": vars(args), "rounds": rounds, "summary": summary})


if __name__ == "__main__":
    main()
