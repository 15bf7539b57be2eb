"""A draft request that sits out is planned from the target's own confidence (α̂), not from the κ and α
it had when it went off: the runner's top-1 probabilities, their way through the scheduler into the
controller, what the controller learns from verified guesses, and the revival itself."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenmill.config import SpeculativeConfig
from tokenmill.engine.interfaces import SampledTokens
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.engine.sampler import top1_probs
from tokenmill.engine.spec.controller import SpecController
from tokenmill.engine.spec.target_confidence import target_confidence_bin


def _controller() -> SpecController:
    """A draft controller on a CPU where rows cost: T(n) = 60 ms + 20 ms n, a draft forward 5 ms."""
    controller = SpecController(SpeculativeConfig("draft", 3, draft_model="d"))
    for n in (1, 2, 3, 4) * 8:
        controller.observe(n, 0.06 + 0.02 * n)
    controller.observe_draft(0.005)
    return controller


def _off_request(kept: float = 0.2, acceptance: float = 0.9) -> Request:
    """A request that drafted before, when its draft's first guesses were mostly dropped (κ = 0.2)."""
    r = Request("r", [1, 2, 3], SamplingParams())
    r.spec_stats.num_drafts, r.spec_stats.recent_kept, r.spec_stats.recent_acceptance = 10, kept, acceptance
    return r


def test_top1_probs_is_the_softmax_maximum() -> None:
    logits = torch.randn(3, 50) * 4
    assert top1_probs(logits) == pytest.approx(torch.softmax(logits, -1).amax(-1).tolist(), rel=1e-5)


def test_each_emitted_token_gets_the_probability_of_its_own_row() -> None:
    """Request a verified two guesses (rows 0-2) and emitted two tokens; b decoded plainly (row 3)."""
    logits = torch.tensor([[9.0, 0.0], [0.0, 0.0], [0.0, 1.0], [0.0, 3.0]])
    inp = SimpleNamespace(sampled=[SimpleNamespace(request=SimpleNamespace(request_id="a"), spec_token_ids=[5, 6]),
                                   SimpleNamespace(request=SimpleNamespace(request_id="b"), spec_token_ids=[])])
    sampled = {"a": SampledTokens([5, 7], [None, None]), "b": SampledTokens([1], [None])}
    ModelRunner._attach_confidences(logits, inp, sampled)  # type: ignore[arg-type]
    probs = top1_probs(logits)
    assert sampled["a"].confidences == [probs[0], probs[1]] and sampled["b"].confidences == [probs[3]]


def test_an_off_draft_request_revives_when_the_target_is_sure() -> None:
    """κ·α = 0.2·0.9: no guess pays for its 20 ms row. After _STALE_PLANS_OFF plans off, tokens the
    target emitted at p ≥ 0.99 (prior 0.99 that a guess there is accepted) plan it at K, and its κ
    and α restart from that estimate; tokens at p < 0.5 (prior 0.25) keep it off."""
    for confidence, expected in ((0.999, [3]), (0.3, [0])):
        controller, r = _controller(), _off_request()
        for _ in range(5):
            assert controller.plan([r]) == [0]
        r.spec_stats.target_confidences = [confidence] * 4
        assert controller.plan([r]) == expected
        assert r.spec_stats.target_confidences == []  # drained
        if expected == [3]:
            assert (r.spec_stats.recent_kept, r.spec_stats.recent_acceptance) == (1.0, pytest.approx(0.99))


def test_a_request_that_drafted_lately_is_planned_from_its_own_measurements() -> None:
    """The same sure target, but the request drafted in the last plans: its κ·α decides (off)."""
    controller, r = _controller(), _off_request(kept=1.0)
    assert controller.plan([r]) == [3]  # κ = 1, α = 0.9: pays
    r.spec_stats.recent_kept = 0.2
    r.spec_stats.target_confidences = [0.999] * 4
    assert controller.plan([r]) == [0]
    assert not controller.is_stale(r)


def test_verified_guesses_are_scored_into_the_target_confidence_bins() -> None:
    """Three guesses, the first accepted: the target emitted two tokens, at p 0.999 (row 0: guess 1,
    accepted) and 0.6 (row 1: guess 2, rejected); guess 3 was never reached. Then one guess (the
    scheduler cut the proposal), accepted: only row 0 checked a guess."""
    controller, r = _controller(), _off_request(kept=1.0)
    assert controller.plan([r]) == [3]
    stats = r.spec_stats  # what the scheduler leaves after verification: 3 proposed, 1 accepted
    stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens = stats.num_drafts + 1, 3, 1
    stats.target_confidences = [0.999, 0.6]
    controller.plan([r])
    assert sorted(controller.target.model.rates()) == [target_confidence_bin(0.6), target_confidence_bin(0.999)]
    assert controller.target.rate(target_confidence_bin(0.999)) == pytest.approx((1 + 2 * 0.99) / 3)
    assert controller.target.rate(target_confidence_bin(0.6)) == pytest.approx((0 + 2 * 0.55) / 3)
    # One guess, accepted: two tokens emitted, but row 1 (the bonus token's, at p 0.3) checked no guess.
    assert controller.plan([r]) == [3]
    stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens = stats.num_drafts + 1, 4, 2
    stats.target_confidences = [0.999, 0.3]
    controller.plan([r])
    assert target_confidence_bin(0.3) not in controller.target.model.rates()


def test_the_scheduler_keeps_the_confidences_of_appended_tokens_only() -> None:
    """A stop token in the middle of an accepted run: the tokens after it are not appended, nor their
    confidences."""
    from tokenmill.config import SchedulerConfig
    from tokenmill.engine.kv_cache import KVCacheManager
    from tokenmill.engine.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(), KVCacheManager(16, 4, False), 64)
    r = Request("r", [1, 2, 3], SamplingParams(stop_token_ids=[9]))
    scheduler._append_tokens(r, SampledTokens([4, 9, 5], [None] * 3, [0.5, 0.6, 0.7]), 0.0)
    assert r.token_ids[3:] == [4, 9] and r.spec_stats.target_confidences == [0.5, 0.6]
