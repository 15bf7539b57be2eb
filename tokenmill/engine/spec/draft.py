"""Draft-model proposer: a small model with the target's tokenizer guesses k tokens.

A greedy request's guesses are the draft's argmax (q a point mass); a sampled request's are drawn
from the draft's own distribution under the request's temperature, top-k, top-p and min-p, and that
q goes to verification (Sampler.verify accepts with min(1, p/q)): where the target hesitates
between tokens, a guess drawn from a similar q is accepted far more often than the draft's argmax
(p = q = (0.5, 0.5): every time against half the time). A seeded request keeps argmax guesses: point
masses are verified by the plain sampler's own draw, so its tokens stay those it gets without
speculation (Sampler._draw_run). `sample=False` keeps greedy guesses for all.

The draft keeps its own paged KV cache (its own block pool and tables, no prefix cache) and runs
through an ordinary ModelRunner, batched across requests:
    forward 1     every request's tokens the draft has not computed yet (the prompt on first use,
                  then the tokens the target accepted last step), logits of the last → d_1
    forward 2..k  one token per request (d_{j-1}) → d_j
With a gate (the controller's DraftGate), each guess goes with the draft's probability of it, and a
request's proposal ends at the first guess the gate does not keep: that guess is dropped and the
request takes no more forwards this step (a step's loop ends when no request is left drafting).
Staying in step with the target: the draft's KV was computed over `shadow.token_ids`, which is the
target's token_ids up to `base` followed by the previous proposals. Next time, the KV stays valid
up to the common prefix of the two sequences (the accepted proposals); past it, it is recomputed,
which is the draft's rollback.

Prefix caching (when the target has it on): a new request's draft sequence starts from the draft
pool's cached blocks of its prompt, so requests sharing a system prompt or an agent's history do
not prefill it in the draft again (on one CPU a 150-token draft prefill cost as much as a third of
a 32-token request's decoding). Only blocks wholly inside the target's tokens (`base`) are
published: past it the shadow holds proposals, which a rollback overwrites in place, and a block
published under the hash of tokens it no longer holds would hand wrong KV to the next hit.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from tokenmill.engine.distributions import draw_tokens, filtered_probs
from tokenmill.engine.interfaces import ScheduledRequest, SchedulerOutput
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.model_runner import ModelRunner, kv_bytes_per_block
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.engine.sampler import argmax_rows, top1_probs
from tokenmill.engine.spec.base import ProposalGate, Proposer, register_proposer
from tokenmill.engine.spec.controller import DECODE_LIKE_TOKENS

_DRAFT_SEED = 0x5EED  # the draft's own sampling stream (only unseeded requests draw from q)


@dataclass(slots=True)
class _DraftSeq:
    shadow: Request  # token_ids: what the draft's KV holds (up to num_computed_tokens) or will hold
    base: int  # target tokens known when it last proposed: shadow.token_ids[:base] are the target's
    target: Request  # the target's request: its sampling parameters
    cached: list[int] = field(default_factory=list)  # a new sequence's prefix-cache hits, until allocated
    q: list[torch.Tensor] = field(default_factory=list)  # a sampled request's: each guess's distribution


@register_proposer("draft")
class DraftModelProposer(Proposer):
    takes_gate = True

    def __init__(self, runner: ModelRunner, num_blocks: int | None, block_size: int, max_model_len: int,
                 enable_prefix_caching: bool = True, sample: bool = True) -> None:
        """`num_blocks` None: the weights are in, the KV pool comes later (`allocate_kv`), once the
        engine has probed the memory left after both models' weights. `sample`: draw a sampled
        request's guesses from the draft's distribution (else its argmax)."""
        self.runner = runner
        self.vocab_size = runner.arch.vocab_size  # a q row's width: its head may score fewer (draft_vocab)
        self.sample = sample
        self.generator = torch.Generator(device=runner.device)
        self.generator.manual_seed(_DRAFT_SEED)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.kv = KVCacheManager(1, block_size, enable_prefix_caching=False)
        self.max_model_len = min(max_model_len, runner.arch.max_position_embeddings)
        self._seqs: dict[str, _DraftSeq] = {}
        if num_blocks is not None:
            self.allocate_kv(num_blocks)

    @property
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.runner.arch, self.block_size, self.runner.kv_spec)

    def allocate_kv(self, num_blocks: int) -> None:
        self.retain(())
        self.runner.allocate_kv_cache(num_blocks)
        self.kv = KVCacheManager(num_blocks, self.block_size, self.enable_prefix_caching)

    def set_max_model_len(self, max_model_len: int) -> None:
        self.max_model_len = min(max_model_len, self.runner.arch.max_position_embeddings)

    def propose(self, requests: list[Request], num_tokens: list[int],
                gate: ProposalGate | None = None) -> list[list[int]]:
        active: list[tuple[_DraftSeq, int]] = []
        self.last_draft_probs = {}
        for request, k in zip(requests, num_tokens, strict=True):
            k = min(k, self.max_model_len - request.num_tokens)
            seq = self._sync(request) if k > 0 else None
            if seq is not None and self._allocate(seq, k):
                seq.q = []
                active.append((seq, k))
        decode_like: list[float] = []
        catch_ups: list[tuple[int, float]] = []
        if not active:
            self.last_decode_forward_s, self.last_catch_ups = (), ()
            return [[] for _ in requests]
        live, j = active, 1
        while live:
            new = [s.shadow.num_tokens - s.shadow.num_computed_tokens for s, _ in live]
            started = time.monotonic()
            confidence = self._forward([s for s, _ in live], gate is not None)  # forward 1 catches up, then d_j
            seconds = time.monotonic() - started
            if max(new) <= DECODE_LIKE_TOKENS:
                decode_like.append(seconds)
            else:
                catch_ups.append((sum(new) - len(new), seconds))
            if j == 1:
                for s, _ in active:
                    self.kv.commit_computed(s.shadow, limit=s.base)  # the target's tokens only (module docstring)
            if gate is not None:
                live = [(s, k) for s, k in live if self._kept(s, gate, confidence[s.shadow.request_id])]
            j += 1
            live = [(s, k) for s, k in live if k >= j]
        self.last_decode_forward_s, self.last_catch_ups = tuple(decode_like), tuple(catch_ups)
        drafts = {s.shadow.request_id: s.shadow.token_ids[s.base:] for s, _ in active}
        self.last_draft_probs = {s.shadow.request_id: torch.stack(s.q) for s, _ in active if s.q}
        assert all(len(q) == len(drafts[rid]) for rid, q in self.last_draft_probs.items()), "a q row per guess"
        return [drafts.get(r.request_id, []) for r in requests]

    def catch_up_tokens(self, requests: list[Request]) -> list[int]:
        # Tokens the target added since this draft last proposed for it (its KV covers about that far;
        # the guesses accepted since are a few more). A request the draft has not seen yet counts 0:
        # its prompt is read once whatever is decided, and may hit the draft's prefix cache.
        out = []
        for request in requests:
            seq = self._seqs.get(request.request_id)
            out.append(0 if seq is None else max(0, request.num_tokens - seq.base))
        return out

    @staticmethod
    def _kept(seq: _DraftSeq, gate: ProposalGate, confidence: float) -> bool:
        """Whether the gate keeps the guess just drafted; if not it is dropped (it has no KV yet: a
        guess is computed only by the forward after it) and the request's proposal ends."""
        if gate.keep(seq.shadow.request_id, confidence):
            return True
        seq.shadow.token_ids.pop()
        if seq.q:
            seq.q.pop()
        return False

    def _sync(self, request: Request) -> _DraftSeq:
        """Bring the shadow sequence to the target's tokens, keeping the KV of the common prefix."""
        tokens = request.token_ids
        seq = self._seqs.get(request.request_id)
        if seq is None:
            shadow = Request(request.request_id, list(tokens), SamplingParams(max_tokens=None),
                             cache_salt=request.cache_salt)
            seq = self._seqs[request.request_id] = _DraftSeq(shadow, len(tokens), request)
            seq.cached = self.kv.find_cached_prefix(shadow)
            self.kv.record_lookup(shadow.num_tokens, len(seq.cached) * self.block_size)
            return seq
        seq.target = request
        mine = seq.shadow.token_ids
        common = min(seq.base, len(tokens))
        while common < min(len(mine), len(tokens)) and mine[common] == tokens[common]:
            common += 1
        # At least the last token is recomputed: its logits give d_1.
        seq.shadow.num_computed_tokens = min(seq.shadow.num_computed_tokens, common, len(tokens) - 1)
        del mine[common:]
        del seq.shadow.block_hashes[common // self.block_size:]  # hashes of blocks the rollback changes
        mine.extend(tokens[common:])
        seq.base = len(tokens)
        return seq

    def _allocate(self, seq: _DraftSeq, k: int) -> bool:
        """KV for the catch-up tokens and d_1..d_{k-1} (d_k is proposed, never computed)."""
        shadow = seq.shadow
        cached_tokens = len(seq.cached) * self.block_size
        if self.kv.allocate(shadow, shadow.num_tokens - shadow.num_computed_tokens - cached_tokens + k - 1,
                            seq.cached):
            shadow.num_computed_tokens += cached_tokens
            seq.cached = []
            return True
        self.forget(shadow.request_id)  # no room: this request proposes nothing, and keeps nothing
        return False

    def _forward(self, seqs: list[_DraftSeq], confidence: bool = False) -> dict[str, float]:
        """One batched draft forward: each sequence's uncomputed tokens; append its next token (the argmax,
        or for a sampled request a draw from q, kept in seq.q). With `confidence`: request → the
        draft's probability of the token it appended."""
        scheduled = [ScheduledRequest(s.shadow, s.shadow.num_computed_tokens,
                                      s.shadow.num_tokens - s.shadow.num_computed_tokens,
                                      self.kv.block_tables[s.shadow.request_id]) for s in seqs]
        order, logits = self.runner.sample_logits(SchedulerOutput(scheduled))
        tokens = argmax_rows(logits)
        probs: list[float] = top1_probs(logits) if confidence else []  # p of the argmax
        sampled = [i for i, s in enumerate(order) if self.sample and _draws(self._seqs[s.request.request_id].target)]
        if sampled:  # draw from q instead (by inverse CDF, as the sampler does); p of the guess
            rows = torch.tensor(sampled, device=logits.device)
            seqs_drawn = [self._seqs[order[i].request.request_id] for i in sampled]
            q = filtered_probs(logits[rows], [seq.target for seq in seqs_drawn])
            picked = draw_tokens(q, torch.rand(len(seqs_drawn), generator=self.generator, dtype=torch.float64))
            tokens[rows] = picked
            if q.shape[1] < self.vocab_size:  # a cut head (draft_vocab): q is 0 past it, a distribution still
                q = torch.nn.functional.pad(q, (0, self.vocab_size - q.shape[1]))
            for j, (i, token, seq) in enumerate(zip(sampled, picked.tolist(), seqs_drawn, strict=True)):
                seq.q.append(q[j])  # the distribution of the guess appended below
                if probs:
                    probs[i] = float(q[j, token])
        out = {}
        for i, (s, token) in enumerate(zip(order, tokens.tolist(), strict=True)):
            shadow = s.request
            shadow.num_computed_tokens = shadow.num_tokens
            shadow.token_ids.append(token)
            if probs:
                out[shadow.request_id] = probs[i]
        return out

    def forget(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq.shadow)
            self.runner.forget(request_id)

    def retain(self, request_ids: Iterable[str]) -> None:
        keep = set(request_ids)
        for rid in [r for r in self._seqs if r not in keep]:
            self.forget(rid)


def _draws(target: Request) -> bool:
    """Whether a request's guesses are drawn from q (sampled, unseeded) rather than the draft's argmax."""
    return not target.params.is_greedy and target.params.seed is None
