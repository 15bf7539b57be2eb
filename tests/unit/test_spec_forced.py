"""The speculator's use of a grammar's forced tokens: exact proposals per request."""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.config import SpeculativeConfig
from tokenmill.engine.request import Request, RequestStatus, SamplingParams
from tokenmill.engine.spec.ngram import NgramProposer
from tokenmill.engine.spec.speculator import FORCED_BUCKET, FORCED_PRIOR, Speculator
from tokenmill.engine.structured import StructuredOutputParams

JSON = StructuredOutputParams.json({"type": "object"})


def _decoding(rid: str, tokens: list[int], structured: bool = True) -> Request:
    params = SamplingParams(max_tokens=100, structured=JSON if structured else None)
    r = Request(rid, tokens, params)
    r.status = RequestStatus.RUNNING
    r.num_computed_tokens = len(tokens) - 1
    return r


class _Grammar:
    """Forced tokens per request id; a request's guess is valid up to its first token in invalid[id]."""

    def __init__(self, forced: dict[str, list[int]], invalid: dict[str, set[int]]) -> None:
        self.forced, self.invalid = forced, invalid

    def forced_tokens(self, request: Request) -> list[int]:
        return list(self.forced.get(request.request_id, []))

    def count_valid(self, request: Request, tokens: Sequence[int]) -> int:
        bad = self.invalid.get(request.request_id, set())
        return next((i for i, t in enumerate(tokens) if t in bad), len(tokens))


def _speculator(forced: dict[str, list[int]], invalid: dict[str, set[int]] | None = None) -> Speculator:
    speculator = Speculator(SpeculativeConfig("ngram", 7, adaptive=False), NgramProposer(1, 4), max_model_len=1000)
    speculator.grammar = _Grammar(forced, invalid or {})
    return speculator


def test_forced_tokens_are_the_proposal_where_a_lookup_has_nothing_better() -> None:
    """A lookup the grammar allows for at least as many tokens as it forces is the proposal (it holds
    the forced bytes in the model's own split and goes on); otherwise the forced tokens are."""
    lookup = [5, 6, 7, 8, 9, 5, 6]  # a lookup of 5 6 proposes 7 8 9 5 6 7 8
    requests = [
        _decoding("none", [1, 2, 3]),  # no lookup match: the forced tokens
        _decoding("valid", lookup),  # the whole guess valid: the guess
        _decoding("other-split", lookup),  # valid for 3 tokens (9 is not), forced 2 other tokens: the guess
        _decoding("invalid", lookup),  # valid for 2 tokens only (8 is not), forced 3: the forced tokens
        _decoding("plain", lookup, structured=False),  # no grammar: the lookup
        _decoding("empty", [1, 2, 3]),  # the grammar forces nothing here: nothing (no match either)
    ]
    speculator = _speculator({"none": [40, 41], "valid": [7, 8], "other-split": [70, 71], "invalid": [4, 4, 4],
                              "plain": [99]}, {"other-split": {9}, "invalid": {8}})
    speculator.propose(requests)
    proposals = {r.request_id: r.spec_token_ids for r in requests}
    guess = [7, 8, 9, 5, 6, 7, 8]
    assert proposals == {"none": [40, 41], "valid": guess, "other-split": guess, "invalid": [4, 4, 4],
                         "plain": guess, "empty": []}
    assert speculator.last_forced == 5  # "none" and "invalid"


def test_forced_proposals_have_their_own_bucket_and_prior() -> None:
    speculator = _speculator({"a": [40]})
    assert speculator.controller.bucket_prior is not None
    assert speculator.controller.bucket_prior(FORCED_BUCKET) == FORCED_PRIOR
    assert speculator.controller.bucket_prior(4) == 0.9  # the proposer's own priors otherwise
    speculator.grammar = None
    request = _decoding("a", [1, 2, 3])
    speculator.propose([request])
    assert request.spec_token_ids == [] and speculator.last_forced == 0


def test_a_lookup_valid_for_all_k_tokens_wins_over_a_longer_forced_run() -> None:
    """The grammar forces 9 tokens, a step verifies K = 7: a lookup the grammar allows for all 7 holds as
    much of the run as a step can take, in the model's own split; valid for 6 only, it does not."""
    lookup = [5, 6, 1, 2, 3, 4, 10, 11, 12, 5, 6]  # 5 6 again: the guess is 1 2 3 4 10 11 12
    requests = [_decoding("long", lookup), _decoding("short", lookup)]
    speculator = _speculator({"long": [70] * 9, "short": [70] * 9}, {"short": {12}})
    speculator.propose(requests)
    assert requests[0].spec_token_ids == [1, 2, 3, 4, 10, 11, 12]
    assert requests[1].spec_token_ids == [70] * 7


def test_a_prediction_the_grammar_refuses_does_not_displace_a_lookup_it_allows() -> None:
    """Forced [7, 8]; the lookup guesses 7 8 9 ..., valid; the prediction says 50 51 ..., which the grammar
    refuses: the lookup is the proposal. Where the prediction is valid it wins (its own bucket)."""
    from dataclasses import replace

    lookup = [5, 6, 7, 8, 9, 5, 6]
    refused, allowed = _decoding("refused", lookup), _decoding("allowed", lookup)
    refused.params = replace(refused.params, prediction=[50, 51, 52])
    allowed.params = replace(allowed.params, prediction=[7, 8, 60])
    speculator = _speculator({"refused": [7, 8], "allowed": [7, 8]}, {"refused": {50}})
    speculator.propose([refused, allowed])
    assert refused.spec_token_ids == [7, 8, 9, 5, 6, 7, 8] and not refused.spec_from_prediction
    assert allowed.spec_token_ids == [7, 8, 60] and allowed.spec_from_prediction
