"""Prompt lookup plus a cache of recent outputs (`--speculative suffix`).

Per request and step, the request's own context (prompt and output so far, ngram.py) and the outputs
of the last requests that finished (output_cache.py) are both searched for the longest suffix of the
context seen before; the longer match proposes its continuation, the request's own on a tie (its own
text is the better predictor of itself). A finished or aborted request's output joins the cache.

Measured on the real Qwen2.5-Coder-0.5B's greedy outputs (docs/speculative.md, "Cross-request lookup"):
JSON extraction, tool calls and short code functions repeat keys, envelopes and boilerplate that their
prompts do not hold, so prompt lookup alone finds little there, and the cache most of it.

Buckets (the controller learns each one's acceptance): n for a match of n tokens in the request's own
context (as ngram.py), -n for a match of n tokens in the cache. A cached output is another request's,
so its continuations are accepted less often than a copied span of the request's own prompt at the
same length: the priors below come from the same measurement (2 tokens 0.4-1.0, 3 tokens 0.55-0.97,
4 tokens 0.79-0.91 at position 1 across the three workloads).

Isolation: proposals never change output (verification is exact), but as with a prefix cache, a
request's speed tells something about what other requests produced. A request with a `cache_salt`
only matches outputs of requests with the same salt (output_cache.py), as its prefix-cache blocks are
only shared within its salt (block_hash.py): give each tenant its own secret salt.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenmill.engine.request import PLACEHOLDER, Request
from tokenmill.engine.spec.base import ProposalGate, register_proposer
from tokenmill.engine.spec.ngram import NgramProposer
from tokenmill.engine.spec.output_cache import OutputCache, salt_key

_CACHE_PRIORS = {2: 0.6, 3: 0.7}
_LONG_CACHE_PRIOR = 0.85
# A cached match of one token proposes what followed some token in some other output: mostly noise.
MIN_CACHE_MATCH = 2


@register_proposer("suffix")
class SuffixProposer(NgramProposer):
    def __init__(self, ngram_min: int, ngram_max: int, cache_tokens: int) -> None:
        super().__init__(ngram_min, ngram_max)
        low = max(ngram_min, MIN_CACHE_MATCH)
        self.cache = OutputCache(low, max(low, ngram_max), cache_tokens)
        self._live: dict[str, Request] = {}  # requests seen decoding: their output joins the cache on forget()
        # request → (context length, cache entry or -1 for its own match) chosen by buckets()
        self._choices: dict[str, tuple[int, int]] = {}

    def buckets(self, requests: list[Request]) -> list[int | None]:
        own = super().buckets(requests)
        out: list[int | None] = []
        for request, own_n in zip(requests, own, strict=True):
            self._live[request.request_id] = request
            out.append(self._choose(request, own_n or 0))
        return out

    def propose(self, requests: list[Request], num_tokens: list[int],
                gate: ProposalGate | None = None) -> list[list[int]]:
        out = []
        for request, k in zip(requests, num_tokens, strict=True):
            rid, tokens = request.request_id, request.token_ids
            choice = self._choices.pop(rid, None)
            if choice is None or choice[0] != len(tokens):  # no buckets() for this context: decide now
                self._choose(request, self._match(rid, tokens)[0])
                choice = self._choices.pop(rid)
            entry = choice[1]
            out.append(self.cache.continuation(entry, k) if entry >= 0 else self.propose_one(rid, tokens, k))
        return out

    def _choose(self, request: Request, own_n: int) -> int:
        """The bucket of the request's proposal now: -n where the cache's match is the longer, else the
        own match's length; the choice is kept for propose()."""
        n, entry = self.cache.match(request.token_ids, salt_key(request.cache_salt))
        use_cache = n > own_n
        self._choices[request.request_id] = (len(request.token_ids), entry if use_cache else -1)
        return -n if use_cache else own_n

    @property
    def cached_tokens(self) -> int:
        return self.cache.num_tokens

    def bucket_prior(self, bucket: int) -> float | None:
        if bucket < 0:
            return _CACHE_PRIORS.get(-bucket, _LONG_CACHE_PRIOR)
        return super().bucket_prior(bucket)

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: what it generated joins the cache."""
        request = self._live.pop(request_id, None)
        if request is not None:
            lead_in = request.prompt_token_ids[-self.cache.max_n:]
            self.cache.add([*lead_in, *(t for t in request.output_token_ids if t != PLACEHOLDER)], len(lead_in),
                           salt_key(request.cache_salt))
        self._choices.pop(request_id, None)
        super().forget(request_id)

    def retain(self, request_ids: Iterable[str]) -> None:
        keep = set(request_ids)
        super().retain(keep)
        for rid in [r for r in self._live if r not in keep]:  # preempted: seen again when it decodes
            del self._live[rid]
            self._choices.pop(rid, None)
