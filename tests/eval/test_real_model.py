"""Every task against a real `tokenmill serve` on SmolLM2-135M and against the in-process engine:
the two are one model, so every delta's paired interval must hold zero (slow; needs the model)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from tests.server.conftest import LiveServer, serve_real_model
from tokenmill.eval.client import TargetSpec, open_backend
from tokenmill.eval.compare import compare_runs, gate_set
from tokenmill.eval.runner import DEFAULT_TASKS, SuiteConfig, run_suite
from tokenmill.eval.tasks.base import TaskConfig

MODEL = "smollm2-135m"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real() -> Iterator[LiveServer]:
    yield from serve_real_model(MODEL, num_blocks=512)


def test_every_task_agrees_between_the_server_and_the_in_process_engine(real: LiveServer) -> None:
    suite = SuiteConfig(tasks=DEFAULT_TASKS, task=TaskConfig(num_items=6), num_resamples=500)
    over_http = open_backend(TargetSpec(real.url, MODEL, {"concurrency": 4}))
    http_runs = run_suite(over_http, suite)
    in_process = open_backend(TargetSpec(None, MODEL, {"num_kv_blocks": 512}))
    engine_runs = run_suite(in_process, suite)
    comparison = compare_runs(engine_runs, http_runs, [*gate_set("quant"), *gate_set("spec")], suite)
    for row in comparison.deltas:
        if not math.isfinite(row.reference):
            continue  # greedy's golden score where no golden file is shipped
        assert row.interval.low <= 0.0 <= row.interval.high or abs(row.delta) < 1e-9, row
    pairs = {f"{p.task}.{p.metric}": p.value for p in comparison.pairs}
    assert pairs["next-token.top1_agreement"] >= 0.99
    assert pairs["next-token.kl_mean"] < 1e-3
    assert pairs["greedy.identity"] == 1.0
    assert comparison.passed, [g for g in comparison.gates if not g.passed]
    # The tasks measure something: the real model is far better than chance where chance is known.
    http = {run.task.name: run.metrics for run in http_runs}
    assert http["ppl-heldout"]["ppl"] < 100
    assert http["next-token"]["top1_acc"] > 0.3
