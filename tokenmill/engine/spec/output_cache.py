"""A bounded index of recent requests' outputs, shared by every request: where a request's context
ends with an n-gram some earlier output had, the tokens that followed it there are a guess.

Prompt lookup (ngram.py) only sees the request's own prompt and output. Agents, extraction jobs and
tool calls produce outputs that repeat *across* requests: the same JSON keys and punctuation, the same
tool-call envelope, the same code boilerplate, none of which a prompt necessarily contains. Suffix
Decoding (Oliaro et al., 2024; vLLM's `suffix` method) caches previous outputs for this; here the cache
is an n-gram index like the per-request one, over the outputs of the last requests that finished,
each with the last max_n tokens of its prompt as lead-in: a chat template's assistant header ends every
prompt, so the first tokens of an answer (`{"name": "`, a tool call's envelope) are guessed too.

    index[hash(tokens[i - n:i])] = (sequence, i)    for n in [min_n, max_n], the latest i wins

Keys are hashes of the n-gram, not the n-gram: a collision only makes a wrong guess, which verification
rejects (output never depends on a guess), and an int key is a fraction of a tuple's memory. Eviction is
oldest-sequence-first once more than `max_tokens` output tokens are held; an evicted sequence's entries
are removed where they still point at it (a later sequence may have taken the key over).

Memory: about (max_n - min_n + 1) dict entries per cached token, ~100 bytes each: 64 Ki tokens with
n in 2..4 take ~20 MB.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

_SEQ_SHIFT = 32  # an entry packs (sequence id << 32) | position: outputs are far shorter than 2**32 tokens
_POS_MASK = (1 << _SEQ_SHIFT) - 1


class OutputCache:
    def __init__(self, min_n: int, max_n: int, max_tokens: int) -> None:
        assert 1 <= min_n <= max_n and max_tokens >= 0
        self.min_n, self.max_n, self.max_tokens = min_n, max_n, max_tokens
        # id → (first continuation start, lead-in + output tokens), oldest first
        self._sequences: OrderedDict[int, tuple[int, list[int]]] = OrderedDict()
        self._index: dict[int, int] = {}
        self._next_id = 0
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._sequences)

    def add(self, tokens: Sequence[int], lead_in: int = 0) -> None:
        """Cache one finished output, `tokens` = its first `lead_in` tokens of context (the prompt's end,
        e.g. the chat template's assistant header, which every answer follows) and then the output:
        guesses only ever continue into the output part. The oldest outputs are evicted past max_tokens;
        one longer than the whole budget keeps its last max_tokens tokens."""
        if len(tokens) > self.max_tokens:
            lead_in = max(0, lead_in - (len(tokens) - self.max_tokens))
            tokens = tokens[len(tokens) - self.max_tokens:]
        tokens = list(tokens)
        first = max(lead_in, self.min_n)  # the first continuation start indexed
        if first >= len(tokens):  # nothing would follow any of its n-grams
            return
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self._sequences[seq_id] = (first, tokens)
        self.num_tokens += len(tokens)
        for i, key in self._keys(tokens, first):
            self._index[key] = (seq_id << _SEQ_SHIFT) | i
        while self.num_tokens > self.max_tokens:
            self._evict_oldest()

    def match(self, context: Sequence[int]) -> tuple[int, int]:
        """(n, entry) of the longest suffix of `context` (n in max_n..min_n) that some cached output had,
        where entry names what followed its latest occurrence; (0, -1) when none did."""
        end = len(context)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            entry = self._index.get(hash(tuple(context[end - n:])))
            if entry is not None:
                return n, entry
        return 0, -1

    def continuation(self, entry: int, k: int) -> list[int]:
        """Up to k tokens of the cached output at `entry` (fewer where that output ends)."""
        held = self._sequences.get(entry >> _SEQ_SHIFT)
        if held is None:  # evicted since match()
            return []
        tokens = held[1]
        start = entry & _POS_MASK
        return tokens[start:start + k]

    def clear(self) -> None:
        self._sequences.clear()
        self._index.clear()
        self.num_tokens = 0

    def _keys(self, tokens: list[int], first: int) -> list[tuple[int, int]]:
        """(i, key) of every n-gram ending just before position i >= first (its continuation starts at i)."""
        out = []
        for i in range(first, len(tokens)):
            for n in range(self.min_n, min(self.max_n, i) + 1):
                out.append((i, hash(tuple(tokens[i - n:i]))))
        return out

    def _evict_oldest(self) -> None:
        seq_id, (first, tokens) = self._sequences.popitem(last=False)
        self.num_tokens -= len(tokens)
        for i, key in self._keys(tokens, first):
            if self._index.get(key) == (seq_id << _SEQ_SHIFT) | i:
                del self._index[key]
