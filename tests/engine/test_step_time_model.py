"""The step-time model the SLO-aware scheduler plans with (engine/step_time.py), the engine core's
feed of measured steps into it, and the service-class config's validation."""

from __future__ import annotations

import random

import pytest

from tests.engine.tiny import greedy, make_core, random_prompts, tiny_model
from tokenmill.config import ServiceClassConfig, SLOTarget
from tokenmill.engine.service_class import ServiceClass
from tokenmill.engine.step_time import OnlineStepTimeModel, StepTimeFit, StepTimeLimit

INT, BAT = ServiceClass.INTERACTIVE, ServiceClass.BATCH


def test_online_model_recovers_a_linear_step_time_and_stays_non_negative() -> None:
    rng = random.Random(0)
    model = OnlineStepTimeModel(min_samples=16)
    for _ in range(15):
        model.observe(10, 2, 0.03)
    assert model.fit() is None
    for _ in range(300):
        tokens = rng.randint(1, 300)
        seqs = rng.randint(1, min(tokens, 40))
        model.observe(tokens, seqs, 0.03 + 0.0002 * tokens + 0.001 * seqs + rng.gauss(0, 0.0005))
    fit = model.fit()
    assert fit is not None
    assert fit.base_s == pytest.approx(0.03, abs=0.002)
    assert fit.per_token_s == pytest.approx(0.0002, abs=0.00002)
    assert fit.per_seq_s == pytest.approx(0.001, abs=0.0002)
    falling = OnlineStepTimeModel(min_samples=4)
    for i in range(30):  # more tokens, less time: a negative slope must not be believed
        falling.observe(10 + i, 4, 0.05 - 0.0005 * i)
    fit = falling.fit()
    assert fit is not None and min(fit.base_s, fit.per_token_s, fit.per_seq_s) >= 0


def test_decode_only_samples_predict_decode_steps_exactly() -> None:
    model = OnlineStepTimeModel(min_samples=4)
    for n in range(1, 9):  # tokens == seqs: the split between them is not identifiable
        model.observe(n, n, 0.02 + 0.003 * n)
    fit = model.fit()
    assert fit is not None
    assert fit.predict(5, 5) == pytest.approx(0.035, rel=1e-6)


def test_step_time_limit_arithmetic() -> None:
    limit = StepTimeLimit(0.015, StepTimeFit(0.010, 0.001, 0.0005, 10), 5)
    assert limit.max_new_tokens(2, 2) == 1  # 15 - (10 + 2 x 1 + 3 x 0.5) = 1.5 ms: one 1 ms token
    assert limit.max_new_tokens(5, 2) == 0
    assert StepTimeLimit(0.015, None, 5).max_new_tokens(2, 2) == 3



# ---- the core feeds measured steps to the model -------------------------------------------------


def test_the_core_feeds_every_nonempty_step_to_the_step_time_model() -> None:
    core = make_core(tiny_model("llama"))
    for i, prompt in enumerate(random_prompts([5, 9], seed=0)):
        core.add_request(str(i), prompt, greedy(4), (), service_class=BAT if i else INT)
    steps = 0
    while core.has_unfinished:
        result = core.step()
        steps += 1
    model = core.scheduler.step_time
    assert isinstance(model, OnlineStepTimeModel) and model.num_samples == steps
    assert set(result.stats.classes.scheduled_tokens) == {"interactive", "standard", "batch"}
    assert result.stats.class_num_running == {"interactive": 0, "standard": 0, "batch": 0}


def test_service_class_config_validates_and_maps_targets() -> None:
    from tokenmill.errors import TokenmillError

    config = ServiceClassConfig()
    assert config.target(INT) == SLOTarget(ttft_s=1.0, tpot_s=0.1)
    assert config.target(BAT) == SLOTarget()
    for bad in ({"step_time_margin": 0.0}, {"min_step_samples": 0}, {"unfitted_step_tokens": 0},
                {"min_prefill_chunk": 0}):
        with pytest.raises(TokenmillError):
            ServiceClassConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(TokenmillError):
        SLOTarget(tpot_s=0.0)
