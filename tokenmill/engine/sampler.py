"""Batched sampling: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

Rows are independent: a request's token depends only on its own logits, parameters and
generator, so a seeded request samples the same way whatever else shares the batch.
A token is drawn by inverse CDF with one uniform per row (engine/distributions.py; seeded rows
draw theirs from their own generator).

`verify` scores speculative proposals (Leviathan et al. 2023, Chen et al. 2023). Request i brings
k proposals d_1..d_k, drawn from q, and k + 1 target rows p_0..p_k (p_j scores the token after d_j;
penalties and min_tokens see d_1..d_j as already generated, so p_j is exactly the distribution the
plain sampler would use there). Greedy: accept while d_{j+1} == argmax p_j, then emit argmax p_a.
Sampling: accept d_{j+1} with probability min(1, p_j(d)/q_j(d)); at the first rejection emit a
token from norm(max(0, p_j - q_j)); when all are accepted emit a bonus token from p_k. Each emitted
token is then distributed exactly as p (the proof: P(x) = q(x) min(1, p/q) + (1 - sum_y min(p, q))
max(0, p - q)(x) / sum max(0, p - q) = min(p, q)(x) + max(0, p - q)(x) = p(x)). A point-mass
proposal (n-gram lookup, a greedy draft) is q = one-hot(d): accept with probability p(d), else
sample from p with d removed. That one is done by the plain sampler's own draw (`_draw_run`): the
token drawn from p_j with the request's next uniform, d accepted iff it is that token; so a seeded
request's tokens are those it gets without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tokenmill.engine.distributions import draw_tokens, filtered_probs, sample_tokens
from tokenmill.engine.request import Request, TokenLogprob
from tokenmill.kernels import cpu_kernels

_NEG_INF = float("-inf")


Verified = tuple[list[int], list[TokenLogprob | None]]  # one request's emitted tokens and their logprobs


@dataclass(slots=True)
class SamplerBatch:
    """Per-row parameters of one step's sampling, built once per step from the requests."""

    requests: list[Request]
    generators: list[torch.Generator | None]


class LogitsProcessor(Protocol):
    """Masks rows of processed logits in place before sampling (structured outputs): it picks its
    own rows (requests with a grammar) and leaves the others alone. `extra` as in `_apply_penalties`."""

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request],
                 extra: Sequence[Sequence[int]] | None = None) -> torch.Tensor: ...

    def forget(self, request_id: str) -> None: ...

    def prepare(self, requests: Sequence[Request]) -> None:
        """Before the forward, the rows this step will sample (so masks can be built meanwhile)."""

    def forced_tokens(self, request: Request) -> list[int]:
        """Tokens the request's constraint forces next ([] where none): speculative proposals."""

    def count_valid(self, request: Request, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the request's constraint allows next."""


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.logits_processor: LogitsProcessor | None = None
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}
        # True: rows without penalties, min_tokens, seeds, logprobs or a grammar are sampled in a few
        # batched ops (argmax; temperature/top-k/top-p/min-p with shared noise) and only the others
        # take the per-request path. False: every row takes it (the previous path, for benchmarks).
        self.fast_path = True

    def generator_for(self, request: Request) -> torch.Generator | None:
        return request_generator(self._request_generators, request, self.device)

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)
        if self.logits_processor is not None:
            self.logits_processor.forget(request_id)

    def prepare(self, requests: list[Request]) -> None:
        """Called before the forward with the rows `__call__` will get: the logits processor starts
        their masks on a worker thread, overlapped with the forward (structured outputs). It sees
        the rows the per-request path will hand it, in the same order."""
        if self.logits_processor is not None:
            self.logits_processor.prepare([r for r in requests if needs_python(r)] if self.fast_path else requests)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[tuple[int, TokenLogprob | None]]:
        """logits: float32 [N, vocab], one row per request. Returns the token (and logprob) per row."""
        if not self.fast_path:
            return self._sample_each(logits, requests)
        special = [i for i, r in enumerate(requests) if needs_python(r)]
        if len(special) == len(requests):
            return self._sample_each(logits, requests)
        ids = self._pick_plain(logits, requests, set(special)).tolist()
        result: list[tuple[int, TokenLogprob | None]] = [(t, None) for t in ids]
        if special:
            rows = torch.tensor(special, device=logits.device)
            for i, pair in zip(special, self._sample_each(logits[rows], [requests[i] for i in special]), strict=True):
                result[i] = pair
        return result

    def _pick_plain(self, logits: torch.Tensor, requests: list[Request], special: set[int]) -> torch.Tensor:
        """Tokens of the plain rows (the others' entries are discarded): logits are read, never written."""
        picked = argmax_rows(logits)
        random_rows = [i for i, r in enumerate(requests) if not r.params.is_greedy and i not in special]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            uniforms = torch.rand(len(random_rows), generator=self.generator, dtype=torch.float64)
            picked[rows] = sample_tokens(logits[rows], [requests[i] for i in random_rows], uniforms).to(picked.device)
        return picked

    def _sample_each(self, logits: torch.Tensor, requests: list[Request]) -> list[tuple[int, TokenLogprob | None]]:
        """The general path: penalties, min_tokens, the logits processor, seeds and logprobs per row."""
        raw = logits
        token_ids = self._pick(self._processed(logits, requests), requests)
        ids = token_ids.tolist()
        logprobs = token_logprobs(raw, token_ids, [r.params.logprobs for r in requests])
        return list(zip(ids, logprobs, strict=True))

    def verify(self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]],
               draft_probs: list[torch.Tensor | None] | None = None) -> list[Verified]:
        """logits: float32 [sum(k_i + 1), vocab], request i's k_i + 1 rows back to back. draft_probs[i]:
        q of request i's proposals [k_i, vocab], or None for a point mass. Returns each request's emitted
        tokens (accepted proposals, then one correction or bonus token) with their target logprobs."""
        counts = [len(d) + 1 for d in drafts]
        row_requests = [r for r, c in zip(requests, counts, strict=True) for _ in range(c)]
        # Row j of a request sees its first j proposals as generated tokens (penalties, min_tokens).
        extra = [d[:j] for d in drafts for j in range(len(d) + 1)]
        processed = self._processed(logits, row_requests, extra)
        starts = [sum(counts[:i]) for i in range(len(counts))]
        emitted = self._verify_greedy(processed, requests, drafts, starts)
        random_ids = [i for i, r in enumerate(requests) if not r.params.is_greedy]
        if random_ids:
            q = draft_probs or [None] * len(requests)
            picked = self._verify_random(processed, [requests[i] for i in random_ids], [drafts[i] for i in random_ids],
                                         [starts[i] for i in random_ids], [q[i] for i in random_ids])
            for i, tokens in zip(random_ids, picked, strict=True):
                emitted[i] = tokens
        wanted = [requests[i].params.logprobs for i, tokens in enumerate(emitted) for _ in tokens]
        entries: list[TokenLogprob | None] = [None] * len(wanted)
        if any(n is not None for n in wanted):  # else no gather of the emitted rows (~600 KB each)
            rows = [starts[i] + j for i, tokens in enumerate(emitted) for j in range(len(tokens))]
            flat = torch.tensor([t for tokens in emitted for t in tokens], device=logits.device)
            entries = token_logprobs(logits[rows], flat, wanted)
        result, at = [], 0
        for tokens in emitted:
            result.append((tokens, entries[at:at + len(tokens)]))
            at += len(tokens)
        return result

    @staticmethod
    def _verify_greedy(processed: torch.Tensor, requests: list[Request], drafts: list[list[int]],
                       starts: list[int]) -> list[list[int]]:
        targets = argmax_rows(processed).tolist()
        emitted = []
        for request, draft, start in zip(requests, drafts, starts, strict=True):
            tokens = []
            if request.params.is_greedy:
                for j, d in enumerate(draft):
                    if d != targets[start + j]:
                        break
                    tokens.append(d)
                tokens.append(targets[start + len(tokens)])
            emitted.append(tokens)
        return emitted

    def _verify_random(self, processed: torch.Tensor, requests: list[Request], drafts: list[list[int]],
                       starts: list[int], draft_probs: list[torch.Tensor | None]) -> list[list[int]]:
        counts = [len(d) + 1 for d in drafts]
        rows = torch.tensor([s + j for s, c in zip(starts, counts, strict=True) for j in range(c)],
                            device=processed.device)
        row_requests = [r for r, c in zip(requests, counts, strict=True) for _ in range(c)]
        rows_of = processed[rows]
        probs = filtered_probs(rows_of, row_requests) if any(q is not None for q in draft_probs) else None
        emitted: list[list[int]] = []
        drawn: list[tuple[int, list[int], torch.Tensor]] = []  # requests with q: (index, accepted, final p)
        at = 0
        for i, (request, draft, q) in enumerate(zip(requests, drafts, draft_probs, strict=True)):
            at += len(draft) + 1
            if q is None:
                emitted.append(self._draw_run(rows_of[at - len(draft) - 1:at], draft, request))
            else:
                assert probs is not None
                p = probs[at - len(draft) - 1:at]
                tokens, final = self._accept_run(p, draft, q, self.generator_for(request))
                emitted.append([])
                drawn.append((i, tokens, final))
        if drawn:
            finals = torch.stack([final for _, _, final in drawn])
            lasts = draw_tokens(finals, self._uniforms([requests[i] for i, _, _ in drawn])).tolist()
            for (i, tokens, _), last in zip(drawn, lasts, strict=True):
                emitted[i] = [*tokens, last]
        return emitted

    def _draw_run(self, logits: torch.Tensor, draft: list[int], request: Request) -> list[int]:
        """Point-mass proposals (q = one-hot(d)), verified by the plain sampler's own draw: position j's
        token is drawn from p_j with the next uniform of the request's stream (its seed's, else the shared
        one), as a plain step would draw it, and the proposal is accepted iff it is the token drawn.
        P(accept d) = p(d), and a rejection emits the draw, distributed as p without d: the rule above for
        a point mass. It draws nothing else, one uniform per emitted token, so a seeded request emits the
        same tokens with speculation as without (the rows' logits are the same bits)."""
        tokens: list[int] = []
        for j in range(len(draft) + 1):
            token = int(sample_tokens(logits[j:j + 1], [request], self._uniforms([request]))[0])
            tokens.append(token)
            if j == len(draft) or token != draft[j]:
                break
        return tokens

    def _accept_run(self, p: torch.Tensor, draft: list[int], q: torch.Tensor,
                    gen: torch.Generator | None) -> tuple[list[int], torch.Tensor]:
        """Proposals drawn from q: accepted ones and the distribution the next token is drawn from (residual
        or bonus)."""
        k = len(draft)
        if k == 0:
            return [], p[0]
        ids = torch.tensor(draft, device=p.device)
        p_d = p[:k].gather(1, ids[:, None])[:, 0]
        q_d = q.gather(1, ids[:, None])[:, 0]
        u = torch.rand(k, device=p.device, generator=gen if gen is not None else self.generator)
        accept = (u * q_d < p_d).tolist()  # u < min(1, p/q), without dividing by a zero q
        num = accept.index(False) if False in accept else k
        if num == k:
            return list(draft), p[k]
        residual = (p[num] - q[num]).clamp_min(0.0)
        total = residual.sum()
        # p == q (up to rounding) leaves nothing to correct with: then p itself is the residual's limit.
        return list(draft[:num]), residual / total if float(total) > 0.0 else p[num]

    def _processed(self, logits: torch.Tensor, requests: list[Request],
                   extra: list[list[int]] | None = None) -> torch.Tensor:
        """Row i's logits as requests[i] samples from them: logit_bias, penalties, min_tokens and a grammar's
        mask applied to a copy (the raw rows stay for logprobs); the rows themselves where no request edits
        them (no [N, vocab] copy: ~5 MB for 8 rows of Qwen's vocabulary). `extra` as in `_apply_penalties`."""
        if not any(edits_logits(r) for r in requests):
            return logits
        processed = self._apply_penalties(logits.clone(), requests, extra)
        processed = _mask_early_stop(processed, requests, extra)
        if self.logits_processor is not None:
            processed = self.logits_processor(processed, requests, extra)
        return processed

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request],
                         extra: list[list[int]] | None = None) -> torch.Tensor:
        """logit_bias, then the penalties, in place. `extra[row]`: tokens to count as generated after the
        request's own (proposals being verified)."""
        for row, request in enumerate(requests):
            p = request.params
            if p.logit_bias:  # first, as vLLM: the penalties below then see the biased logits
                ids, bias = _bias_tensors(p.logit_bias, logits.device, logits.dtype)
                logits[row].index_add_(0, ids, bias)
            more = extra[row] if extra is not None else []
            if p.allowed_token_ids is not None or p.bad_words_token_ids:
                _mask_tokens(logits[row], request, more)
            if not p.uses_penalties:
                continue
            if p.repetition_penalty != 1.0:
                # HF/vLLM: over prompt and output tokens, divide positive logits, multiply negative.
                seen = torch.tensor(sorted(set(request.token_ids).union(more)), device=logits.device)
                vals = logits[row, seen]
                logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if p.presence_penalty or p.frequency_penalty:
                out_ids = torch.tensor(request.output_token_ids + more, device=logits.device, dtype=torch.long)
                ones = torch.ones_like(out_ids, dtype=logits.dtype)
                counts = torch.zeros_like(logits[row]).index_add_(0, out_ids, ones)
                logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    def _pick(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        greedy = argmax_rows(logits)
        random_rows = [i for i, r in enumerate(requests) if not r.params.is_greedy]
        if not random_rows:
            return greedy
        rows = torch.tensor(random_rows, device=logits.device)
        sub = [requests[i] for i in random_rows]
        greedy[rows] = sample_tokens(logits[rows], sub, self._uniforms(sub)).to(greedy.device)
        return greedy

    def _uniforms(self, requests: list[Request]) -> torch.Tensor:
        """One U[0, 1) draw per request, float64: from its own stream where it has a seed (so a seeded
        row does not depend on the rows beside it), else from the shared one."""
        values = [self._uniform(r) for r in requests]
        return torch.tensor(values, dtype=torch.float64)

    def _uniform(self, request: Request) -> float:
        gen = self.generator_for(request)
        return float(torch.rand(1, generator=gen if gen is not None else self.generator, dtype=torch.float64))


def request_generator(generators: dict[str, torch.Generator], request: Request,
                      device: torch.device) -> torch.Generator | None:
    """A seeded request's own random stream (None without a seed), made once per request in `generators`."""
    seed = request.params.seed
    if seed is None:
        return None
    gen = generators.get(request.request_id)
    if gen is None:
        gen = generators[request.request_id] = torch.Generator(device=device)
        gen.manual_seed(seed)
    return gen


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of logits [N, V], the same indices (first maximum, first NaN); on CPU
    float32 through the native vectorised kernel (ATen's took ~0.35 ms for one 151936-wide row)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0:
        native = cpu_kernels()
        if native is not None:
            return native.argmax_rows(x.contiguous())
    return x.argmax(dim=-1)


def top1_probs(logits: torch.Tensor) -> list[float]:
    """Each row's largest softmax probability, exp(max - logsumexp), of raw float32 logits [N, V]."""
    return torch.exp(logits.amax(dim=-1) - torch.logsumexp(logits, dim=-1)).tolist()


def needs_python(request: Request) -> bool:
    """Whether a row needs the per-request sampling path (anything beyond temperature/top-k/top-p/min-p)."""
    p = request.params
    return edits_logits(request) or p.seed is not None or p.logprobs is not None


def edits_logits(request: Request) -> bool:
    """Whether sampling rewrites the request's logits before choosing (penalties, min_tokens, a grammar's
    mask): the rows are then processed on a copy, the raw ones kept for logprobs."""
    p = request.params
    return (p.uses_penalties or bool(p.min_tokens) or p.structured is not None or bool(p.logit_bias)
            or p.allowed_token_ids is not None or bool(p.bad_words_token_ids))


def _bias_tensors(bias: dict[int, float], device: torch.device,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(list(bias), device=device, dtype=torch.long),
            torch.tensor(list(bias.values()), device=device, dtype=dtype))


def _mask_tokens(row: torch.Tensor, request: Request, more: list[int]) -> None:
    """allowed_token_ids: every other token to -inf; bad words: each word's last token to -inf where the
    output (plus `more`, proposals being verified) ends with the word's other tokens. Where the two leave
    nothing to sample, the allowed tokens win (a row must keep a finite logit)."""
    p = request.params
    kept: torch.Tensor | None = None
    if p.allowed_token_ids is not None:
        ids = torch.tensor(p.allowed_token_ids, device=row.device, dtype=torch.long)
        kept = row[ids].clone()
        row.fill_(float("-inf"))
        row[ids] = kept
    if p.bad_words_token_ids:
        output = request.output_token_ids + more
        for word in p.bad_words_token_ids:
            head = word[:-1]
            if not head or output[len(output) - len(head):] == head:
                row[word[-1]] = float("-inf")
        if kept is not None and bool(torch.isinf(row).all()):
            row[ids] = kept


def _mask_early_stop(logits: torch.Tensor, requests: list[Request],
                     extra: list[list[int]] | None = None) -> torch.Tensor:
    """Before min_tokens, EOS and stop token ids cannot be sampled."""
    for row, request in enumerate(requests):
        p = request.params
        if p.min_tokens and request.num_output_tokens + (len(extra[row]) if extra is not None else 0) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(request.eos_token_ids))
            if banned:
                logits[row, banned] = _NEG_INF
    return logits


def token_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, wanted: list[int | None]) -> list[TokenLogprob | None]:
    """Logprob, rank and top-n of `token_ids[i]` under row i of the raw logits (None where not wanted)."""
    if all(n is None for n in wanted):
        return [None] * len(wanted)
    logp = torch.log_softmax(raw, dim=-1)
    chosen = logp.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (logp > chosen.unsqueeze(1)).sum(dim=-1) + 1
    max_n = max(n or 0 for n in wanted)
    top_vals, top_ids = logp.topk(max(max_n, 1), dim=-1)
    result: list[TokenLogprob | None] = []
    for row, n in enumerate(wanted):
        if n is None:
            result.append(None)
            continue
        top = list(zip(top_ids[row, :n].tolist(), top_vals[row, :n].tolist(), strict=True))
        result.append(TokenLogprob(int(token_ids[row]), float(chosen[row]), int(ranks[row]), top))
    return result
