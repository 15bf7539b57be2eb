"""Hash chain over full blocks of token ids: the key of automatic prefix caching.

    hash_i = H(hash_{i-1}, tokens[i*bs : (i+1)*bs])        hash_{-1} = root(cache_salt)

A block's hash names its whole prefix, so equal hashes mean equal KV contents (up to a 64-bit
collision, which we accept as vLLM's default builtin hash does). Only full blocks are hashed.

A request's `cache_salt` (vLLM's field of the same name) changes the root, so every block hash of a
salted request differs from an unsalted one's and from other salts': requests share cached blocks only
within one salt. A prefix cache hit makes a request faster, so without a salt one tenant can learn
from TTFT whether another sent a given prompt; a per-tenant secret salt closes that channel.
"""

from __future__ import annotations

from tokenmill.engine.request import Request

_ROOT_HASH = 0x746F6B656E6D696C  # "tokenmil"


def root_hash(cache_salt: str | None) -> int:
    """hash_{-1} of a request's chain; unsalted requests keep the fixed seed."""
    return _ROOT_HASH if cache_salt is None else hash((_ROOT_HASH, cache_salt))


def hash_block(parent: int, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


def update_block_hashes(request: Request, block_size: int) -> None:
    """Extend `request.block_hashes` to cover every full block of its current token ids. A pending token
    (asynchronous scheduling) is no token yet: the block it ends is not hashed until it is known."""
    num_tokens = len(request.token_ids) - (1 if request.has_pending_token else 0)
    num_full = num_tokens // block_size
    hashes = request.block_hashes
    parent = hashes[-1] if hashes else root_hash(request.cache_salt)
    for i in range(len(hashes), num_full):
        parent = hash_block(parent, tuple(request.token_ids[i * block_size:(i + 1) * block_size]))
        hashes.append(parent)
