"""`--speculative ngram-draft`: a lookup where the context repeats (3+ tokens), the draft elsewhere;
the lookups cost no draft forward in the plan and do not move the draft's kept rate. `suffix-draft`:
the same with the cache of recent outputs as a lookup too."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from tokenmill.config import SpeculativeConfig
from tokenmill.engine.request import Request, RequestStatus, SamplingParams
from tokenmill.engine.spec.base import ProposalGate, Proposer
from tokenmill.engine.spec.controller import SpecController
from tokenmill.engine.spec.hybrid import LookupDraftProposer
from tokenmill.engine.spec.ngram import NgramProposer
from tokenmill.engine.spec.speculator import Speculator
from tokenmill.engine.spec.suffix import SuffixProposer


class _Draft(Proposer):
    """Guesses 7, 7, ... for whatever it is asked; 12 tokens behind on every request it was not
    asked for; records its calls."""

    takes_gate = True

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.forgotten: list[str] = []

    def propose(self, requests: list[Request], num_tokens: list[int],
                gate: ProposalGate | None = None) -> list[list[int]]:
        self.calls.append([r.request_id for r in requests])
        self.last_decode_forward_s = (0.03,) * max(num_tokens, default=0)
        return [[7] * k for k in num_tokens]

    def catch_up_tokens(self, requests: list[Request]) -> list[int]:
        return [12] * len(requests)

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)

    def retain(self, request_ids: Iterable[str]) -> None:
        pass


def _running(rid: str, tokens: list[int]) -> Request:
    r = Request(rid, tokens, SamplingParams())
    r.num_computed_tokens, r.status = len(tokens) - 1, RequestStatus.RUNNING
    return r


def _hybrid() -> tuple[LookupDraftProposer, _Draft]:
    draft = _Draft()
    return LookupDraftProposer(NgramProposer(1, 4), draft), draft  # type: ignore[arg-type]


COPYING = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4]  # its last 4 tokens occurred before: continues 5, 6, 9
ONE_TOKEN_MATCH = [1, 2, 3, 4, 8, 8, 5, 1]  # only "1" recurs: a guess, left to the draft


def test_long_matches_look_up_and_the_rest_go_to_the_draft() -> None:
    hybrid, draft = _hybrid()
    copying, other = _running("copy", COPYING), _running("other", ONE_TOKEN_MATCH)
    assert hybrid.buckets([copying, other]) == [4, None]
    assert hybrid.catch_up_tokens([copying, other]) == [0, 12]  # a lookup needs no catch-up now
    assert hybrid.propose([copying, other], [3, 2]) == [[5, 6, 9], [7, 7]]
    assert draft.calls == [["other"]]  # the draft never ran for the lookup
    assert hybrid.last_decode_forward_s == (0.03, 0.03)
    assert hybrid.bucket_prior(4) == NgramProposer(1, 4).bucket_prior(4)
    hybrid.buckets([copying])
    hybrid.propose([copying], [2])
    assert draft.calls == [["other"]] and hybrid.last_decode_forward_s == ()  # no draft forward this step
    hybrid.forget("other")
    assert draft.forgotten == ["other"]


def test_a_lookup_is_not_charged_a_draft_forward() -> None:
    """Rows cost 2 ms on 60, a draft forward 40 ms: the draft's guesses (κ·α = 0.7) do not pay for
    their forwards, a 4-token match's (prior 0.9) pays for its rows alone."""
    controller = SpecController(SpeculativeConfig("ngram-draft", 3, draft_model="d"), NgramProposer(1, 4).bucket_prior)
    for n in (1, 2, 3, 4) * 8:
        controller.observe(n, 0.06 + 0.002 * n)
    controller.observe_draft(0.04)
    drafted, looked_up = _running("d", [1, 2]), _running("l", [1, 2])
    for r in (drafted, looked_up):
        r.spec_stats.num_drafts, r.spec_stats.recent_acceptance = 10, 0.7
    assert controller.plan([drafted, looked_up], [None, 4]) == [0, 3]


def test_the_draft_kept_rate_moves_only_with_the_drafts() -> None:
    hybrid, _ = _hybrid()
    speculator = Speculator(SpeculativeConfig("ngram-draft", 3, draft_model="d", adaptive=True), hybrid, 100)
    copying, other = _running("copy", COPYING), _running("other", ONE_TOKEN_MATCH)
    copying.spec_stats.recent_kept = other.spec_stats.recent_kept = 0.5
    speculator.propose([copying, other])
    assert copying.spec_token_ids == [5, 6, 9] and other.spec_token_ids == [7, 7, 7]  # both proposed (fresh: K)
    assert other.spec_stats.recent_kept == pytest.approx(0.65)  # a draft got past the gate
    assert copying.spec_stats.recent_kept == 0.5  # untouched: a lookup passes no gate
    assert speculator.wants_target_confidence  # the draft's requests are revived from the target's confidence


def test_suffix_draft_looks_up_earlier_outputs_and_drafts_the_rest() -> None:
    """`suffix-draft`: a 3+ token match in the cache of finished outputs proposes what followed it there
    (bucket -n, no draft forward); a request matching neither its own context nor the cache is drafted;
    a finished request's output joins the cache (the gauge's count goes through the hybrid)."""
    draft = _Draft()
    hybrid = LookupDraftProposer(SuffixProposer(1, 4, 1000), draft)  # type: ignore[arg-type]
    answered = _running("answered", [40, 41, 42])
    answered.token_ids += [50, 51, 52, 53, 54, 55]  # its output
    answered.prompt_token_ids = [40, 41, 42]
    hybrid.buckets([answered])
    hybrid.forget("answered")
    assert hybrid.cached_tokens == 9
    asking, fresh = _running("asking", [30, 31, 50, 51, 52]), _running("fresh", [60, 61, 62, 63])
    assert hybrid.buckets([asking, fresh]) == [-3, None]
    assert hybrid.propose([asking, fresh], [3, 2]) == [[53, 54, 55], [7, 7]]
    assert draft.calls == [["fresh"]]
    assert hybrid.catch_up_tokens([asking, fresh]) == [0, 12]
    short = _running("short", [30, 31, 32, 51, 52])  # a 2-token cached match: the draft's, as with lookups
    assert hybrid.buckets([short]) == [None]
