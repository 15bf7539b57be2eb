"""Prompt lookup where the context repeats, the draft model elsewhere (`--speculative ngram-draft`).

A code edit or a RAG answer copies long spans of its prompt: there the n-gram proposer's guesses are
as good as a draft model's (a 4-token match continued a copied span 87-99% of the time on the
code-edit bench) and cost no forward, where a draft guess costs a draft forward each (a third of a
1.5B target step for the q4 0.5B on Zen 3). Elsewhere only the draft has anything to offer. So, per
request and step: a suffix match of at least `min_match` tokens proposes its continuation (its bucket
is the match length, learned as the n-gram proposer's); otherwise the draft proposes (bucket None:
κ·α, its confidence gate). The controller prices draft forwards by the longest *draft* proposal only
(controller._allocate), and a request that took lookups falls behind in the draft's KV: when the
draft next proposes for it, it catches up in one prefill-like forward, priced as before.

`--speculative suffix-draft` is the same with suffix.py's lookup: a match in the cache of recent outputs
(bucket -n) counts as a lookup too, so an agent's JSON keys and tool-call envelopes are guessed from
earlier answers and only the rest costs draft forwards. The proposer's `propose` then honours the choice
its `buckets` made (own context or cache) for the requests that look up.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenmill.engine.request import Request
from tokenmill.engine.spec.base import ProposalGate, Proposer, register_proposer
from tokenmill.engine.spec.draft import DraftModelProposer
from tokenmill.engine.spec.ngram import NgramProposer

# The shortest suffix match that proposes by lookup instead of the draft: 3 and 4 tokens continued the
# copied span 50-99% of the time (their priors 0.7 and 0.9), 1-2 tokens 36-55%, worse than a draft.
LOOKUP_MIN_MATCH = 3


@register_proposer("ngram-draft")
class LookupDraftProposer(Proposer):
    takes_gate = True  # the draft's guesses go through the gate; lookups ignore it

    def __init__(self, lookup: NgramProposer, draft: DraftModelProposer, min_match: int = LOOKUP_MIN_MATCH) -> None:
        """`lookup`: an NgramProposer or a SuffixProposer (buckets -n for its cache's matches)."""
        self.lookup = lookup
        self.draft = draft
        self.min_match = min_match
        self._by_lookup: set[str] = set()  # requests whose buckets() this step found a long match

    def buckets(self, requests: list[Request]) -> list[int | None]:
        out: list[int | None] = []
        self._by_lookup.clear()
        for request, n in zip(requests, self.lookup.buckets(requests), strict=True):
            if n is not None and abs(n) >= self.min_match:
                self._by_lookup.add(request.request_id)
                out.append(n)
            else:
                out.append(None)
        return out

    def propose(self, requests: list[Request], num_tokens: list[int],
                gate: ProposalGate | None = None) -> list[list[int]]:
        drafted = [(r, k) for r, k in zip(requests, num_tokens, strict=True) if r.request_id not in self._by_lookup]
        looked = [(r, k) for r, k in zip(requests, num_tokens, strict=True) if r.request_id in self._by_lookup]
        out = dict(zip((r.request_id for r, _ in drafted),
                       self.draft.propose([r for r, _ in drafted], [k for _, k in drafted], gate), strict=True)
                   ) if drafted else {}
        out.update(zip((r.request_id for r, _ in looked),
                       self.lookup.propose([r for r, _ in looked], [k for _, k in looked]), strict=True))
        self.last_decode_forward_s = self.draft.last_decode_forward_s if drafted else ()
        self.last_catch_ups = self.draft.last_catch_ups if drafted else ()
        self.last_draft_probs = self.draft.last_draft_probs if drafted else {}  # lookups are point masses
        return [out[r.request_id] for r in requests]

    def catch_up_tokens(self, requests: list[Request]) -> list[int]:
        # A lookup needs no catch-up now; the draft's gap is paid when the draft next proposes.
        behind = self.draft.catch_up_tokens(requests)
        return [0 if r.request_id in self._by_lookup else c for r, c in zip(requests, behind, strict=True)]

    def bucket_prior(self, bucket: int) -> float | None:
        return self.lookup.bucket_prior(bucket)

    @property
    def cached_tokens(self) -> int:
        return self.lookup.cached_tokens

    def forget(self, request_id: str) -> None:
        self.lookup.forget(request_id)
        self.draft.forget(request_id)

    def retain(self, request_ids: Iterable[str]) -> None:
        keep = list(request_ids)
        self.lookup.retain(keep)
        self.draft.retain(keep)

    @property
    def kv_bytes_per_block(self) -> int:
        return self.draft.kv_bytes_per_block

    def allocate_kv(self, num_blocks: int) -> None:
        self.draft.allocate_kv(num_blocks)

    def set_max_model_len(self, max_model_len: int) -> None:
        self.draft.set_max_model_len(max_model_len)
