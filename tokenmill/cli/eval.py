"""`tokenmill eval run|compare|list`: quality tasks against an endpoint or the in-process engine
(thin: parse, call, print; docs/evals.md).

    tokenmill eval run --target http://127.0.0.1:8000
    tokenmill eval run --model smollm2-135m --quantization none --tasks ppl-heldout,mc
    tokenmill eval compare --reference model=smollm2-135m --candidate http://127.0.0.1:8000 --gates quant
    tokenmill eval compare --reference A --candidate B --gate 'next-token.top1_agreement>=0.99' \
        --gate 'mc.acc_delta>=-0.05'
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Only the stdlib at import time: every `tokenmill` command builds this parser.
if TYPE_CHECKING:
    from tokenmill.eval.client import TargetSpec
    from tokenmill.eval.runner import SuiteConfig, TaskRun


def add_eval_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("eval", help="quality evals of an endpoint or engine config; gates for a change")
    commands = parser.add_subparsers(dest="eval_command", required=True, metavar="eval_command")
    run = commands.add_parser("run", help="run the tasks against one target")
    where = run.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="an OpenAI-compatible server URL, e.g. http://127.0.0.1:8000")
    where.add_argument("--model", help="a model for the in-process engine (catalog name or path)")
    run.add_argument("--served-model", default=None, help="model name to send to --target (default: /v1/models)")
    run.add_argument("--api-key", default=None)
    run.add_argument("--concurrency", type=int, default=8, help="requests in flight against --target")
    run.add_argument("--quantization", default=None, help="engine option, passed to LLM only when given")
    run.add_argument("--kv-cache-dtype", default=None, help="engine option, passed to LLM only when given")
    run.add_argument("--dtype", default=None, help="engine option (default: the engine's)")
    run.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                     help="any other LLM keyword argument, e.g. max_num_seqs=16 (repeatable)")
    run.add_argument("--write-golden", nargs="?", const="", default=None, metavar="PATH",
                     help="store the greedy task's token ids as the golden file (default path: the shipped one)")
    run.set_defaults(handler=run_eval)
    compare = commands.add_parser("compare", help="reference vs candidate on the same items, with gates")
    compare.add_argument("--reference", required=True, metavar="SPEC",
                         help="URL[,model=NAME,api_key=K] or model=NAME[,quantization=Q,kv_cache_dtype=D,...]")
    compare.add_argument("--candidate", required=True, metavar="SPEC", help="as --reference")
    compare.add_argument("--gate", action="append", default=[], metavar="KEY<=VALUE",
                         help="e.g. next-token.top1_agreement>=0.99, ppl-*.ppl_delta_pct<=1 (repeatable)")
    compare.add_argument("--gates", default=None, help="default gate sets, comma-separated: quant, spec")
    compare.add_argument("--no-plot", action="store_true")
    compare.set_defaults(handler=compare_eval)
    for sub in (run, compare):
        sub.add_argument("--tasks", default=None, help="comma-separated (default: all; `tokenmill eval list`)")
        sub.add_argument("--limit", type=int, default=None, help="items per task (default: each task's own)")
        sub.add_argument("--seed", type=int, default=0, help="seeds generated items and the bootstrap")
        sub.add_argument("--golden-dir", default=None, help="where greedy golden files are (default: shipped)")
        sub.add_argument("--output-dir", default="eval_results", help="where the JSON (and PNG) go")
        sub.add_argument("--no-progress", action="store_true")
    listing = commands.add_parser("list", help="the registered tasks and gate sets")
    listing.set_defaults(handler=list_eval)


# ------------------------------------------------------------------ helpers


class _Bar:
    """tqdm on stderr, one bar per task."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled
        self.bar: Any = None

    def start(self, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=self.label, unit="req", disable=not self.enabled, file=sys.stderr,
                        leave=True)

    def advance(self, count: int) -> None:
        if self.bar is not None:
            self.bar.update(count)
            if self.bar.n >= self.bar.total:
                self.bar.close()


def _suite(args: argparse.Namespace, tasks: tuple[str, ...] | None = None) -> SuiteConfig:
    from tokenmill.eval.client import EvalError
    from tokenmill.eval.runner import DEFAULT_TASKS, SuiteConfig, validate_tasks
    from tokenmill.eval.tasks.base import TaskConfig

    if args.limit is not None and args.limit < 1:
        raise EvalError("--limit must be at least 1")
    names = tuple(t.strip() for t in args.tasks.split(",") if t.strip()) if args.tasks else (tasks or DEFAULT_TASKS)
    golden = Path(args.golden_dir) if args.golden_dir else None
    return SuiteConfig(tasks=validate_tasks(names), task=TaskConfig(args.limit, args.seed, golden),
                       bootstrap_seed=args.seed)


def _run_spec(args: argparse.Namespace) -> TargetSpec:
    from tokenmill.eval.client import EvalError, TargetSpec, coerce_value

    if args.target:
        options: dict[str, Any] = {"concurrency": args.concurrency}
        if args.api_key:
            options["api_key"] = args.api_key
        return TargetSpec(args.target, args.served_model, options)
    options = {}
    for item in args.engine_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise EvalError(f"--engine-arg takes KEY=VALUE, got {item!r}")
        options[key.strip().replace("-", "_")] = coerce_value(value.strip())
    for key in ("quantization", "kv_cache_dtype", "dtype"):
        if getattr(args, key) is not None:  # passed only when given: engines without the option still work
            options[key] = getattr(args, key)
    return TargetSpec(None, args.model, options)


def _run_all(spec: TargetSpec, suite: SuiteConfig, progress: bool) -> tuple[list[TaskRun], dict[str, Any]]:
    from tokenmill.eval.client import open_backend
    from tokenmill.eval.runner import run_suite

    backend = open_backend(spec)
    try:
        runs = run_suite(backend, suite, lambda label: _Bar(label, progress))
        return runs, backend.describe()
    finally:
        backend.close()
        del backend
        gc.collect()  # an in-process engine's weights go before the next one loads


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def _suite_dict(suite: SuiteConfig) -> dict[str, Any]:
    return {"tasks": list(suite.tasks), "limit": suite.task.num_items, "seed": suite.task.seed,
            "num_resamples": suite.num_resamples}


# ------------------------------------------------------------------ commands


def run_eval(args: argparse.Namespace) -> int:
    from tokenmill.eval.report import environment, print_tables, run_table, save_json
    from tokenmill.eval.tasks.greedy import golden_path, write_golden

    suite = _suite(args)
    spec = _run_spec(args)
    runs, target = _run_all(spec, suite, not args.no_progress)
    print_tables([run_table(runs, f"tokenmill eval: {spec.label}")])
    document = {"kind": "tokenmill-eval-run", "command": ["tokenmill", *sys.argv[1:]], "target": target,
                "suite": _suite_dict(suite), "environment": environment(),
                "tasks": {run.task.name: run.as_dict() for run in runs}}
    path = save_json(document, Path(args.output_dir) / f"run_{_stamp()}.json")
    print(f"results: {path}")
    if args.write_golden is not None:
        greedy = next((run for run in runs if run.task.name == "greedy"), None)
        if greedy is None:
            from tokenmill.eval.client import EvalError

            raise EvalError("--write-golden needs the greedy task in --tasks")
        model = str(target.get("model"))
        out = Path(args.write_golden) if args.write_golden else golden_path(model, suite.task.golden_dir)
        print(f"golden: {write_golden(out, model, greedy.items, {**target, **environment()})}")
    return 0


def _gates(args: argparse.Namespace) -> tuple[list[Any], tuple[str, ...] | None]:
    """The gates asked for, and the tasks they need (None: the default suite)."""
    from tokenmill.eval.compare import GATE_TASKS, gate_set, parse_gate
    from tokenmill.eval.tasks.base import task_names

    gates = [parse_gate(g) for g in args.gate]
    needed: list[str] = []
    for name in [s.strip() for s in (args.gates or "").split(",") if s.strip()]:
        gates.extend(gate_set(name))
        needed.extend(GATE_TASKS[name])
    if not args.gates:
        return gates, None
    for gate in gates:
        task_part = gate.key.split(".", 1)[0]
        needed.extend(t for t in task_names() if fnmatch.fnmatchcase(t, task_part))
    return gates, tuple(dict.fromkeys(needed))


def compare_eval(args: argparse.Namespace) -> int:
    from tokenmill.eval.client import parse_spec, with_common_dtype
    from tokenmill.eval.compare import compare_runs
    from tokenmill.eval.report import (
        comparison_dict,
        comparison_tables,
        environment,
        plot_comparison,
        print_tables,
        run_table,
        save_json,
    )

    gates, gate_tasks = _gates(args)
    suite = _suite(args, gate_tasks)
    reference, candidate, note = with_common_dtype(parse_spec(args.reference), parse_spec(args.candidate))
    if note is not None:
        print(note, file=sys.stderr)
    progress = not args.no_progress
    ref_runs, ref_target = _run_all(reference, suite, progress)
    cand_runs, cand_target = _run_all(candidate, suite, progress)
    comparison = compare_runs(ref_runs, cand_runs, gates, suite)
    print_tables([run_table(ref_runs, f"reference: {reference.label}"),
                  run_table(cand_runs, f"candidate: {candidate.label}"), *comparison_tables(comparison)])
    stem = Path(args.output_dir) / f"compare_{_stamp()}"
    document = {"kind": "tokenmill-eval-compare", "command": ["tokenmill", *sys.argv[1:]],
                "reference": ref_target, "candidate": cand_target, "suite": _suite_dict(suite),
                "environment": environment(), "comparison": comparison_dict(comparison),
                "reference_tasks": {r.task.name: r.as_dict() for r in ref_runs},
                "candidate_tasks": {r.task.name: r.as_dict() for r in cand_runs}}
    print(f"results: {save_json(document, stem.with_suffix('.json'))}")
    if not args.no_plot and (comparison.deltas or comparison.pairs):
        title = f"{candidate.label} vs {reference.label}"
        print(f"plot: {plot_comparison(comparison, stem.with_suffix('.png'), title)}")
    failed = [g for g in comparison.gates if not g.passed]
    if failed:
        print(f"FAILED {len(failed)} of {len(comparison.gates)} gates: "
              + "; ".join(f"{g.gate.text} ({g.reason})" for g in failed), file=sys.stderr)
        return 1
    if comparison.gates:
        print(f"passed all {len(comparison.gates)} gates")
    return 0


def list_eval(args: argparse.Namespace) -> int:
    from tokenmill.eval.compare import GATE_SETS
    from tokenmill.eval.tasks.base import get_task, task_names

    for name in task_names():
        task = get_task(name)
        metrics = ", ".join(m.metric.name for m in task.metrics)
        pairs = ", ".join(m.name for m in task.pair_metrics)
        print(f"{name:15} {task.description}")
        print(f"{'':15} items {task.default_items}; metrics: {metrics}" + (f"; against a reference: {pairs}"
                                                                             if pairs else ""))
    for name, gates in GATE_SETS.items():
        print(f"gates {name}: {' '.join(gates)}")
    return 0
