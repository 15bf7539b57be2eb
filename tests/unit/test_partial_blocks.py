"""Partial blocks (engine/kv_cache.py): a freed request's partly filled last block is kept under its
parent hash and all its tokens; a request continuing exactly those tokens copies its rows into a fresh block
(exact block ids and copies). Block size 4 throughout."""

from __future__ import annotations

from tokenmill.engine.interfaces import BlockCopy
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import Request, SamplingParams

BS = 4


def _run(kv: KVCacheManager, rid: str, tokens: list[int], salt: str | None = None) -> Request:
    """A request that computed all its tokens (a finished prefill) and is freed."""
    request = Request(rid, tokens, SamplingParams(max_tokens=1), cache_salt=salt)
    assert kv.allocate(request, len(tokens))
    request.num_computed_tokens = len(tokens)
    kv.commit_computed(request)
    kv.free(request)
    return request


def test_a_continuation_copies_the_partial_block_and_computes_only_its_new_tokens() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True, reuse_partial_blocks=True)
    _run(kv, "parent", [1, 2, 3, 4, 5, 6])  # blocks 0 (full, cached) and 1 (rows 5, 6: a partial block)
    child = Request("child", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=1))
    cached = kv.find_cached_prefix(child)
    assert cached == [0] and kv.find_cached_partial(child, 1) == (1, 2)
    copy = kv.allocate_with_copy(child, 1, cached, (1, 2))
    assert copy == BlockCopy(src=1, dst=2, num_rows=2)  # a fresh block: the source stays as it was
    assert kv.block_tables["child"] == [0, 2] and kv.pool.blocks[1].ref_count == 0
    assert kv.pool.partial == {(child.block_hashes[0], (5, 6)): 1}  # siblings (other beams) copy it too


def test_only_the_whole_partial_block_is_a_key() -> None:
    # a prefix of its tokens would tell another client, token by token, how another prompt began
    kv = KVCacheManager(8, BS, enable_prefix_caching=True, reuse_partial_blocks=True)
    _run(kv, "first", [1, 2, 3, 4, 5, 6, 7])
    diverging = Request("b", [1, 2, 3, 4, 5, 6, 9, 9], SamplingParams(max_tokens=1))
    assert kv.find_cached_prefix(diverging) == [0] and kv.find_cached_partial(diverging, 1) is None
    same_prompt = Request("c", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=1))  # must compute its last token
    assert kv.find_cached_partial(same_prompt, 1) is None


def test_salts_and_eviction_bound_it() -> None:
    kv = KVCacheManager(3, BS, enable_prefix_caching=True, reuse_partial_blocks=True)
    _run(kv, "salted", [1, 2], salt="a")  # a partial first block: its parent is the salt's root
    assert kv.find_cached_partial(Request("x", [1, 2, 3], SamplingParams(), cache_salt="a"), 0) == (0, 2)
    assert kv.find_cached_partial(Request("y", [1, 2, 3], SamplingParams()), 0) is None
    assert kv.find_cached_partial(Request("z", [1, 2, 3], SamplingParams(), cache_salt="b"), 0) is None
    taker = Request("t", list(range(10, 22)), SamplingParams())
    assert kv.allocate(taker, 12)  # every block: the partial one is evicted with its key
    assert kv.pool.partial == {} and kv.pool.blocks[0].partial_key is None


def test_off_without_prefix_caching_and_for_prompt_logprobs() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=False, reuse_partial_blocks=True)
    _run(kv, "p", [1, 2, 3, 4, 5, 6])
    assert kv.pool.partial == {}
    kv = KVCacheManager(8, BS, enable_prefix_caching=True, reuse_partial_blocks=True)
    _run(kv, "p", [1, 2, 3, 4, 5, 6])
    logprobs = Request("l", [1, 2, 3, 4, 5, 6, 7], SamplingParams(prompt_logprobs=1))
    assert kv.find_cached_partial(logprobs, 1) is None  # every prompt position must be computed


def test_a_continued_partial_block_is_the_next_block_taken_once_the_step_is_scheduled() -> None:
    """Never-used blocks cost page faults on first write (docs/performance.md): a partial block that a step's
    requests continued is reused first. Siblings in the same step still find it; only then is it demoted."""
    kv = KVCacheManager(8, BS, enable_prefix_caching=True, reuse_partial_blocks=True)
    _run(kv, "parent", [1, 2, 3, 4, 5, 6])  # block 0 full, block 1 partial (rows 5, 6); free queue 2..7, 1, 0
    children = [Request(f"c{i}", [1, 2, 3, 4, 5, 6, 7 + i], SamplingParams(max_tokens=1)) for i in range(2)]
    copies = []
    for child in children:  # two beams continuing one parent in one step
        cached = kv.find_cached_prefix(child)
        assert kv.find_cached_partial(child, len(cached)) == (1, 2)
        copies.append(kv.allocate_with_copy(child, 1, cached, (1, 2)))
    assert copies == [BlockCopy(1, 2, 2), BlockCopy(1, 3, 2)]
    assert list(kv.pool.free_queue)[:2] == [4, 5]  # not yet: the step is still being scheduled
    kv.demote_superseded()
    assert list(kv.pool.free_queue)[:2] == [1, 4] and kv.pool.partial[(children[0].block_hashes[0], (5, 6))] == 1
    other = Request("other", [9, 9, 9], SamplingParams(max_tokens=1))
    assert kv.allocate(other, 3) and kv.block_tables["other"] == [1]  # the warm block, not never-used 4
    assert kv.pool.partial == {}  # evicted with its key
