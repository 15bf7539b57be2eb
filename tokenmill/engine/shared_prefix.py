"""In-batch prefix sharing (SchedulerConfig.shared_prefix_wait_tokens; SGLang's in-batch prefix caching): a
block is cached only once computed, so requests admitted together that share a long prompt prefix (n > 1
children, a burst with one system prompt) would each compute it. The scheduler notes, each step, the full
blocks running requests have yet to compute; a waiting request whose next uncached blocks, at least the
threshold's tokens of them, are among those (computed by a request as urgent as it: an interactive request
never waits on a batch one) waits, and finds them cached a step or a chunk later."""

from __future__ import annotations

from collections.abc import Iterable

from tokenmill.engine.block_hash import update_block_hashes
from tokenmill.engine.request import Request


class BlocksInFlight:
    def __init__(self, wait_tokens: int, block_size: int, enabled: bool) -> None:
        """`enabled`: prefix caching is on (without it nothing waited for would be found cached)."""
        self.wait_tokens = wait_tokens if enabled else 0
        self.block_size = block_size
        self._ranks: dict[int, int] = {}  # block hash → the most urgent class rank that has yet to compute it

    def reset(self, running: Iterable[Request]) -> None:
        """A step begins: the blocks the running requests have yet to compute."""
        self._ranks = {}
        for request in running:
            self.note(request)

    def note(self, request: Request) -> None:
        """A running (or just admitted) request's uncomputed full blocks."""
        if not self.wait_tokens or request.num_computed_tokens + 1 >= request.num_tokens:
            return  # off, or decoding: nothing of its prompt left to compute
        update_block_hashes(request, self.block_size)
        rank = request.service_class.rank
        for block_hash in request.block_hashes[request.num_computed_tokens // self.block_size:]:
            self._ranks[block_hash] = min(rank, self._ranks.get(block_hash, rank))

    def should_wait(self, request: Request, num_hit_blocks: int) -> bool:
        """Whether the waiting request's next uncached full blocks, at least `wait_tokens` of them, are being
        computed by running requests as urgent as it (block hashes as find_cached_prefix left them)."""
        if not self._ranks:
            return False
        rank, shared = request.service_class.rank, 0
        for block_hash in request.block_hashes[num_hit_blocks:]:
            if self._ranks.get(block_hash, rank + 1) > rank:
                break
            shared += self.block_size
        return shared >= self.wait_tokens
