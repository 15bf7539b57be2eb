"""Block pool and per-request block tables, with refcounts and prefix-cache eviction.

The pool keeps every block with refcount 0 in one LRU queue (an ordered dict, O(1) removal):

    head → [least recently freed ... most recently freed] ← tail
    allocate: pop from the head; if that block carries a hash, it is evicted from the cache
    free:     push to the tail, the request's last block first, so a prefix's tail is evicted
              before its head (heads are the most shared)
    hit:      a cached block with refcount 0 leaves the queue and is shared (refcount += 1)

Invariant: a block is either in the free queue (refcount 0) or held (refcount >= 1), never both.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.engine.block_hash import update_block_hashes
from tokenmill.engine.request import Request


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached
    evictions: int = 0  # cached blocks reused for new content


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash → block id
        self.stats = PrefixCacheStats()

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, count: int) -> list[int]:
        assert count <= len(self.free_queue), "caller must check num_free first"
        ids = []
        for _ in range(count):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
                self.stats.evictions += 1
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def touch(self, block_ids: list[int]) -> None:
        """Share cached blocks with one more request."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block, in the given order."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} released twice"
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def register(self, block_id: int, block_hash: int) -> None:
        """Publish a full block's contents; a duplicate of an already-cached hash stays private."""
        block = self.blocks[block_id]
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block_id


class KVCacheManager:
    """Owns which blocks each request holds. The scheduler asks; the runner only reads tables."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.num_registered: dict[str, int] = {}  # full blocks of a request already published

    @property
    def num_blocks(self) -> int:
        return len(self.pool.blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of the request, leaving >= 1 token to compute.

        The last token must be recomputed so its logits exist to sample from.
        """
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        update_block_hashes(request, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's prefix-cache lookup (not every retry while it waits)."""
        if not self.enable_prefix_caching:
            return
        self.pool.stats.queries += num_tokens
        self.pool.stats.hits += num_hit_tokens

    def allocate(self, request: Request, num_new_tokens: int, cached_block_ids: list[int] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after `num_computed_tokens` (+ the cached prefix).

        Returns False, changing nothing, when the pool is too small right now.
        """
        cached = cached_block_ids or []
        table = self.block_tables.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(cached) * self.block_size
        need = self.num_blocks_for(num_computed + num_new_tokens) - len(table) - len(cached)
        # Cached blocks sitting in the free queue stop being free once we take them.
        reclaimed = sum(1 for b in cached if self.pool.blocks[b].ref_count == 0)
        if need > self.pool.num_free - reclaimed:
            return False
        self.pool.touch(cached)
        table = table + cached + self.pool.allocate(max(need, 0))
        self.block_tables[request.request_id] = table
        self.num_registered.setdefault(request.request_id, len(cached))
        return True

    def commit_computed(self, request: Request, limit: int | None = None) -> None:
        """Publish blocks that became full and computed in this step to the prefix cache (only those
        wholly within the first `limit` tokens, when given)."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        upto = request.num_tokens if limit is None else min(limit, request.num_tokens)
        num_full = min(request.num_computed_tokens, upto) // self.block_size
        start = self.num_registered.get(rid, 0)
        if num_full <= start:
            return
        update_block_hashes(request, self.block_size)
        table = self.block_tables[rid]
        for i in range(start, num_full):
            self.pool.register(table[i], request.block_hashes[i])
        self.num_registered[rid] = num_full

    def free(self, request: Request) -> None:
        table = self.block_tables.pop(request.request_id, [])
        self.num_registered.pop(request.request_id, None)
        self.pool.release(list(reversed(table)))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is held."""
        if self.pool.num_free != self.num_blocks:
            return False
        for block in self.pool.blocks:
            block.block_hash = None
        self.pool.cached.clear()
        return True
