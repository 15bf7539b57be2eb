"""Reference vs candidate on the same items: deltas with paired bootstrap intervals, paired tests,
pairwise metrics (agreement, KL, identity), and gates that decide pass or fail.

Keys a gate can name (globs allowed, `ppl-*.ppl_delta_pct<=1`):
  TASK.METRIC            the candidate's value          (e.g. `mc.acc`)
  TASK.METRIC_delta      candidate - reference          (e.g. `code.pass_at_1_delta>=-0.05`)
  TASK.METRIC_delta_pct  100 × (candidate/reference - 1)
  TASK.PAIR_METRIC       a pairwise value               (`next-token.top1_agreement`, `greedy.identity`)
A gate whose key matches nothing fails: a typo or a task left out of the run must not pass.
"""

from __future__ import annotations

import fnmatch
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tokenmill.eval.client import EvalError
from tokenmill.eval.metrics import Interval, bootstrap_interval, mcnemar_p, paired_bootstrap_delta, sign_flip_p
from tokenmill.eval.runner import SuiteConfig, TaskRun
from tokenmill.eval.tasks.base import ItemResult, columns

GATE_SETS: dict[str, tuple[str, ...]] = {
    # gpt-fast / llama.cpp practice for a quantized model: it must pick the same next token almost
    # always, and lose at most 1% perplexity.
    "quant": ("next-token.top1_agreement>=0.99", "ppl-*.ppl_delta_pct<=1"),
    # An exact method (speculative decoding, a new kernel) must reproduce greedy output token for token.
    "spec": ("greedy.identity>=1",),
}
GATE_TASKS: dict[str, tuple[str, ...]] = {"quant": ("ppl-docstrings", "ppl-heldout", "next-token"),
                                          "spec": ("greedy",)}
_OPS: dict[str, Callable[[float, float], bool]] = {"<=": operator.le, ">=": operator.ge, "==": operator.eq,
                                                   "<": operator.lt, ">": operator.gt}
_GATE = re.compile(r"^\s*([A-Za-z0-9_.*?\[\]-]+)\s*(<=|>=|==|<|>)\s*(-?[0-9.eE+-]+|inf|-inf)\s*$")


@dataclass(frozen=True, slots=True)
class DeltaRow:
    task: str
    metric: str
    reference: float
    candidate: float
    delta: float
    delta_pct: float
    interval: Interval  # of the delta (or of delta_pct, for relative metrics)
    relative: bool
    p_value: float
    test: str
    higher_is_better: bool


@dataclass(frozen=True, slots=True)
class PairRow:
    task: str
    metric: str
    value: float
    interval: Interval
    higher_is_better: bool


@dataclass(frozen=True, slots=True)
class Gate:
    key: str
    op: str
    bound: float

    @property
    def text(self) -> str:
        return f"{self.key}{self.op}{self.bound:g}"


@dataclass(frozen=True, slots=True)
class GateResult:
    gate: Gate
    values: dict[str, float]  # every key it matched, with its value
    passed: bool
    reason: str


@dataclass(slots=True)
class Comparison:
    deltas: list[DeltaRow]
    pairs: list[PairRow]
    gates: list[GateResult]

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)

    def values(self) -> dict[str, float]:
        flat: dict[str, float] = {}
        for row in self.deltas:
            flat[f"{row.task}.{row.metric}"] = row.candidate
            flat[f"{row.task}.{row.metric}_delta"] = row.delta
            flat[f"{row.task}.{row.metric}_delta_pct"] = row.delta_pct
        for pair in self.pairs:
            flat[f"{pair.task}.{pair.metric}"] = pair.value
        return flat


def parse_gate(text: str) -> Gate:
    match = _GATE.match(text)
    if not match:
        raise EvalError(f"bad gate {text!r}: expected KEY<=VALUE (or >=, <, >, ==), "
                        "e.g. next-token.top1_agreement>=0.99")
    return Gate(match.group(1), match.group(2), float(match.group(3)))


def gate_set(name: str) -> list[Gate]:
    if name not in GATE_SETS:
        raise EvalError(f"unknown gate set {name!r}: one of {', '.join(GATE_SETS)}")
    return [parse_gate(g) for g in GATE_SETS[name]]


def _aligned(reference: TaskRun, candidate: TaskRun) -> tuple[list[ItemResult], list[ItemResult]]:
    ref_ids = [item.item_id for item in reference.items]
    cand = {item.item_id: item for item in candidate.items}
    if set(ref_ids) != set(cand):
        raise EvalError(f"task {reference.task.name}: the two sides ran different items "
                        f"({len(ref_ids)} vs {len(cand)}); run both with the same --limit and --seed")
    return reference.items, [cand[i] for i in ref_ids]


def compare_runs(reference: list[TaskRun], candidate: list[TaskRun], gates: list[Gate],
                 config: SuiteConfig) -> Comparison:
    by_name = {run.task.name: run for run in candidate}
    deltas: list[DeltaRow] = []
    pairs: list[PairRow] = []
    for ref_run in reference:
        cand_run = by_name.get(ref_run.task.name)
        if cand_run is None:
            continue
        ref_items, cand_items = _aligned(ref_run, cand_run)
        deltas.extend(_deltas(ref_run, ref_items, cand_items, config))
        pairs.extend(_pairs(ref_run, ref_items, cand_items, config))
    comparison = Comparison(deltas, pairs, [])
    comparison.gates = [check_gate(g, comparison.values()) for g in gates]
    return comparison


def _deltas(run: TaskRun, ref_items: list[ItemResult], cand_items: list[ItemResult],
            config: SuiteConfig) -> list[DeltaRow]:
    ref_cols, cand_cols = columns(ref_items), columns(cand_items)
    rows = []
    for paired in run.task.metrics:
        metric = paired.metric
        ref_value = metric.aggregate(ref_cols) if ref_items else math.nan
        cand_value = metric.aggregate(cand_cols) if cand_items else math.nan
        delta = cand_value - ref_value
        pct = 100.0 * (cand_value / ref_value - 1.0) if ref_value not in (0.0,) and math.isfinite(ref_value) \
            else math.nan
        if math.isfinite(ref_value) and math.isfinite(cand_value):
            interval = paired_bootstrap_delta(ref_cols, cand_cols, metric.aggregate, relative=paired.relative,
                                              num_resamples=config.num_resamples, seed=config.bootstrap_seed)
            if paired.relative:
                interval = Interval(100.0 * interval.low, 100.0 * interval.high)
            ref_col, cand_col = ref_cols[paired.column], cand_cols[paired.column]
            if paired.binary:
                p, test = mcnemar_p(ref_col > 0.5, cand_col > 0.5), "mcnemar"
            else:
                p, test = sign_flip_p(cand_col - ref_col, seed=config.bootstrap_seed), "sign-flip"
        else:
            interval, p, test = Interval(math.nan, math.nan), math.nan, "-"
        rows.append(DeltaRow(run.task.name, metric.name, ref_value, cand_value, delta, pct, interval,
                             paired.relative, p, test, metric.higher_is_better))
    return rows


def _pairs(run: TaskRun, ref_items: list[ItemResult], cand_items: list[ItemResult],
           config: SuiteConfig) -> list[PairRow]:
    if not run.task.pair_metrics:
        return []
    paired = [run.task.pair(r, c) for r, c in zip(ref_items, cand_items, strict=True)]
    cols = {k: np.array([p[k] for p in paired], dtype=float) for k in (paired[0] if paired else {})}
    rows = []
    for metric in run.task.pair_metrics:
        value = metric.aggregate(cols) if paired else math.nan
        interval = (bootstrap_interval(cols, metric.aggregate, num_resamples=config.num_resamples,
                                       seed=config.bootstrap_seed)
                    if paired and math.isfinite(value) else Interval(math.nan, math.nan))
        rows.append(PairRow(run.task.name, metric.name, value, interval, metric.higher_is_better))
    return rows


def check_gate(gate: Gate, values: dict[str, float]) -> GateResult:
    matched = {k: v for k, v in values.items() if fnmatch.fnmatchcase(k, gate.key)}
    if not matched:
        return GateResult(gate, {}, False, "no such value in this comparison (task not run, or a typo)")
    failing = [k for k, v in matched.items() if not (math.isfinite(v) and _OPS[gate.op](v, gate.bound))]
    if failing:
        shown = ", ".join(f"{k}={matched[k]:.6g}" for k in failing)
        return GateResult(gate, matched, False, f"fails: {shown}")
    return GateResult(gate, matched, True, "ok")
