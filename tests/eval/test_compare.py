"""Gates: parsing, globs, missing keys and NaN fail; deltas and their paired tests on known items."""

from __future__ import annotations

import math

import pytest

from tests.eval.fake import FakeBackend, FakeModel
from tokenmill.eval.client import EvalError, PositionLogprobs
from tokenmill.eval.compare import GATE_SETS, check_gate, compare_runs, gate_set, parse_gate
from tokenmill.eval.runner import SuiteConfig, TaskRun
from tokenmill.eval.tasks.base import ItemResult, NoProgress, TaskConfig, columns, get_task


def test_gate_syntax() -> None:
    gate = parse_gate("ppl-*.ppl_delta_pct<=1")
    assert (gate.key, gate.op, gate.bound) == ("ppl-*.ppl_delta_pct", "<=", 1.0)
    assert parse_gate(" mc.acc_delta >= -0.05 ").bound == -0.05
    for bad in ("mc.acc", "mc.acc=>1", "mc.acc<=x", "<=1"):
        with pytest.raises(EvalError):
            parse_gate(bad)
    assert [g.text for g in gate_set("quant")] == list(GATE_SETS["quant"])
    with pytest.raises(EvalError):
        gate_set("vibes")


def test_gates_check_every_match_and_fail_on_nothing_or_nan() -> None:
    values = {"ppl-a.ppl_delta_pct": 0.5, "ppl-b.ppl_delta_pct": 1.5, "x.y": math.nan}
    result = check_gate(parse_gate("ppl-*.ppl_delta_pct<=1"), values)
    assert not result.passed and "ppl-b" in result.reason and "ppl-a" not in result.reason
    assert check_gate(parse_gate("ppl-a.ppl_delta_pct<=1"), values).passed
    assert not check_gate(parse_gate("ppl-c.ppl_delta_pct<=1"), values).passed
    assert not check_gate(parse_gate("x.y>=0"), values).passed


def _run(task_name: str, correct: list[bool]) -> TaskRun:
    task = get_task(task_name)
    items = [ItemResult(f"i{n}", {"correct": float(c), "correct_norm": float(c)}) for n, c in enumerate(correct)]
    cols = columns(items)
    return TaskRun(task, items, {m.metric.name: m.metric.aggregate(cols) for m in task.metrics}, {}, {}, 0.0)


def test_accuracy_delta_with_mcnemar() -> None:
    ref = _run("mc", [True] * 10 + [False] * 10)
    cand = _run("mc", [True] * 2 + [False] * 18)  # 8 items lost, none gained
    comparison = compare_runs([ref], [cand], [parse_gate("mc.acc_delta>=-0.05")], SuiteConfig())
    row = next(r for r in comparison.deltas if r.metric == "acc")
    assert (row.reference, row.candidate, row.delta) == (0.5, 0.1, pytest.approx(-0.4))
    assert row.test == "mcnemar" and row.p_value == pytest.approx(2 / 2**8)
    assert row.interval.high < 0
    assert not comparison.passed


def test_different_items_on_the_two_sides_are_an_error() -> None:
    with pytest.raises(EvalError, match="different items"):
        compare_runs([_run("mc", [True, False])], [_run("mc", [True])], [], SuiteConfig())


def test_token_ids_against_token_text_is_an_error() -> None:
    config = SuiteConfig(task=TaskConfig(num_items=1))
    task = get_task("next-token")
    ids = task.run(FakeBackend(FakeModel()), config.task, NoProgress())
    as_text = [PositionLogprobs(str(p.token), p.logprob, {str(k): v for k, v in p.top.items()}) for p in ids[0].raw]
    texts = [ItemResult(ids[0].item_id, ids[0].values, raw=as_text)]
    with pytest.raises(EvalError, match="token ids"):
        task.pair(ids[0], texts[0])
