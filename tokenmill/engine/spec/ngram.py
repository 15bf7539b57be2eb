"""N-gram (prompt lookup) proposer: continue the context the way it continued before.

For n from ngram_max down to ngram_min, the last n tokens are looked up among earlier n-grams; at
the first (longest) hit, the tokens that followed its latest earlier occurrence are the proposal.
A suffix of ngram_max tokens that occurred several times continues the occurrence whose preceding
tokens agree with the context's furthest back (the latest among equals): code repeats short runs
such as `merged[-1][1` or `- 1\n   ` with different continuations, and the latest occurrence was
the wrong one three times in the three code edits of the bench, each a 7-guess step rejected at its
first guess.
Code editing, summaries and RAG answers copy long spans of their prompt, so the guesses are often
right, and a guess costs a few dict lookups.

A proposal's bucket (Proposer.buckets) is the length n of the suffix it matched: a 4-token match
continues a copied span far more often than a 1-token one (docs/speculative.md), and the controller
learns each length's acceptance. `buckets` finds the match and `propose` reuses it.

Index, per request, built incrementally as tokens are appended (token_ids only ever grows):
    index[n][tuple(tokens[i - n:i])] = i     the latest i, i.e. where that n-gram's continuation starts
    starts[tuple(tokens[i - ngram_max:i])]   every such i of the ngram_max-grams, oldest first
An n-gram ending at the very last token has no continuation yet, so it never matches itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenmill.engine.request import Request
from tokenmill.engine.spec.base import ProposalGate, Proposer, register_proposer


@dataclass(slots=True)
class _NgramIndex:
    num_indexed: int = 0  # continuation starts i < num_indexed are in the index
    by_n: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    starts: dict[tuple[int, ...], list[int]] = field(default_factory=dict)


# Where a longest suffix occurred several times: the latest this many occurrences are compared, each over
# at most this many tokens before the suffix (bounds a lookup's cost in a very repetitive context).
_MAX_CANDIDATES = 16
_MAX_AGREEMENT = 64


# Prior acceptance of a proposal's first token by the length of the suffix it matched (the learned
# position-1 rates of the code-edit bench on Zen 3, 2026-12-04, at batch 1 and 32: 1 token 0.36-0.46,
# 2 tokens 0.49-0.55, 3 tokens 0.5-0.9, 4 tokens 0.87-0.99). A flat 0.7 over-valued short matches: a
# fresh engine proposed on them until their drafts failed (~6% of the first ~300 tokens' speed).
_MATCH_PRIORS = {1: 0.4, 2: 0.55, 3: 0.7}
_LONG_MATCH_PRIOR = 0.9


@register_proposer("ngram")
class NgramProposer(Proposer):
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        assert 1 <= ngram_min <= ngram_max
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._indexes: dict[str, _NgramIndex] = {}
        self._matches: dict[str, tuple[int, int]] = {}  # request → (context length, match start) of `buckets`

    def propose(self, requests: list[Request], num_tokens: list[int],
                gate: ProposalGate | None = None) -> list[list[int]]:
        return [self.propose_one(r.request_id, r.token_ids, k) for r, k in zip(requests, num_tokens, strict=True)]

    def buckets(self, requests: list[Request]) -> list[int | None]:
        out: list[int | None] = []
        for request in requests:
            n, start = self._match(request.request_id, request.token_ids)
            self._matches[request.request_id] = (len(request.token_ids), start)
            out.append(n)
        return out

    def bucket_prior(self, bucket: int) -> float | None:
        return _MATCH_PRIORS.get(bucket, _LONG_MATCH_PRIOR) if bucket > 0 else None

    def propose_one(self, key: str, tokens: list[int], k: int) -> list[int]:
        cached = self._matches.pop(key, None)
        start = cached[1] if cached is not None and cached[0] == len(tokens) else self._match(key, tokens)[1]
        return _continuation(tokens, start, k) if start >= 0 else []

    def _match(self, key: str, tokens: list[int]) -> tuple[int, int]:
        """(n, start) of the longest suffix of n tokens seen before, and where its latest earlier
        occurrence continued; (0, -1) when no suffix of ngram_min tokens recurs."""
        index = self._indexes.get(key)
        if index is None:
            index = self._indexes[key] = _NgramIndex(by_n={n: {} for n in range(self.ngram_min, self.ngram_max + 1)})
        self._extend(index, tokens)
        end = len(tokens)
        for n in range(min(self.ngram_max, end - 1), self.ngram_min - 1, -1):
            suffix = tuple(tokens[end - n:])
            start = index.by_n[n].get(suffix)
            if start is not None:
                if n == self.ngram_max:
                    start = _best_agreement(tokens, n, index.starts[suffix])
                return n, start
        return 0, -1

    def _extend(self, index: _NgramIndex, tokens: list[int]) -> None:
        """Index the n-grams whose continuation starts at num_indexed..len(tokens)-1."""
        for i in range(max(index.num_indexed, 1), len(tokens)):
            for n, table in index.by_n.items():
                if n <= i:
                    gram = tuple(tokens[i - n:i])
                    table[gram] = i
                    if n == self.ngram_max:
                        index.starts.setdefault(gram, []).append(i)
        index.num_indexed = max(index.num_indexed, len(tokens))

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
        self._matches.pop(request_id, None)

    def retain(self, request_ids: Iterable[str]) -> None:
        keep = set(request_ids)
        for rid in [r for r in self._indexes if r not in keep]:
            del self._indexes[rid]
            self._matches.pop(rid, None)


def _best_agreement(tokens: list[int], n: int, starts: list[int]) -> int:
    """Of the continuation starts of the context's last n tokens, the one whose occurrence is preceded by
    the longest run agreeing with the tokens before that suffix (the latest among equals)."""
    end, best, best_run = len(tokens), starts[-1], -1
    for i in reversed(starts[-_MAX_CANDIDATES:]):
        run = 0
        while run < _MAX_AGREEMENT and i - n - 1 - run >= 0 and tokens[i - n - 1 - run] == tokens[end - n - 1 - run]:
            run += 1
        if run > best_run:
            best, best_run = i, run
    return best


def _continuation(tokens: list[int], start: int, k: int) -> list[int]:
    """k tokens copied from `start` on. A match close to the end overlaps its own suffix, i.e. the
    context is periodic there, so the copy runs on into the proposal itself (x x x → x x x x)."""
    out = tokens[start:start + k]
    while len(out) < k:
        out.append(out[len(out) - (len(tokens) - start)])
    return out
