"""The speculation controller's per-bucket decisions: what each kind of proposal is learned to be worth
(acceptance.py), the proposer's priors, a bucketed request's calibration, and the gate before the cost fit."""

from __future__ import annotations

import pytest

from tests.fixtures.spec import ngram_controller, spec_requests, verified
from tokenmill.config import SpeculativeConfig
from tokenmill.engine.spec.controller import SpecController


def test_the_acceptance_model_learns_position_by_position_with_a_prior() -> None:
    from tokenmill.engine.spec.acceptance import AcceptanceModel

    model = AcceptanceModel(max_tokens=3, prior=0.7)
    assert model.gains(4, 2) == pytest.approx([0.7, 0.49])  # unseen: the prior, position after position
    model.record(4, num_proposed=3, num_accepted=1)  # token 1 accepted, token 2 rejected, token 3 never scored
    r1 = (1 + 2 * 0.7) / (1 + 2)
    r2 = (0 + 2 * r1) / (1 + 2)
    r3 = (0 + 2 * r2) / (0 + 2)  # no counts: the position before it
    assert model.gains(4, 3) == pytest.approx([r1, r1 * r2, r1 * r2 * r3])
    assert model.gains(1, 1) == pytest.approx([0.7])  # buckets are independent
    for _ in range(200):
        model.record(1, 3, 0)
    assert model.gains(1, 1)[0] < 0.05 and model.rates()[1][0] < 0.05


def _learned(controller: SpecController, bucket: int, accepted: int, drafts: int = 60) -> None:
    for _ in range(drafts):
        controller.acceptance.record(bucket, 3, accepted)


def test_proposals_go_to_the_buckets_that_pay_and_requests_without_a_match_are_not_counted() -> None:
    """Two requests at batch 2 on a CPU where rows cost: the one continuing a 4-token match (its
    proposals accepted) proposes; the one with a 1-token match (its proposals rejected) does not, and
    one with no match at all neither proposes nor counts towards the step's rows."""
    controller = ngram_controller(max_batch_size=64)
    for n in (2, 3, 4, 5, 6, 7, 8) * 4:
        controller.observe(n, 0.030 + 0.008 * n)
    _learned(controller, 4, accepted=3)
    _learned(controller, 1, accepted=0)
    strong, weak, none = spec_requests(3, acceptance=0.6)
    assert controller.plan([strong, weak], [4, 1]) == [3, 0]
    assert controller.plan([weak, strong], [1, 4]) == [0, 3]
    assert controller.plan([strong, none], [4, 0]) == [3, 0]
    # Without buckets both requests look alike (recent acceptance 0.6) and get the same k.
    ks = controller.plan([strong, weak])
    assert ks[0] == ks[1]


def test_a_verified_draft_is_scored_into_its_bucket_from_the_request_counters() -> None:
    controller = ngram_controller(max_batch_size=64)
    [r] = spec_requests(1)
    assert controller.plan([r], [2]) == [3]  # no fit yet: K
    stats = r.spec_stats  # what Scheduler._record_spec does after verification: 3 proposed, 1 accepted
    stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens = stats.num_drafts + 1, 3, 1
    controller.plan([r], [3])
    assert controller.acceptance.rates()[2][:2] == pytest.approx([(1 + 1.4) / 3, (0 + 2 * 0.8) / 3])
    # A draft the step skipped (counters unchanged) teaches nothing.
    controller.plan([r], [3])
    assert 3 not in controller.acceptance.rates()


def test_a_fresh_controller_takes_the_ngram_proposers_priors_by_match_length() -> None:
    """Before any draft is verified: a 4-token match is worth proposing on a CPU where rows cost, a
    1-token match is not (prior 0.4); with one flat prior (0.7) both looked alike and split the rows."""
    from tokenmill.engine.spec.ngram import NgramProposer

    proposer = NgramProposer(1, 4)
    assert [proposer.bucket_prior(n) for n in (0, 1, 2, 3, 4, 7)] == [None, 0.4, 0.55, 0.7, 0.9, 0.9]
    for prior, expected in ((proposer.bucket_prior, [3, 0]), (None, [2, 2])):
        controller = SpecController(SpeculativeConfig("ngram", 3, max_batch_size=64), prior)
        for n in (2, 3, 4, 5, 6, 7, 8) * 4:
            controller.observe(n, 0.030 + 0.008 * n)
        long_match, short_match = spec_requests(2, acceptance=0.6)
        assert controller.plan([long_match, short_match], [4, 1]) == expected


def test_a_bucketed_request_is_judged_against_what_its_buckets_expected() -> None:
    """A code edit whose 15-guess drafts of long matches failed five times in a row (a type hint broke a
    copied signature, then the opening lines) has accepted / proposed at 0.17, under min_acceptance, yet
    keeps proposing: it accepted 32% of the tokens its buckets promised. A request whose long matches
    keep failing where other requests' succeed falls below it and stops (probing as before)."""
    controller = SpecController(SpeculativeConfig("ngram", 15, min_acceptance=0.2), lambda b: 0.9)
    edit, *others = spec_requests(6, acceptance=1.0, drafts=0)
    for _ in range(6):
        assert controller.plan([edit], [4]) == [15]
        verified(edit, 15, 15)
    for _ in range(5):
        assert controller.plan([edit], [4]) == [15]
        verified(edit, 15, 0)
    assert edit.spec_stats.recent_acceptance < 0.2
    assert controller.plan([edit], [4]) == [15]
    assert 0.2 < controller.calibration(edit.request_id) < 0.4
    # Five requests' drafts of the same bucket succeed while one request's fail: that one is cut off.
    bad, plans = others[0], []
    for _ in range(8):
        plans.append(controller.plan(others, [4] * 5))
        for r in others:
            verified(r, 15, 0 if r is bad else 15)
    assert plans[0] == [15] * 5 and plans[-1] == [0, 15, 15, 15, 15]
    assert controller.calibration(bad.request_id) < 0.2


def test_before_the_fit_a_bucket_whose_first_guess_mostly_fails_proposes_nothing() -> None:
    """Without measured step costs every request proposed K: 8 requests on 1- and 2-token lookup
    matches (learned 0.04) drafted 7 guesses each for a fresh engine's first 16 steps at ~5x a plain
    step. Now a bucket proposes only while its position-1 rate (prior, then learned) is at least 0.5."""
    from tokenmill.engine.spec.ngram import NgramProposer

    controller = SpecController(SpeculativeConfig("ngram", 3, max_batch_size=64), NgramProposer(1, 4).bucket_prior)
    long_match, short_match, second = spec_requests(3, acceptance=0.6)
    assert controller.cost_fit() is None
    assert controller.plan([long_match, short_match], [4, 1]) == [3, 0]  # priors 0.9 and 0.4
    assert controller.plan([second], [2]) == [3]  # bucket 2, prior 0.55
    verified(second, 3, 0)  # its first guess failed: learned (0 + 2 x 0.55) / 3 = 0.37
    assert controller.plan([second], [2]) == [0]
    assert controller.plan([long_match], [4]) == [3]
