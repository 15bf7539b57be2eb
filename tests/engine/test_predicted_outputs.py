"""Predicted outputs in the engine: a request's prediction is proposed and verified like any guess, so the
tokens are exactly those without it, whatever the prediction says; the counts of prediction tokens
accepted and rejected come back with the request."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from tests.engine.test_engine_invariants import run_random_requests_with_aborts
from tests.engine.test_speculative import spec_core
from tests.engine.tiny import ARCH_NAMES, ArchName, assert_all_free, greedy, make_core, random_prompts, tiny_model
from tokenmill.engine.core import EngineCore
from tokenmill.engine.request import SamplingParams, SpecRequestStats

PROMPTS = random_prompts([5, 9, 14], seed=21)


def _run(core: EngineCore, params: list[SamplingParams]) -> tuple[list[list[int]], list[SpecRequestStats | None]]:
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        core.add_request(str(i), prompt, p, ())
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    stats: dict[str, SpecRequestStats | None] = {}
    while core.has_unfinished:
        for out in core.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                stats[out.request_id] = out.spec
    return [tokens[str(i)] for i in range(len(PROMPTS))], [stats[str(i)] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("arch", ARCH_NAMES)
@pytest.mark.parametrize("adaptive", [False, True])
def test_a_right_prediction_is_taken_and_a_wrong_one_changes_nothing(arch: ArchName, adaptive: bool) -> None:
    model = tiny_model(arch)
    params = [greedy(24), greedy(24), SamplingParams(max_tokens=24, temperature=0.8, seed=3)]
    expected, _ = _run(make_core(model), params)
    right = [replace(p, prediction=e) for p, e in zip(params, expected, strict=True)]
    core = spec_core(model, "ngram", k=4, adaptive=adaptive)
    outputs, stats = _run(core, right)
    assert outputs == expected
    for out, s in zip(outputs, stats, strict=True):
        assert s is not None and s.num_prediction_accepted >= len(out) - 8  # the first guesses teach the controller
        assert s.num_prediction_rejected <= 2
    wrong = [replace(p, prediction=[(t + 1) % 250 for t in e]) for p, e in zip(params, expected, strict=True)]
    outputs, stats = _run(core, wrong)
    assert outputs == expected
    assert all(s is None or s.num_prediction_accepted <= 2 for s in stats)
    assert_all_free(core)
    assert not core.speculator.predictions._cursors  # type: ignore[union-attr]


def test_an_edited_answer_takes_the_prediction_around_the_edit() -> None:
    """The prediction is the answer with three tokens in its middle replaced: the copy stops at the edit
    and resumes after it (prompt lookup alone finds nothing in these random prompts)."""
    model = tiny_model("llama")
    [expected], _ = _run_one(make_core(model), greedy(40))
    edited = [*expected[:15], 7, 7, 7, *expected[18:]]
    core = spec_core(model, "ngram", k=4)
    [output], [stats] = _run_one(core, replace(greedy(40), prediction=edited))
    assert output == expected
    assert stats is not None and stats.num_prediction_accepted >= 24 and stats.num_prediction_rejected <= 4


def _run_one(core: EngineCore, params: SamplingParams) -> tuple[list[list[int]], list[SpecRequestStats | None]]:
    core.add_request("0", PROMPTS[2], params, ())
    tokens: list[int] = []
    stats = None
    while core.has_unfinished:
        for out in core.step().outputs:
            tokens.extend(out.new_token_ids)
            stats = out.spec if out.finish_reason is not None else stats
    return [tokens], [stats]


def test_an_engine_without_a_method_takes_predictions_from_the_first_request_with_one() -> None:
    """No --speculative: no speculator until a request carries a prediction; then its predictions (only)
    are proposed, the tokens stay those of plain decoding, and requests without one propose nothing."""
    model = tiny_model("qwen2")
    params = [greedy(24), greedy(24), greedy(24)]
    core = make_core(model)
    expected, _ = _run(core, params)
    assert core.speculator is None
    outputs, stats = _run(core, [params[0], replace(params[1], prediction=expected[1]), params[2]])
    assert outputs == expected and core.speculator is not None
    assert stats[0] is None and stats[2] is None  # proposed nothing
    assert stats[1] is not None and stats[1].num_prediction_accepted >= 16
    assert_all_free(core)
    async_core = make_core(model, async_scheduling="on")
    assert _run(async_core, [replace(p, prediction=e) for p, e in zip(params, expected, strict=True)])[0] == expected
    assert async_core.speculator is None  # overlapped steps do not speculate: predictions go unused


def test_no_leak_after_random_requests_with_predictions_and_aborts() -> None:
    """300 random requests (greedy and sampled, a third with a prediction of random tokens) with aborts on
    an engine without a method: every block back, no cursor kept."""
    core = make_core(tiny_model("llama"), num_blocks=48)

    def params(rng: random.Random) -> SamplingParams:
        p = greedy(rng.randrange(1, 20)) if rng.random() < 0.6 else SamplingParams(
            max_tokens=rng.randrange(1, 20), temperature=1.0, seed=rng.randrange(100))
        if rng.random() < 0.35:
            p = replace(p, prediction=[rng.randrange(250) for _ in range(rng.randrange(1, 40))])
        return p

    aborted, finished = run_random_requests_with_aborts(core, random.Random(12), 300, params)
    assert aborted > 20 and finished > 200
    assert core.speculator is not None
    assert_all_free(core)
    assert not core.speculator.predictions._cursors
