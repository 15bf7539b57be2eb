"""N-gram (prompt lookup) proposer: exact proposals on crafted token sequences."""

from __future__ import annotations

import pytest

from tokenmill.engine.spec.ngram import NgramProposer


def _propose(tokens: list[int], k: int, ngram_min: int = 1, ngram_max: int = 3) -> list[int]:
    return NgramProposer(ngram_min, ngram_max).propose_one("r", tokens, k)


def test_continues_the_earlier_occurrence_of_the_suffix() -> None:
    assert _propose([1, 2, 3, 4, 9, 1, 2, 3], k=2) == [4, 9]


def test_the_longest_matching_suffix_wins_over_a_later_shorter_one() -> None:
    # (3, 5) occurred at 0 and continued with 1 9 5; the lone 5 last continued with 2 3 5.
    tokens = [3, 5, 1, 9, 5, 2, 3, 5]
    assert _propose(tokens, k=3, ngram_max=2) == [1, 9, 5]
    assert _propose(tokens, k=3, ngram_min=1, ngram_max=1) == [1, 9, 5]  # 5 after 3 agrees further back
    assert _propose([4, 5, 1, 9, 5, 2, 3, 5], k=3, ngram_max=1) == [2, 3, 5]  # neither does: the latest


def test_the_latest_earlier_occurrence_of_an_ngram_is_used() -> None:
    assert _propose([1, 2, 1, 3, 1], k=1, ngram_max=1) == [3]


def test_of_several_occurrences_the_one_agreeing_furthest_back_is_continued() -> None:
    """(7, 8, 9) occurred after (1, 2) continuing with 10 and after (3) continuing with 11; the context
    reads 1 2 7 8 9, so it continues the first, not the latest (code's `merged[-1][1` runs)."""
    tokens = [1, 2, 7, 8, 9, 10, 3, 7, 8, 9, 11, 1, 2, 7, 8, 9]
    assert _propose(tokens, k=2) == [10, 3]
    assert _propose([5, 6, *tokens[2:]], k=2) == [11, 1]  # no agreement before the suffix: the latest


def test_no_match_of_at_least_ngram_min_tokens_proposes_nothing() -> None:
    assert _propose([1, 2, 3, 4], k=3) == []
    assert _propose([7, 1, 8, 2, 1], k=3, ngram_min=2) == []  # only the 1-gram (1) repeats
    assert _propose([5], k=3) == []


def test_a_periodic_context_runs_its_period_on_into_the_proposal() -> None:
    assert _propose([4, 1, 2, 3, 1, 2, 3], k=5) == [1, 2, 3, 1, 2]
    assert _propose([8, 8, 8], k=4) == [8, 8, 8, 8]


def test_proposals_are_at_most_k_tokens() -> None:
    assert _propose([1, 2, 3, 4, 5, 6, 1, 2], k=3) == [3, 4, 5]


@pytest.mark.parametrize("seed", range(5))
def test_the_incremental_index_agrees_with_a_fresh_one(seed: int) -> None:
    import random

    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(8)]
    proposer = NgramProposer(1, 4)
    for _ in range(40):
        assert proposer.propose_one("r", tokens, 4) == NgramProposer(1, 4).propose_one("x", list(tokens), 4)
        tokens.append(rng.randrange(4))


def test_forget_and_retain_drop_indexes() -> None:
    proposer = NgramProposer(1, 2)
    for rid in ("a", "b", "c"):
        proposer.propose_one(rid, [1, 2, 1], 2)
    proposer.forget("a")
    proposer.retain(["b"])
    assert list(proposer._indexes) == ["b"]


def test_the_bucket_is_the_matched_suffix_length_and_propose_reuses_the_match() -> None:
    from tokenmill.engine.request import Request, SamplingParams

    proposer = NgramProposer(1, 4)
    a = Request("a", [5, 6, 7, 8, 9, 5, 6, 7, 8], SamplingParams())
    b = Request("b", [1, 2, 3, 9, 2], SamplingParams())
    c = Request("c", [1, 2, 3, 4], SamplingParams())
    a.token_ids, b.token_ids, c.token_ids = list(a.prompt_token_ids), list(b.prompt_token_ids), list(c.prompt_token_ids)
    assert proposer.buckets([a, b, c]) == [4, 1, 0]
    assert proposer.propose([a, b, c], [2, 2, 2]) == [[9, 5], [3, 9], []]
    a.token_ids.append(1)  # the context moved on: the cached match is stale and looked up again
    assert proposer.propose([a], [2]) == [[]]
