"""Batched sampling: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

Rows are independent: a request's token depends only on its own logits, parameters and
generator, so a seeded request samples the same way whatever else shares the batch.
Sampling uses the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks i with
probability p_i, and needs one noise row per request (seeded rows use their own generator).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.engine.request import Request, TokenLogprob

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SamplerBatch:
    """Per-row parameters of one step's sampling, built once per step from the requests."""

    requests: list[Request]
    generators: list[torch.Generator | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def generator_for(self, request: Request) -> torch.Generator | None:
        seed = request.params.seed
        if seed is None:
            return None
        gen = self._request_generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._request_generators[request.request_id] = gen
        return gen

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[tuple[int, TokenLogprob | None]]:
        """logits: float32 [N, vocab], one row per request. Returns the token (and logprob) per row."""
        raw = logits
        logits = self._apply_penalties(logits.clone(), requests)
        logits = _mask_early_stop(logits, requests)
        token_ids = self._pick(logits, requests)
        ids = token_ids.tolist()
        logprobs = token_logprobs(raw, token_ids, [r.params.logprobs for r in requests])
        return list(zip(ids, logprobs, strict=True))

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        for row, request in enumerate(requests):
            p = request.params
            if not p.uses_penalties:
                continue
            if p.repetition_penalty != 1.0:
                # HF/vLLM: over prompt and output tokens, divide positive logits, multiply negative.
                seen = torch.tensor(sorted(set(request.token_ids)), device=logits.device)
                vals = logits[row, seen]
                logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if p.presence_penalty or p.frequency_penalty:
                out_ids = torch.tensor(request.output_token_ids, device=logits.device, dtype=torch.long)
                ones = torch.ones_like(out_ids, dtype=logits.dtype)
                counts = torch.zeros_like(logits[row]).index_add_(0, out_ids, ones)
                logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    def _pick(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.params.is_greedy]
        if not random_rows:
            return greedy
        rows = torch.tensor(random_rows, device=logits.device)
        sub = [requests[i] for i in random_rows]
        probs = _filtered_probs(logits[rows], sub)
        noise = self._noise(probs, sub)
        greedy[rows] = (probs / noise).argmax(dim=-1)
        return greedy

    def _noise(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, request in enumerate(requests):
            gen = self.generator_for(request)
            if gen is not None:
                noise[row].exponential_(generator=gen)
        return noise


def _mask_early_stop(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Before min_tokens, EOS and stop token ids cannot be sampled."""
    for row, request in enumerate(requests):
        p = request.params
        if p.min_tokens and request.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(request.eos_token_ids))
            if banned:
                logits[row, banned] = _NEG_INF
    return logits


def _filtered_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    temps = torch.tensor([r.params.temperature for r in requests], device=logits.device, dtype=logits.dtype)
    logits = logits / temps.unsqueeze(1)
    top_ks = [r.params.top_k if r.params.top_k > 0 else logits.shape[1] for r in requests]
    top_ps = [r.params.top_p for r in requests]
    if any(k < logits.shape[1] for k in top_ks) or any(p < 1.0 for p in top_ps):
        logits = _top_k_top_p(logits, top_ks, top_ps)
    probs = torch.softmax(logits, dim=-1)
    min_ps = [r.params.min_p for r in requests]
    if any(min_ps):
        # min-p: drop tokens whose probability is below min_p × the top probability.
        threshold = torch.tensor(min_ps, device=probs.device).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Keep the k most likely tokens, then the smallest set whose mass reaches p (≥ 1 token)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    ks = torch.tensor(top_ks, device=logits.device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= ks, _NEG_INF)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    ps = torch.tensor(top_ps, device=logits.device, dtype=probs.dtype).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(mass_before >= ps, _NEG_INF)
    return torch.full_like(logits, _NEG_INF).scatter(1, order, sorted_logits)


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
