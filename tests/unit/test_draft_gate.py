"""The draft gate's guess-by-guess decisions (spec/draft_gate.py) and how kept guesses are scored."""

from __future__ import annotations

import pytest

from tests.fixtures.spec import draft_controller, spec_requests


def test_without_measurements_the_gate_keeps_guesses_while_their_gain_is_half() -> None:
    """Priors: a guess at confidence p is accepted about p of the time (its bin's middle); a guess is
    kept while the product of its request's kept guesses' rates is >= 0.5."""
    gate = draft_controller().gate(1)
    assert gate.keep("a", 0.99)  # 0.975
    assert gate.keep("a", 0.85)  # 0.975 * 0.85 = 0.83
    assert gate.keep("a", 0.75)  # 0.62
    assert not gate.keep("a", 0.75)  # 0.47
    assert not gate.keep("b", 0.45)  # 0.4: a request's first guess may be dropped too
    assert gate.keep("c", 0.55) and gate.rows == 4  # 0.55, its own chain


@pytest.mark.parametrize(("row_s", "kept"), [(0.05, [True, True, False]), (0.001, [True, True, True])])
def test_the_gate_keeps_a_guess_while_it_pays_for_its_row(row_s: float, kept: list[bool]) -> None:
    """Measured scoring times T(n) = 50 ms + row_s * n. Expensive rows (50 ms, as much as a decode):
    the guesses at 0.99 and 0.85 pay (gains 0.975, 0.83 against a break-even of 0.5 and 0.66), one at
    0.45 (gain 0.33) does not; where rows cost 1 ms every one pays."""
    controller = draft_controller()
    for n in (1, 2, 3, 4) * 8:
        controller.observe(n, 0.05 + row_s * n)
    controller.plan(spec_requests(1, prefix="a"))  # the gate predicts step times as the step's plan did
    gate = controller.gate(1)
    assert [gate.keep("a0", p) for p in (0.99, 0.85, 0.45)] == kept


def test_kept_guesses_are_scored_into_their_confidence_bins_once_verified() -> None:
    """Three guesses kept (bins of 0.99, 0.85, 0.2), the first accepted: bin 7 reached and accepted,
    bin 5 reached and rejected, bin 0 never reached (nothing learnt about it)."""
    controller = draft_controller()
    [r] = spec_requests(1, acceptance=0.9)
    assert controller.plan([r]) == [3]
    gate = controller.gate(1)
    with pytest.MonkeyPatch.context() as mp:  # keep the third guess too, whatever its gain
        mp.setattr("tokenmill.engine.spec.draft_gate._KEEP_GAIN_UNFITTED", 0.0)
        assert [gate.keep(r.request_id, p) for p in (0.99, 0.85, 0.2)] == [True, True, True]
    stats = r.spec_stats  # what Scheduler._record_spec does after verification: 3 proposed, 1 accepted
    stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens = stats.num_drafts + 1, 13, 1
    controller.plan([r])
    assert controller.confidence_rate(7) == pytest.approx((1 + 2 * 0.975) / 3)  # prior: 2 drafts at 0.975
    assert controller.confidence_rate(5) == pytest.approx((0 + 2 * 0.85) / 3)
    assert sorted(controller.confidence.rates()) == [5, 7]
