"""A bounded index of recent requests' outputs, shared by every request: where a request's context
ends with an n-gram some earlier output had, the tokens that followed it there are a guess.

Prompt lookup (ngram.py) only sees the request's own prompt and output. Agents, extraction jobs and
tool calls produce outputs that repeat *across* requests: the same JSON keys and punctuation, the same
tool-call envelope, the same code boilerplate, none of which a prompt necessarily contains. Suffix
Decoding (Oliaro et al., 2024; vLLM's `suffix` method) caches previous outputs for this; here the cache
is an n-gram index like the per-request one, over the outputs of the last requests that finished,
each with the last max_n tokens of its prompt as lead-in: a chat template's assistant header ends every
prompt, so the first tokens of an answer (`{"name": "`, a tool call's envelope) are guessed too.

    index[n][key(tokens[i - n:i])] = (sequence, i)    for n in [min_n, max_n], the latest i wins

Salts: a request with a `cache_salt` (block_hash.py) only ever matches outputs of its own salt. Its
keys are key() XOR a 64-bit value of the salt (0 without one), so the tables stay shared (and the token
budget with them) while a lookup under one salt finds another's n-gram only by a 64-bit collision.

key() is a polynomial hash of the n tokens mod 2**64, computed for a whole output at once with numpy's
wrapping int64 arithmetic (adding an output and evicting one: ~0.6 µs a token on the engine thread,
against 1.6 µs with a tuple per n-gram and position; a lookup ~1 µs). A collision only makes a wrong
guess, which verification rejects: output never depends on a guess. Eviction is oldest-sequence-first
once more than `max_tokens` tokens are held; an evicted sequence's entries are removed where they still
point at it (a later sequence may have taken the key over).

Memory: ~0.45 KB a cached token with n in 2..4 (three dict entries and the token): 64 Ki tokens ~30 MB.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

_SEQ_SHIFT = 32  # an entry packs (sequence id << 32) | position: outputs are far shorter than 2**32 tokens
_POS_MASK = (1 << _SEQ_SHIFT) - 1
_MULTIPLIER = 0x9E3779B97F4A7C15 - (1 << 64)  # odd (a bijection mod 2**64), as a signed int64
_U64 = (1 << 64) - 1


def _signed(x: int) -> int:
    x &= _U64
    return x - (1 << 64) if x >> 63 else x


def salt_key(cache_salt: str | None) -> int:
    """What a salt XORs into every key: 0 for none, so unsalted keys are key_of's."""
    return 0 if cache_salt is None else _signed(hash(("output-cache", cache_salt)))


def key_of(tokens: Sequence[int]) -> int:
    """key() of one n-gram, the same int that _keys computes with numpy for every position."""
    h = 0
    for t in tokens:
        h = _signed(h * _MULTIPLIER + t)
    return h


def ngram_keys(tokens: np.ndarray, max_n: int) -> list[np.ndarray]:
    """keys[n - 1][i] = key_of(tokens[i - n:i]) for every i in [n, len) (0 below n): each n-gram's key at
    the position its continuation starts. With K_0 = 0, K_n(i) = K_{n-1}(i - 1) * M + tokens[i - 1];
    numpy's int64 arithmetic wraps mod 2**64 as key_of does."""
    length = len(tokens)
    previous = np.zeros(length, dtype=np.int64)  # K_{n-1}
    out = []
    for n in range(1, max_n + 1):
        current = np.zeros(length, dtype=np.int64)
        current[n:] = previous[n - 1:length - 1] * _MULTIPLIER + tokens[n - 1:length - 1]
        out.append(current)
        previous = current
    return out


class OutputCache:
    def __init__(self, min_n: int, max_n: int, max_tokens: int) -> None:
        assert 1 <= min_n <= max_n and max_tokens >= 0
        self.min_n, self.max_n, self.max_tokens = min_n, max_n, max_tokens
        # id → (first continuation start, lead-in + output tokens, salt key), oldest first
        self._sequences: OrderedDict[int, tuple[int, list[int], int]] = OrderedDict()
        self._index: dict[int, dict[int, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._powers = [_signed(_MULTIPLIER ** j) for j in range(max_n)]  # M**j mod 2**64
        self._next_id = 0
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._sequences)

    @property
    def num_entries(self) -> int:
        return sum(len(table) for table in self._index.values())

    def add(self, tokens: Sequence[int], lead_in: int = 0, salt: int = 0) -> None:
        """Cache one finished output, `tokens` = its first `lead_in` tokens of context (the prompt's end,
        e.g. the chat template's assistant header, which every answer follows) and then the output:
        guesses only ever continue into the output part. The oldest outputs are evicted past max_tokens;
        one longer than the whole budget keeps its last max_tokens tokens. `salt`: salt_key() of the
        request's cache salt; only match() calls with the same salt find it."""
        if len(tokens) > self.max_tokens:
            lead_in = max(0, lead_in - (len(tokens) - self.max_tokens))
            tokens = tokens[len(tokens) - self.max_tokens:]
        tokens = list(tokens)
        first = max(lead_in, self.min_n)  # the first continuation start indexed
        if first >= len(tokens):  # nothing would follow any of its n-grams
            return
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self._sequences[seq_id] = (first, tokens, salt)
        self.num_tokens += len(tokens)
        for n, keys, entries in self._keys(seq_id, tokens, first, salt):
            self._index[n].update(zip(keys, entries, strict=True))
        while self.num_tokens > self.max_tokens:
            self._evict_oldest()

    def match(self, context: Sequence[int], salt: int = 0) -> tuple[int, int]:
        """(n, entry) of the longest suffix of `context` (n in max_n..min_n) that some cached output of the
        same salt had, where entry names what followed its latest occurrence; (0, -1) when none did."""
        end, top = len(context), min(self.max_n, len(context))
        keys, h = [0], 0
        for n in range(1, top + 1):  # key_of(suffix of n) = context[end - n] * M**(n - 1) + key_of(suffix of n - 1)
            h = _signed(context[end - n] * self._powers[n - 1] + h)
            keys.append(h)
        for n in range(top, self.min_n - 1, -1):
            entry = self._index[n].get(keys[n] ^ salt)
            if entry is not None:
                return n, entry
        return 0, -1

    def continuation(self, entry: int, k: int) -> list[int]:
        """Up to k tokens of the cached output at `entry` (fewer where that output ends)."""
        held = self._sequences.get(entry >> _SEQ_SHIFT)
        if held is None:  # evicted since match()
            return []
        start = entry & _POS_MASK
        return held[1][start:start + k]

    def clear(self) -> None:
        self._sequences.clear()
        for table in self._index.values():
            table.clear()
        self.num_tokens = 0

    def _keys(self, seq_id: int, tokens: list[int], first: int,
              salt: int) -> list[tuple[int, list[int], list[int]]]:
        """Per n, the keys (ngram_keys, XOR the salt) of the n-grams ending just before each position
        i >= max(first, n) (where their continuation starts) and their entries."""
        length = len(tokens)
        base = seq_id << _SEQ_SHIFT
        out = []
        for n, keys in enumerate(ngram_keys(np.asarray(tokens, dtype=np.int64), self.max_n), start=1):
            low = max(first, n)
            if n >= self.min_n and low < length:
                cut = keys[low:] ^ np.int64(salt) if salt else keys[low:]
                out.append((n, cut.tolist(), list(range(base + low, base + length))))
        return out

    def _evict_oldest(self) -> None:
        seq_id, (first, tokens, salt) = self._sequences.popitem(last=False)
        self.num_tokens -= len(tokens)
        for n, keys, entries in self._keys(seq_id, tokens, first, salt):
            table = self._index[n]
            for key, entry in zip(keys, entries, strict=True):
                if table.get(key) == entry:
                    del table[key]
