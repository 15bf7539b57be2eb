"""The speculator's use of a grammar's forced tokens: exact proposals per request."""

from __future__ import annotations

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


def _speculator(forced: dict[str, list[int]]) -> Speculator:
    speculator = Speculator(SpeculativeConfig("ngram", 7, adaptive=False), NgramProposer(1, 4), max_model_len=1000)
    speculator.forced_tokens = lambda r: list(forced.get(r.request_id, []))
    return speculator


def test_forced_tokens_are_the_proposal_where_a_lookup_has_nothing_better() -> None:
    requests = [
        _decoding("none", [1, 2, 3]),  # no lookup match: the forced tokens
        _decoding("longer", [5, 6, 7, 8, 9, 5, 6]),  # lookup 7 8 9 5 6 ... starts with the forced 7 8
        _decoding("disagrees", [5, 6, 7, 8, 9, 5, 6]),  # lookup 7 8 9 ... against the forced 4
        _decoding("plain", [5, 6, 7, 8, 9, 5, 6], structured=False),  # no grammar: the lookup
        _decoding("empty", [1, 2, 3]),  # the grammar forces nothing here: nothing (no match either)
    ]
    speculator = _speculator({"none": [40, 41], "longer": [7, 8], "disagrees": [4], "plain": [99]})
    speculator.propose(requests)
    proposals = {r.request_id: r.spec_token_ids for r in requests}
    assert proposals == {"none": [40, 41], "longer": [7, 8, 9, 5, 6, 7, 8], "disagrees": [4],
                         "plain": [7, 8, 9, 5, 6, 7, 8], "empty": []}
    assert speculator.last_forced == 3  # "none" and "disagrees"


def test_forced_proposals_have_their_own_bucket_and_prior() -> None:
    speculator = _speculator({"a": [40]})
    assert speculator.controller.bucket_prior is not None
    assert speculator.controller.bucket_prior(FORCED_BUCKET) == FORCED_PRIOR
    assert speculator.controller.bucket_prior(4) == 0.9  # the proposer's own priors otherwise
    speculator.forced_tokens = None
    request = _decoding("a", [1, 2, 3])
    speculator.propose([request])
    assert request.spec_token_ids == [] and speculator.last_forced == 0
