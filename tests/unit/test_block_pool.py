"""Exact block ids and eviction order of the block pool and the KV cache manager.

Free queue: head → [least recently freed ... most recently freed] ← tail. Allocation pops the
head; freeing a request pushes its blocks last block first; a cache hit pulls a refcount-0 block
out of the queue wherever it sits.
"""

from __future__ import annotations

from tokenmill.engine.kv_cache import BlockPool, KVCacheManager
from tokenmill.engine.request import Request, SamplingParams

BS = 4  # block size of every manager below


def _request(rid: str, token_ids: list[int]) -> Request:
    return Request(rid, token_ids, SamplingParams(max_tokens=8))


def _queue(pool: BlockPool) -> list[int]:
    return list(pool.free_queue)


def _admit(kv: KVCacheManager, request: Request) -> list[int]:
    """What the scheduler does for a whole-prompt prefill: look up, allocate, compute, publish."""
    cached = kv.find_cached_prefix(request)
    num_cached_tokens = len(cached) * BS
    assert kv.allocate(request, request.num_tokens - num_cached_tokens, cached)
    kv.record_lookup(request.num_tokens, num_cached_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.commit_computed(request)
    return cached


# ---- BlockPool --------------------------------------------------------------------------------


def test_allocate_pops_from_the_head_in_id_order() -> None:
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    assert _queue(pool) == [3, 4, 5]
    assert [pool.blocks[i].ref_count for i in range(6)] == [1, 1, 1, 0, 0, 0]


def test_release_appends_to_the_tail_in_the_given_order() -> None:
    pool = BlockPool(6)
    pool.allocate(3)
    pool.release([1, 0])
    assert _queue(pool) == [3, 4, 5, 1, 0]
    assert pool.allocate(4) == [3, 4, 5, 1]
    assert pool.num_free == 1


def test_release_of_a_shared_block_keeps_it_out_of_the_queue_until_the_last_reference() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    pool.touch([0])
    assert pool.blocks[0].ref_count == 2
    pool.release([0])
    assert _queue(pool) == [1, 2]
    pool.release([0])
    assert _queue(pool) == [1, 2, 0]


def test_touch_takes_a_refcount_zero_block_out_of_the_middle_of_the_queue() -> None:
    pool = BlockPool(5)
    pool.allocate(5)
    pool.release([4, 3, 2, 1, 0])
    pool.touch([2])
    assert _queue(pool) == [4, 3, 1, 0]
    assert pool.blocks[2].ref_count == 1


def test_allocating_a_cached_block_evicts_its_hash() -> None:
    pool = BlockPool(2)
    pool.allocate(2)
    pool.register(0, 111)
    pool.register(1, 222)
    pool.release([1, 0])
    assert pool.lookup(111) == 0 and pool.lookup(222) == 1
    assert pool.allocate(1) == [1]  # head of the queue: the block released first
    assert pool.lookup(222) is None and pool.blocks[1].block_hash is None
    assert pool.lookup(111) == 0
    assert pool.stats.evictions == 1


def test_registering_a_duplicate_hash_keeps_the_block_private() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    pool.register(0, 7)
    pool.register(1, 7)
    assert pool.lookup(7) == 0
    assert pool.blocks[1].block_hash is None
    pool.release([1, 0])
    # Reusing the private duplicate evicts nothing.
    assert pool.allocate(2) == [2, 1]
    assert pool.stats.evictions == 0 and pool.lookup(7) == 0


def test_registering_an_already_published_block_again_changes_nothing() -> None:
    pool = BlockPool(2)
    pool.allocate(1)
    pool.register(0, 5)
    pool.register(0, 6)
    assert pool.blocks[0].block_hash == 5
    assert pool.cached == {5: 0}


# ---- KVCacheManager ---------------------------------------------------------------------------


def test_block_table_grows_by_whole_blocks() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    r = _request("a", list(range(5)))
    assert kv.allocate(r, 5)
    assert kv.block_tables["a"] == [0, 1]
    r.num_computed_tokens = 5
    r.token_ids.append(99)
    assert kv.allocate(r, 1)  # 6 tokens still fit in 2 blocks
    assert kv.block_tables["a"] == [0, 1]
    r.num_computed_tokens = 6
    r.token_ids += [1, 2, 3]
    assert kv.allocate(r, 3)  # 9 tokens: a third block
    assert kv.block_tables["a"] == [0, 1, 2]


def test_allocate_fails_without_side_effects_when_the_pool_is_short() -> None:
    kv = KVCacheManager(3, BS, enable_prefix_caching=False)
    a, b = _request("a", list(range(8))), _request("b", list(range(8)))
    assert kv.allocate(a, 8)
    assert not kv.allocate(b, 8)
    assert "b" not in kv.block_tables
    assert _queue(kv.pool) == [2]


def test_free_pushes_the_last_block_first() -> None:
    kv = KVCacheManager(6, BS, enable_prefix_caching=False)
    r = _request("a", list(range(12)))
    assert kv.allocate(r, 12)
    assert kv.block_tables["a"] == [0, 1, 2]
    kv.free(r)
    assert _queue(kv.pool) == [3, 4, 5, 2, 1, 0]
    assert kv.block_tables == {} and kv.num_registered == {}


def test_commit_publishes_only_full_computed_blocks() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    r = _request("a", list(range(10)))
    assert kv.allocate(r, 6)  # chunk of 6: blocks 0, 1
    r.num_computed_tokens = 6
    kv.commit_computed(r)
    assert [b.block_hash is not None for b in kv.pool.blocks[:3]] == [True, False, False]
    assert kv.allocate(r, 4)
    r.num_computed_tokens = 10
    kv.commit_computed(r)
    assert [b.block_hash is not None for b in kv.pool.blocks[:3]] == [True, True, False]
    assert kv.num_registered["a"] == 2


def test_prefix_hit_reuses_the_cached_blocks_and_counts_tokens() -> None:
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = _request("a", list(range(10)))
    assert _admit(kv, a) == []
    assert kv.block_tables["a"] == [0, 1, 2]
    b = _request("b", [*range(8), 50, 51, 52])  # shares a's two full blocks
    assert _admit(kv, b) == [0, 1]
    assert kv.block_tables["b"] == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    assert kv.pool.stats.queries == 10 + 11
    assert kv.pool.stats.hits == 8


def test_cache_hit_takes_a_freed_block_out_of_the_free_queue() -> None:
    kv = KVCacheManager(6, BS, enable_prefix_caching=True)
    a = _request("a", list(range(9)))
    _admit(kv, a)
    kv.free(a)
    assert _queue(kv.pool) == [3, 4, 5, 2, 1, 0]
    b = _request("b", list(range(9)))
    assert _admit(kv, b) == [0, 1]
    assert kv.block_tables["b"] == [0, 1, 3]
    assert _queue(kv.pool) == [4, 5, 2]
    assert kv.pool.stats.evictions == 0  # block 2 held no full block, so nothing was cached in it


def test_allocate_counts_cached_free_blocks_as_no_longer_free() -> None:
    kv = KVCacheManager(3, BS, enable_prefix_caching=True)
    a = _request("a", list(range(8)))
    _admit(kv, a)
    kv.free(a)  # blocks 0, 1 cached with refcount 0; all three blocks free
    b = _request("b", [*range(8), 9, 9, 9, 9, 9])  # 13 tokens: 4 blocks, 2 of them cached
    cached = kv.find_cached_prefix(b)
    assert cached == [0, 1]
    assert not kv.allocate(b, 5, cached)  # needs 2 more but only block 2 is free once 0, 1 are taken
    assert _queue(kv.pool) == [2, 1, 0] and kv.pool.blocks[0].ref_count == 0


def test_find_cached_prefix_always_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = _request("a", list(range(8)))  # exactly two full blocks
    _admit(kv, a)
    assert kv.pool.lookup(a.block_hashes[1]) == 1
    same = _request("same", list(range(8)))
    assert kv.find_cached_prefix(same) == [0]  # the last block is recomputed for its logits
    longer = _request("longer", list(range(9)))
    assert kv.find_cached_prefix(longer) == [0, 1]
    one_block = _request("one", list(range(4)))
    assert kv.find_cached_prefix(one_block) == []


def test_prefix_lookup_stops_at_the_first_miss() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = _request("a", list(range(13)))
    _admit(kv, a)
    b = _request("b", [0, 1, 2, 99, *range(4, 13)])  # block 0 differs: the chain breaks there
    assert kv.find_cached_prefix(b) == []
    c = _request("c", [*range(4), 99, *range(5, 13)])
    assert kv.find_cached_prefix(c) == [0]


def test_prefix_cache_disabled_never_hits_or_counts() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    a = _request("a", list(range(9)))
    _admit(kv, a)
    kv.free(a)
    assert kv.find_cached_prefix(_request("b", list(range(9)))) == []
    assert kv.pool.cached == {}
    assert kv.pool.stats.queries == 0 and kv.pool.stats.hits == 0


def test_eviction_takes_the_least_recently_freed_request_first_tail_block_first() -> None:
    kv = KVCacheManager(6, BS, enable_prefix_caching=True)
    a = _request("a", list(range(12)))  # 3 full blocks: 0, 1, 2
    b = _request("b", list(range(100, 112)))  # 3 full blocks: 3, 4, 5
    _admit(kv, a)
    _admit(kv, b)
    kv.free(a)
    kv.free(b)
    assert _queue(kv.pool) == [2, 1, 0, 5, 4, 3]
    c = _request("c", list(range(200, 206)))
    _admit(kv, c)
    assert kv.block_tables["c"] == [2, 1]  # a's tail first
    assert kv.pool.stats.evictions == 2
    assert kv.find_cached_prefix(_request("a2", list(range(13)))) == [0]  # a's head survives
    assert kv.find_cached_prefix(_request("b2", list(range(100, 113)))) == [3, 4, 5]


def test_a_hit_refreshes_recency() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    a = _request("a", list(range(5)))
    b = _request("b", list(range(100, 105)))
    _admit(kv, a)  # blocks 0, 1
    _admit(kv, b)  # blocks 2, 3
    kv.free(a)
    kv.free(b)
    assert _queue(kv.pool) == [1, 0, 3, 2]
    a2 = _request("a2", list(range(5)))
    assert _admit(kv, a2) == [0]  # takes 0 out of the queue and allocates 1 for its tail
    assert kv.block_tables["a2"] == [0, 1]
    kv.free(a2)
    assert _queue(kv.pool) == [3, 2, 1, 0]  # b's blocks are now the least recently freed
    _admit(kv, _request("c", list(range(300, 305))))
    assert kv.pool.lookup(b.block_hashes[0]) is None  # b's block 2 went
    assert kv.pool.lookup(a.block_hashes[0]) == 0


def test_reset_prefix_cache_only_when_nothing_is_held() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    a = _request("a", list(range(9)))
    _admit(kv, a)
    assert not kv.reset_prefix_cache()
    assert kv.pool.cached
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.pool.cached == {}
    assert all(b.block_hash is None for b in kv.pool.blocks)
    assert kv.find_cached_prefix(_request("b", list(range(9)))) == []
    assert kv.pool.num_free == 4


def test_usage_is_the_fraction_of_held_blocks() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=False)
    r = _request("a", list(range(5)))
    kv.allocate(r, 5)
    assert kv.usage == 0.5
    kv.free(r)
    assert kv.usage == 0.0
