"""A/B of two tokenmill servers: one phase of the `mixed` bench (workload_classes.py's chat sessions,
batch burst, or both at once) against `tokenmill serve` from a base checkout and from this one, or from
this one with two sets of serve flags, in ABBA order (base, new, new, base, ...: linear drift of this
VM's speed cancels), each pair on the same prompts (seed = pair). Every run is a fresh server. Prints
one JSON line per run and the new / base ratios per pair.

    git worktree add /tmp/base REV
    flock /tmp/tokenmill-bench.lock python benchmarks/server_ab.py --base /tmp/base --phase mixed --rounds 4
    # issue 15's "batch alone as fast as without classes": the same checkout, classes off as the base
    flock /tmp/tokenmill-bench.lock python benchmarks/server_ab.py --base-flags=--no-slo-scheduling \
        --phase batch_alone --rounds 4

Takes workload_classes.py's workload flags (--chat-sessions, --batch-requests, ...). Writes
benchmarks/results/server_ab_<phase>_<date>.json.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

import common  # type: ignore[import-not-found]
import workload_classes as wc  # type: ignore[import-not-found]


def parse_args() -> argparse.Namespace:
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--base", type=Path, default=None, help="a checkout of the base revision (default: this one)")
    ours.add_argument("--base-flags", default="", help="extra `tokenmill serve` flags of the base servers")
    ours.add_argument("--new-flags", default="", help="extra `tokenmill serve` flags of the new servers")
    ours.add_argument("--phase", choices=["mixed", "batch_alone", "chat_alone"], default="mixed")
    args, rest = ours.parse_known_args()
    if args.base is None and args.base_flags == args.new_flags:
        ours.error("nothing to compare: give --base CHECKOUT or different --base-flags / --new-flags")
    sys.argv = [sys.argv[0], *rest]
    workload = wc.parse_args()  # --rounds: pairs of runs
    for key, value in vars(args).items():
        setattr(workload, key, value)
    return workload


def main() -> None:
    args = parse_args()
    sides = {"base": ((args.base or common.ROOT).resolve(), shlex.split(args.base_flags)),
             "new": (common.ROOT, shlex.split(args.new_flags))}
    rows, pairs = wc.ab_pairs(args, args.phase, sides, args.rounds)
    medians = {k: statistics.median(p[k] for p in pairs) for k in pairs[0]} if pairs else {}
    print("median new / base over the pairs: " + ", ".join(f"{k} {v:.3f}" for k, v in medians.items()))
    common.save_json(f"server_ab_{args.phase}", args.model, {
        "args": {k: str(v) for k, v in vars(args).items()}, "base": str(sides["base"][0]),
        "base_flags": args.base_flags, "new_flags": args.new_flags, "runs": rows,
        "new_over_base": pairs, "median_new_over_base": medians})


if __name__ == "__main__":
    main()
