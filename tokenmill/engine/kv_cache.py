"""Block pool and per-request block tables, with refcounts and prefix-cache eviction.

The pool keeps every block with refcount 0 in one LRU queue (an ordered dict, O(1) removal):

    head → [least recently freed ... most recently freed] ← tail
    allocate: pop from the head; if that block carries a hash, it is evicted from the cache
    free:     push to the tail, the request's last block first, so a prefix's tail is evicted
              before its head (heads are the most shared)
    hit:      a cached block with refcount 0 leaves the queue and is shared (refcount += 1)

Invariant: a block is either in the free queue (refcount 0) or held (refcount >= 1), never both.

Partial blocks (`reuse_partial_blocks`): a request's last, partly filled block is kept in the cache when
the request frees it, under (hash of the full blocks before it, all m tokens it holds). A later request
whose next tokens after its full-block hits start with exactly those m tokens takes a fresh block and has
the scheduler copy the m rows into it (`BlockCopy`, run before the step's forward) instead of recomputing
them: a beam search step (the parent beam plus one token) or a chat's next turn (the previous prompt and
answer, then the new message) computes only its new tokens. A partial block is never shared (its next
rows would differ), only copied. Only the whole m tokens are a key, never a shorter prefix of them: a
prefix key would tell a client (through `cached_tokens`, or the time to first token) how many leading
tokens of its prompt another request's began with, one token at a time; a whole partial block must be
guessed at once, as a full block must.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.engine.block_hash import root_hash, update_block_hashes
from tokenmill.engine.interfaces import BlockCopy
from tokenmill.engine.request import Request

PartialKey = tuple[int, tuple[int, ...]]  # (hash of the full blocks before it, the m tokens it holds)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    partial_key: PartialKey | None = None  # its rows as a partial block, while free


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
        self.partial: dict[PartialKey, int] = {}  # a partial block's (parent, tokens) → block id
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
            self._forget_partial(block)
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

    def demote(self, block_ids: list[int]) -> None:
        """Move the free ones among `block_ids` to the head of the queue: the next blocks taken. They stay
        cached (a hit still finds them until then)."""
        for block_id in block_ids:
            if self.blocks[block_id].ref_count == 0:
                self.free_queue.move_to_end(block_id, last=False)

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

    def register_partial(self, block_id: int, parent: int, tokens: tuple[int, ...]) -> None:
        """Offer the rows of a partly filled block to requests that continue them; a key another block
        offers already stays with it."""
        block = self.blocks[block_id]
        self._forget_partial(block)
        key = (parent, tokens)
        if key not in self.partial:
            self.partial[key] = block_id
            block.partial_key = key

    def _forget_partial(self, block: Block) -> None:
        if block.partial_key is not None and self.partial.get(block.partial_key) == block.block_id:
            del self.partial[block.partial_key]
        block.partial_key = None

    def register(self, block_id: int, block_hash: int) -> None:
        """Publish a full block's contents; a duplicate of an already-cached hash stays private."""
        block = self.blocks[block_id]
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block_id


class KVCacheManager:
    """Owns which blocks each request holds. The scheduler asks; the runner only reads tables."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 reuse_partial_blocks: bool = False) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.reuse_partial_blocks = enable_prefix_caching and reuse_partial_blocks
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.num_registered: dict[str, int] = {}  # full blocks of a request already published
        self._superseded: list[int] = []  # partial blocks copied from this step (demote_superseded)

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

    def find_cached_partial(self, request: Request, num_hit_blocks: int) -> tuple[int, int] | None:
        """(block id, rows) of the longest cached partial block continuing the request's first
        `num_hit_blocks` full blocks, still leaving >= 1 token to compute; None without one."""
        if not self.reuse_partial_blocks or request.params.prompt_logprobs is not None or not self.pool.partial:
            return None
        start = num_hit_blocks * self.block_size
        longest = min(self.block_size - 1, request.num_tokens - 1 - start)
        if longest < 1:
            return None
        update_block_hashes(request, self.block_size)  # (find_cached_prefix did, when it ran first)
        parent = request.block_hashes[num_hit_blocks - 1] if num_hit_blocks else root_hash(request.cache_salt)
        tokens = tuple(request.token_ids[start:start + longest])
        for m in range(longest, 0, -1):
            block_id = self.pool.partial.get((parent, tokens[:m]))
            if block_id is not None:
                return block_id, m
        return None

    def allocate_with_copy(self, request: Request, num_new_tokens: int, cached_block_ids: list[int],
                           partial: tuple[int, int]) -> BlockCopy | None:
        """`allocate` for a waiting request that continues a cached partial block (`find_cached_partial`): its
        first new block receives the partial block's rows; the copy to run before the step's forward, or
        None (nothing changed) when the pool is too small. The source is held while the blocks are taken, so
        they cannot be it; once given back it may be reused, which is safe: copies run before any forward."""
        source, rows = partial
        self.pool.touch([source])
        try:
            if not self.allocate(request, num_new_tokens, cached_block_ids, rows):
                return None
        finally:
            self.pool.release([source])
        self._superseded.append(source)
        return BlockCopy(source, self.block_tables[request.request_id][len(cached_block_ids)], rows)

    def demote_superseded(self) -> None:
        """After a step's admissions: the partial blocks copied from in it become the next blocks taken.

        A continued partial block has done its work (the request that continued it holds a longer copy,
        which is cached in its turn), and reusing it keeps the pool's touched memory small: on these VMs the
        first write to a never-used block costs ~1 GB/s of page faults (host and guest), which made a beam
        search's step of W fresh copies a fifth slower than on warm blocks (docs/performance.md). Demoted only
        once the step's admissions are done, so a sibling continuing the same block in this step still finds it."""
        self.pool.demote(self._superseded)
        self._superseded.clear()

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's prefix-cache lookup (not every retry while it waits)."""
        if not self.enable_prefix_caching:
            return
        self.pool.stats.queries += num_tokens
        self.pool.stats.hits += num_hit_tokens

    def allocate(self, request: Request, num_new_tokens: int, cached_block_ids: list[int] | None = None,
                 partial_rows: int = 0) -> bool:
        """Make room for `num_new_tokens` more tokens after `num_computed_tokens` (+ the cached prefix, and
        `partial_rows` copied into the block after it).

        Returns False, changing nothing, when the pool is too small right now.
        """
        cached = cached_block_ids or []
        table = self.block_tables.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(cached) * self.block_size + partial_rows
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
        if self.reuse_partial_blocks and table:
            self._offer_partial(request, table)
        self.pool.release(list(reversed(table)))

    def _offer_partial(self, request: Request, table: list[int]) -> None:
        """Keep the computed rows of the request's partly filled last block for requests that continue it."""
        num_full, rows = divmod(request.num_computed_tokens, self.block_size)
        if rows == 0 or num_full >= len(table) or self.pool.blocks[table[num_full]].ref_count != 1:
            return  # no partial block, or one another request shares (never copied from: its rows may change)
        update_block_hashes(request, self.block_size)
        if len(request.block_hashes) < num_full:
            return
        parent = request.block_hashes[num_full - 1] if num_full else root_hash(request.cache_salt)
        start = num_full * self.block_size
        self.pool.register_partial(table[num_full], parent, tuple(request.token_ids[start:start + rows]))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is held."""
        if self.pool.num_free != self.num_blocks:
            return False
        for block in self.pool.blocks:
            block.block_hash = None
            block.partial_key = None
        self.pool.cached.clear()
        self.pool.partial.clear()
        return True
