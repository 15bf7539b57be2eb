"""The speculation controller's decisions: per-request cut-off with probes, and the per-step
goodput rule from measured step times."""

from __future__ import annotations

import itertools

import pytest

from tests.fixtures.spec import draft_controller, ngram_controller, spec_requests
from tokenmill.config import SpeculativeConfig
from tokenmill.engine.spec.controller import SpecController, geometric_gains, min_gain


def test_expected_emitted_tokens() -> None:
    def expected_emitted(acceptance: float, k: int) -> float:  # the target's own token plus the gains
        return 1 + sum(geometric_gains(acceptance, k))

    assert expected_emitted(1.0, 3) == 4.0
    assert expected_emitted(0.0, 3) == 1.0
    assert expected_emitted(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_a_request_with_collapsed_acceptance_stops_and_probes_every_interval() -> None:
    controller = ngram_controller(min_acceptance=0.3, probe_interval=3)
    [bad] = spec_requests(1, acceptance=0.1, prefix="bad")
    [good] = spec_requests(1, acceptance=0.9, prefix="good")
    plans = [controller.plan([bad, good]) for _ in range(8)]
    assert [p[0] for p in plans] == [0, 0, 0, 3, 0, 0, 0, 3]
    assert all(p[1] == 3 for p in plans)


def test_a_new_request_proposes_before_its_acceptance_is_judged() -> None:
    [fresh] = spec_requests(1, acceptance=0.0, drafts=2)
    assert ngram_controller().plan([fresh]) == [3]


def test_without_measurements_large_batches_do_not_speculate() -> None:
    controller = ngram_controller(max_batch_size=4)
    assert controller.plan(spec_requests(4)) == [3] * 4 and controller.is_on
    assert controller.plan(spec_requests(5)) == [0] * 5 and not controller.is_on


def _feed(controller: SpecController, a: float, b: float) -> None:
    for n in (1, 2, 4, 8, 16, 32, 64, 128) * 4:
        controller.observe(n, a + b * n)


def test_memory_bound_steps_speculate_even_in_a_large_batch() -> None:
    controller = ngram_controller(max_batch_size=4)
    _feed(controller, a=0.05, b=0.0001)  # weights streamed once per step: tokens nearly free
    assert controller.cost_fit() == pytest.approx((0.05, 0.0001))
    assert controller.plan(spec_requests(32, acceptance=0.5)) == [3] * 32


def test_compute_bound_steps_do_not_speculate_at_modest_acceptance() -> None:
    controller = ngram_controller(max_batch_size=64)
    _feed(controller, a=0.0, b=0.002)  # time proportional to tokens: 4x the tokens for ~1.9x the output
    assert controller.plan(spec_requests(8, acceptance=0.5)) == [0] * 8
    assert not controller.is_on


def test_not_adaptive_always_proposes() -> None:
    controller = ngram_controller(adaptive=False, max_batch_size=1)
    assert controller.plan(spec_requests(10, acceptance=0.0)) == [3] * 10


def test_the_k_with_the_most_tokens_per_second_is_chosen() -> None:
    controller = ngram_controller(max_batch_size=1)
    for n in (1, 2, 3, 4) * 8:
        controller.observe(n, 0.024 + 0.014 * n)  # rows cost (integer-quantized weights): 38 ms for 1, 80 for 4
    # acceptance 0.68: k=1 → 1.68 / 52 ms, k=2 → 2.14 / 66 ms (best), k=3 → 2.46 / 80 ms, plain → 1 / 38 ms
    assert controller.plan(spec_requests(1, acceptance=0.68)) == [2]
    assert controller.plan(spec_requests(1, acceptance=0.95)) == [3]
    assert controller.plan(spec_requests(1, acceptance=0.3, prefix="low")) == [0]


def test_only_decode_only_steps_feed_the_cost_fit() -> None:
    from tokenmill.engine.request import RequestStatus
    from tokenmill.engine.spec.ngram import NgramProposer
    from tokenmill.engine.spec.speculator import Speculator

    speculator = Speculator(SpeculativeConfig("ngram", 3), NgramProposer(1, 2), max_model_len=100)
    [r] = spec_requests(1)
    r.token_ids = [1, 2, 3, 1, 2]
    r.num_computed_tokens, r.status = 4, RequestStatus.RUNNING
    speculator.propose([r])
    assert r.spec_token_ids == [3, 1, 2]
    speculator.observe(4, 0.05)  # the decode token and its three proposals
    speculator.observe(40, 0.2)  # a prefill chunk joined the step
    [(tokens, seconds)] = speculator.controller.samples
    # The proposer's time is taken out: T(n) is the time of scoring n rows (drafts are priced apart).
    assert tokens == 4 and seconds == pytest.approx(0.05 - speculator._propose_s) and seconds < 0.05


def test_without_a_fit_smaller_k_are_tried_now_and_then_so_step_sizes_spread() -> None:
    controller = ngram_controller()
    ks = [controller.plan(spec_requests(1, acceptance=0.9))[0] for _ in range(64)]
    assert sorted(set(ks)) == [0, 1, 2, 3]
    assert ks.count(3) == 60


def test_measured_step_times_override_the_linear_fit_where_costs_bend() -> None:
    """Batch-1 history (1 row plain, 4 rows verifying) fits T = 36 ms + 8.7 ms a row, which says two
    requests speculating (8 rows, 106 ms at k = 3) beat plain (2 rows, 53 ms) at acceptance 0.68
    (2.42 tokens per verification). Measured, 8 rows cost 142 ms and 2 rows 47 (a 2-core CPU, integer weights):
    plain is faster, and the measured counts decide."""
    controller = ngram_controller(max_batch_size=64)
    for _ in range(100):
        controller.observe(1, 0.045)
        controller.observe(4, 0.071)
    requests = spec_requests(2, acceptance=0.68)
    assert min(controller.plan(requests)) > 0  # by the fit alone
    for _ in range(2):
        controller.observe(8, 0.142)
        controller.observe(2, 0.047)
    assert controller.predict(8, controller.cost_fit() or (0.0, 0.0)) == pytest.approx(0.142)
    # k = 1 is 4 rows, measured at 71 ms: 3.36 tokens / 71 ms beats plain's 2 / 47 ms and k = 3's 4.84 / 142 ms.
    assert controller.plan(requests) == [1, 1]
    controller.observe(4, 0.095)
    controller.observe(4, 0.095)  # the 4-row steps got slower (longer contexts): now plain wins
    assert controller.plan(requests) == [0, 0] and not controller.is_on
    # Between measured counts the estimate interpolates; beyond them it follows the fit's slope.
    fit = controller.cost_fit()
    assert fit is not None
    t4 = controller.by_count[4][0]  # the moving average after the two slower steps
    assert controller.predict(6, fit) == pytest.approx((t4 + 0.142) / 2)
    assert controller.predict(10, fit) == pytest.approx(0.142 + 2 * fit[1])


def test_the_option_not_chosen_is_measured_again_when_stale() -> None:
    """Speculating, the plain step's token count is re-measured now and then (contexts grow, so an
    old measurement flatters it); with fresh measurements of both, no exploration."""
    controller = ngram_controller(max_batch_size=64)
    for n in (1, 4) * 40:
        controller.observe(n, 0.01 + 0.001 * n)  # nearly free rows: speculation wins
    requests = spec_requests(1, acceptance=0.9)
    plans = []
    for _ in range(200):
        [k] = controller.plan(requests)
        plans.append(k)
        controller.observe(1 + k, 0.01 + 0.001 * (1 + k))
    assert 0 < plans.count(0) <= 200 // 16 and plans.count(3) >= 180
    stale = [i for i, k in enumerate(plans) if k == 0]
    assert all(b - a >= 16 for a, b in itertools.pairwise(stale))


def test_not_speculating_the_probe_proposes_one_token() -> None:
    """Compute-bound batch-32 steps (each row costs): the plain step wins, and the occasional probe
    of the other side measures the nearest count above it, one proposal a request, not K."""
    controller = ngram_controller(max_batch_size=64)
    for n in (32, 40) * 20:
        controller.observe(n, 0.005 + 0.003 * n)
    requests = spec_requests(32, acceptance=0.6)
    plans = []
    for _ in range(64):
        ks = controller.plan(requests)
        plans.append(max(ks))
        controller.observe(32 + sum(ks), 0.005 + 0.003 * (32 + sum(ks)))
    assert plans.count(0) >= 60 and set(plans) <= {0, 1} and plans.count(1) >= 1


@pytest.mark.parametrize(("base_s", "speculates"), [(0.005, False), (0.05, True)])
def test_a_gain_within_the_estimates_noise_does_not_speculate(base_s: float, speculates: bool) -> None:
    """Batch 32, every row costs 3 ms, proposals ~98% accepted: with 5 ms of fixed cost a step the best
    plan (3 proposals each) gains 2.4% by the estimates, inside their noise, so nothing is proposed;
    with 50 ms, 20%."""
    controller = ngram_controller(max_batch_size=64)
    for n in (32, 48, 64) * 8:
        controller.observe(n, base_s + 0.003 * n)
    for _ in range(100):
        controller.acceptance.record(4, 1, 1)
    ks = controller.plan(spec_requests(32), [4] * 32)
    assert any(ks) is speculates


@pytest.mark.parametrize(("batch", "speculates"), [(1, True), (8, False)])
def test_the_margin_grows_with_the_batch(batch: int, speculates: bool) -> None:
    """3 ms a step plus 3 ms a row, proposals ~99% accepted: one request's best plan (K = 3) gains ~60%,
    eight requests' ~8.5%, under batch 8's 12% margin (5% + 1 point a request; at 5% it speculated, and at
    batch 8 on Zen 5 that measured 0.98-1.13x of plain)."""
    assert min_gain(1) == pytest.approx(0.05) and min_gain(8) == pytest.approx(0.12) and min_gain(64) == 0.15
    controller = ngram_controller(max_batch_size=64)
    for n in range(1, 33):
        for _ in range(4):
            controller.observe(n, 0.003 + 0.003 * n)
    for _ in range(100):
        controller.acceptance.record(4, 1, 1)
    assert any(controller.plan(spec_requests(batch), [4] * batch)) is speculates


def test_draft_forwards_are_priced_into_the_plan() -> None:
    """Scoring rows is cheap (2 ms a row on 60 ms), acceptance 0.7: free drafts pay for K = 3; drafts
    costing 40 ms a forward (k forwards for k guesses) do not pay for any."""
    controller = draft_controller()
    for n in (1, 2, 3, 4) * 8:
        controller.observe(n, 0.06 + 0.002 * n)
    assert controller.plan(spec_requests(1, acceptance=0.7, prefix="free")) == [3]
    controller.observe_draft(0.04)
    assert controller.draft_forward_s == pytest.approx(0.04)
    assert controller.plan(spec_requests(1, acceptance=0.7, prefix="dear")) == [0]


def test_a_request_whose_guesses_were_all_dropped_is_planned_at_its_kept_rate() -> None:
    from tokenmill.engine.request import RequestStatus
    from tokenmill.engine.spec.base import Proposer
    from tokenmill.engine.spec.speculator import Speculator

    class Dropping(Proposer):
        takes_gate = True

        def propose(self, requests, num_tokens, gate=None):  # type: ignore[no-untyped-def]
            self.last_decode_forward_s = (0.02,)
            return [[] for _ in requests]

    speculator = Speculator(SpeculativeConfig("draft", 3, draft_model="d"), Dropping(), max_model_len=100)
    [r] = spec_requests(1, acceptance=1.0, drafts=0)
    r.token_ids = [1, 2, 3, 1, 2]
    r.num_computed_tokens, r.status = 4, RequestStatus.RUNNING
    speculator.propose([r])
    assert r.spec_token_ids == [] and r.spec_stats.recent_kept == pytest.approx(0.7)
    assert r.spec_stats.recent_acceptance == 1.0  # no guess was verified: nothing to say of acceptance
    assert speculator.controller.draft_forward_s == pytest.approx(0.02)
    r.spec_stats.recent_acceptance = 0.9
    assert speculator.controller._gains(r, None, 2) == pytest.approx([0.7 * 0.9, 0.7 * 0.81])


def test_a_draft_far_behind_pays_its_catch_up_before_it_proposes() -> None:
    """Cheap rows (2 ms on 60 ms), 10 ms draft forwards, acceptance 0.7: a request whose draft is in
    step proposes K; one whose draft sat out 88 tokens (80 beyond a decode-like forward, 5 ms each)
    would pay 400 ms to catch up first, charged a quarter (the steps after share it), more than its
    guesses are worth, and proposes nothing; one 28 tokens behind (25 ms charged) still proposes."""
    controller = draft_controller()
    for n in (1, 2, 3, 4) * 8:
        controller.observe(n, 0.06 + 0.002 * n)
    controller.observe_draft(0.01)
    controller.observe_catch_up(20, 0.11)
    assert controller.draft_token_s == pytest.approx(0.005)
    assert controller.plan(spec_requests(1, acceptance=0.7, prefix="in-step"), catch_up=[2]) == [3]
    assert controller.plan(spec_requests(1, acceptance=0.7, prefix="behind"), catch_up=[88]) == [0]
    assert controller.plan(spec_requests(1, acceptance=0.7, prefix="near"), catch_up=[28]) == [3]


def test_the_probe_while_off_leaves_out_drafts_far_behind() -> None:
    """Rows as dear as decodes: nothing is proposed, and the 16th plan probes one guess a request to
    re-measure, but not for a request whose draft would first have to catch up 30 tokens."""
    controller = draft_controller()
    for n in (1, 2, 4, 5) * 4:  # 3 tokens (the probe's count) never measured
        controller.observe(n, 0.05 * n)
    reqs = spec_requests(2, acceptance=0.5)
    plans = [controller.plan(reqs, catch_up=[1, 30]) for _ in range(16)]
    assert plans[:15] == [[0, 0]] * 15 and plans[15] == [1, 0]


def test_while_speculating_the_probes_alternate_plain_and_every_proposal() -> None:
    """Settled on one guess a step (two slow samples of 4 rows), the controller still re-measures
    4 rows: the 16th plan proposes all K = 3, and once that count measures fast the plan takes it.
    (Probing only plain, the counts above the chosen one were never measured again.) Plain, measured
    recently, is not probed at the 32nd."""
    controller = ngram_controller(max_batch_size=64)
    for n in (1, 2) * 8:
        controller.observe(n, 0.05 + 0.001 * n)
    controller.observe(4, 0.5)  # slow samples: 4 rows look ruinous
    controller.observe(4, 0.5)
    [r] = spec_requests(1, acceptance=0.95)
    plans = [controller.plan([r]) for _ in range(16)]
    assert plans[:15] == [[1]] * 15 and plans[15] == [3]
    for _ in range(16):
        controller.observe(4, 0.054)  # the probes: 4 rows cost little after all
    plans = [controller.plan([r]) for _ in range(16)]
    assert plans == [[3]] * 16


def test_one_slow_step_does_not_reprice_its_token_count() -> None:
    """A 2-row step measured twice at 11 ms, then once at 19 (a pause of the host): the average must stay
    near 11, not jump to 13 (the unclipped moving average), while a lasting slowdown still moves it."""
    controller = ngram_controller(max_batch_size=64)
    controller.observe(2, 0.011)
    controller.observe(2, 0.011)
    controller.observe(2, 0.019)
    assert controller.by_count[2][0] == pytest.approx(0.011 * (0.75 + 0.25 * 1.25))
    for _ in range(12):
        controller.observe(2, 0.016)
    assert controller.by_count[2][0] > 0.0155


def test_the_probe_of_every_proposal_is_at_most_twice_the_plans() -> None:
    """Speculating with one or two guesses a request at batch 8, the controller re-measures a larger
    step every 32 plans: at most twice the plan's proposals (and at least K), not all 8 x K = 120 rows."""
    controller = SpecController(SpeculativeConfig("ngram", 15, max_batch_size=64))
    for n in range(8, 33):
        for _ in range(4):
            controller.observe(n, 0.05 + 0.004 * (n - 8))
    batch = spec_requests(8, acceptance=0.9)
    plans = [controller.plan(batch) for _ in range(16)]
    chosen = sum(plans[0])
    assert 8 <= chosen <= 24 and all(sum(p) == chosen for p in plans[:15])
    assert sum(plans[15]) == max(15, 2 * chosen) and max(plans[15]) <= 15
