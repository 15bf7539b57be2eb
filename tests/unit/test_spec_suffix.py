"""Cross-request lookup: the output cache and the suffix proposer, exact proposals on crafted tokens."""

from __future__ import annotations

import random

from tokenmill.engine.request import Request, SamplingParams
from tokenmill.engine.spec.output_cache import OutputCache
from tokenmill.engine.spec.suffix import SuffixProposer


def _request(rid: str, prompt: list[int], output: list[int] = ()) -> Request:  # type: ignore[assignment]
    r = Request(rid, prompt, SamplingParams())
    r.token_ids.extend(output)
    return r


def _guess(cache: OutputCache, context: list[int], k: int) -> list[int]:
    n, entry = cache.match(context)
    return cache.continuation(entry, k) if n else []


def test_a_cached_output_continues_a_context_ending_in_one_of_its_ngrams() -> None:
    cache = OutputCache(2, 4, max_tokens=100)
    cache.add([1, 2, 3, 4, 5, 6])
    assert cache.match([9, 9, 3, 4])[0] == 2
    assert _guess(cache, [9, 9, 3, 4], 3) == [5, 6]  # the output ends there: fewer than k
    assert _guess(cache, [7, 2, 3, 4], 2) == [5, 6]
    assert _guess(cache, [8, 4], 3) == []  # a 1-gram is below min_n
    assert _guess(cache, [5, 6], 3) == []  # the output's last n-gram has no continuation


def test_the_longest_match_wins_and_the_latest_output_among_equals() -> None:
    cache = OutputCache(2, 4, max_tokens=100)
    cache.add([1, 2, 3, 4, 5])
    cache.add([7, 2, 3, 9])
    assert _guess(cache, [1, 2, 3], 2) == [4, 5]  # 3 tokens matched in the first output
    assert _guess(cache, [0, 2, 3], 2) == [9]  # (2, 3) last continued with 9
    assert cache.match([1, 2, 3])[0] == 3 and cache.match([0, 2, 3])[0] == 2


def test_the_oldest_outputs_are_evicted_past_the_token_budget() -> None:
    cache = OutputCache(2, 3, max_tokens=10)
    cache.add([1, 2, 3, 4, 5, 6])
    cache.add([2, 3, 7, 8, 9, 10])  # 12 tokens > 10: the first output goes
    assert len(cache) == 1 and cache.num_tokens == 6
    assert _guess(cache, [4, 5], 1) == []  # only the evicted output had (4, 5)
    assert _guess(cache, [2, 3], 2) == [7, 8]  # a key the second output took over survives the eviction
    cache.add(list(range(100, 130)))  # longer than the whole budget: its last 10 tokens
    assert cache.num_tokens == 10 and len(cache) == 1
    assert _guess(cache, [121, 122], 2) == [123, 124] and _guess(cache, [101, 102], 1) == []


def test_a_lead_in_of_context_guesses_an_outputs_first_tokens_but_is_never_proposed_itself() -> None:
    cache = OutputCache(2, 3, max_tokens=100)
    cache.add([7, 8, 9, 1, 2, 3], lead_in=3)  # a prompt ending 7 8 9 was answered 1 2 3
    assert _guess(cache, [5, 7, 8, 9], 4) == [1, 2, 3]
    assert _guess(cache, [5, 7, 8], 2) == []  # 9 is context, not output
    cache.add([4, 5, 6, 1, 2, 7], lead_in=3)
    assert _guess(cache, [0, 6, 1, 2], 1) == [7]
    cache = OutputCache(2, 3, max_tokens=4)
    cache.add([7, 8, 9, 1, 2, 3], lead_in=3)  # over the budget: the last 4 tokens, one of them lead-in
    assert cache.num_tokens == 4 and _guess(cache, [9, 1], 2) == [2, 3] and _guess(cache, [8, 9], 1) == []


def test_an_evicted_entry_found_before_eviction_continues_nothing() -> None:
    cache = OutputCache(2, 2, max_tokens=6)
    cache.add([1, 2, 3, 4])
    n, entry = cache.match([1, 2])
    cache.add([5, 6, 7, 8])  # evicts the first
    assert n == 2 and cache.continuation(entry, 2) == []


def test_memory_stays_bounded_by_the_token_budget() -> None:
    rng = random.Random(0)
    cache = OutputCache(2, 4, max_tokens=500)
    for _ in range(200):
        cache.add([rng.randrange(50) for _ in range(rng.randrange(3, 60))])
    assert cache.num_tokens <= 500
    assert cache.num_entries <= 3 * cache.num_tokens  # entries of evicted outputs were removed
    cache.clear()
    assert cache.num_tokens == 0 and cache.num_entries == 0 and cache.match([1, 2, 3]) == (0, -1)


def test_a_finished_requests_output_joins_the_cache_after_its_prompts_end() -> None:
    proposer = SuffixProposer(1, 3, cache_tokens=1000)
    done = _request("a", [40, 50, 51, 52], [10, 11, 12, 13])
    assert proposer.buckets([done]) == [0]  # nothing cached yet, nothing repeats in its own context
    proposer.forget("a")
    later = _request("b", [60, 61, 62], [10, 11])
    assert proposer.buckets([later]) == [-2]  # (10, 11) in the cache: bucket -n for a cached match
    assert proposer.propose([later], [5]) == [[12, 13]]
    same_header = _request("c", [61, 51, 52])  # the prompt's last tokens were the output's lead-in
    assert proposer.buckets([same_header]) == [-2] and proposer.propose([same_header], [2]) == [[10, 11]]
    assert proposer.buckets([_request("d", [61, 50, 51])]) == [0]  # the prompt itself is never proposed
    assert proposer.buckets([_request("e", [61, 40, 50])]) == [0]  # nor what is past the lead-in


def test_the_requests_own_match_wins_ties_and_the_cache_wins_when_longer() -> None:
    proposer = SuffixProposer(1, 4, cache_tokens=1000)
    proposer.buckets([_request("a", [1], [7, 8, 9, 20, 21])])
    proposer.forget("a")
    own_tie = _request("b", [7, 8, 30, 31, 7, 8])  # (7, 8) in its own context and in the cache
    assert proposer.buckets([own_tie]) == [2]
    assert proposer.propose([own_tie], [2]) == [[30, 31]]
    longer = _request("c", [8, 40, 41, 7, 8, 9])  # own: (8) once; cache: (7, 8, 9)
    assert proposer.buckets([longer]) == [-3]
    assert proposer.propose([longer], [3]) == [[20, 21]]


def test_propose_without_buckets_decides_on_the_context_it_is_given() -> None:
    proposer = SuffixProposer(1, 3, cache_tokens=1000)
    proposer.buckets([_request("a", [1], [4, 5, 6, 7])])
    proposer.forget("a")
    r = _request("b", [9, 4])
    assert proposer.buckets([r]) == [0]
    r.token_ids.append(5)  # one more token since buckets(): the stale choice is not used
    assert proposer.propose([r], [2]) == [[6, 7]]


def test_a_preempted_request_is_cached_once_when_it_finishes_after_resuming() -> None:
    proposer = SuffixProposer(1, 3, cache_tokens=1000)
    r = _request("a", [1, 2], [3, 4, 5])
    proposer.buckets([r])
    proposer.retain([])  # preempted: not running
    proposer.forget("a")  # aborted while waiting: not seen decoding since, nothing to cache
    assert len(proposer.cache) == 0
    proposer.buckets([r])
    r.token_ids.extend([6, 7])
    proposer.forget("a")
    proposer.forget("a")
    assert len(proposer.cache) == 1 and proposer.cache.num_tokens == 2 + 5  # the prompt's 2 as lead-in


def test_cache_buckets_have_their_own_priors() -> None:
    proposer = SuffixProposer(1, 4, cache_tokens=10)
    assert proposer.bucket_prior(-2) == 0.6 and proposer.bucket_prior(-4) == 0.85
    assert proposer.bucket_prior(4) == 0.9 and proposer.bucket_prior(1) == 0.4  # the prompt lookup's
    assert proposer.cache.min_n == 2  # a cached 1-token match is noise: never proposed


def test_the_vectorised_keys_are_the_ngrams_own_keys() -> None:
    """_keys computes every n-gram's key at once with wrapping int64 arithmetic; match() computes a
    context's one by one in Python: both must be key_of's, or a cached n-gram could never be found."""
    from tokenmill.engine.spec.output_cache import key_of, salt_key

    rng = random.Random(3)
    tokens = [rng.randrange(200_000) for _ in range(40)]
    cache = OutputCache(1, 5, max_tokens=100)
    for salt in (0, salt_key("tenant")):  # a salted output's keys: key_of's XOR the salt's
        for n, keys, entries in cache._keys(0, tokens, 2, salt):
            assert keys == [key_of(tokens[e - n:e]) ^ salt for e in entries]
            assert entries[0] == max(2, n)
    cache.add(tokens, lead_in=2)
    for end in range(6, 40):
        n, entry = cache.match([7, *tokens[end - 5:end]])
        assert (n, entry & 0xFFFFFFFF) == (5, end)
