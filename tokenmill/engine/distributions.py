"""A request's sampling distribution (temperature, top-k, top-p, min-p) and drawing a token from it.

Drawing is by inverse CDF: one uniform u per row, the first token whose cumulative probability
exceeds u × the row's total (float64 sums, so a token's interval is its probability to ~1e-16). One
random number per token, where the exponential race used before (argmax p_i / E_i) drew a whole
vocabulary of Exp(1) variables: 2.2 ms a row of 151,936 on this CPU against ~0.25 ms for softmax,
cumsum and search (docs/performance.md).

top-p needs the most probable tokens in order, not the whole vocabulary sorted (a 151,936-wide sort
took ~10 ms a row): here the k largest by `topk`, k grown ×4 until their mass reaches p (a few hundred
tokens at most temperatures for a language model's next token); on CPU the native `sample_rows` does
the whole draw, its cut from a histogram of the weights (kernels/cpu_kernels.cpp).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from tokenmill.engine.request import Request
from tokenmill.kernels import cpu_kernels

_NEG_INF = float("-inf")
_FIRST_CANDIDATES = 256  # tokens looked at first for a top-p cut (then ×4 until the mass reaches p)


def filtered_probs(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Row i's sampling distribution under requests[i]'s temperature, top-k, top-p and min-p."""
    temps = torch.tensor([r.params.temperature for r in requests], device=logits.device, dtype=logits.dtype)
    logits = logits / temps.unsqueeze(1)
    vocab = logits.shape[1]
    top_ks = [_top_k(r, vocab) for r in requests]
    top_ps = [r.params.top_p for r in requests]
    if any(k < vocab or p < 1.0 for k, p in zip(top_ks, top_ps, strict=True)):
        logits = _top_k_top_p(logits, top_ks, top_ps)
    probs = torch.softmax(logits, dim=-1)
    min_ps = [r.params.min_p for r in requests]
    if any(min_ps):
        # min-p: drop tokens whose probability is below min_p × the top probability.
        threshold = torch.tensor(min_ps, device=probs.device).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _top_k(request: Request, vocab: int) -> int:
    """The request's top-k as a count (the whole vocabulary where it is off: 0 or -1)."""
    k = request.params.top_k
    return k if 0 < k < vocab else vocab


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Keep the k most likely tokens, then the smallest set of them, most likely first, whose mass
    (under the softmax over the k) reaches p (≥ 1 token); the rest become -inf."""
    vocab = logits.shape[1]
    out = logits.clone()
    for row, (k, p) in enumerate(zip(top_ks, top_ps, strict=True)):
        if k >= vocab and p >= 1.0:
            continue
        keep = _kept_ids(logits[row], k, p)
        masked = torch.full_like(logits[row], _NEG_INF)
        masked[keep] = logits[row, keep]
        out[row] = masked
    return out


def _kept_ids(row: torch.Tensor, k: int, p: float) -> torch.Tensor:
    vocab = row.shape[0]
    if p >= 1.0:
        return row.topk(k).indices
    # The normaliser of the top-p mass: the top-k tokens' (all of them when top-k is off). float64 sums:
    # the cut at a mass of exactly p (flat rows) lands where exact arithmetic puts it.
    log_total = torch.logsumexp((row.topk(k).values if k < vocab else row).double(), dim=0)
    m = min(k, _FIRST_CANDIDATES)
    while True:
        values, ids = row.topk(m)  # descending
        probs = torch.exp(values.double() - log_total)
        mass_before = torch.cumsum(probs, dim=0) - probs
        kept = int((mass_before < p).sum())
        if kept < m or m == k:  # the cut falls inside the m, or there are no more candidates
            return ids[:max(kept, 1)]
        m = min(k, 4 * m)


def sample_tokens(logits: torch.Tensor, requests: Sequence[Request], uniforms: torch.Tensor) -> torch.Tensor:
    """The token row i draws with uniforms[i] under requests[i]'s temperature, top-k, top-p and min-p:
    the distribution of `filtered_probs`, drawn by inverse CDF in vocabulary order over the unnormalised
    weights exp((x - max x) / T). On CPU one native call does every row (kernels/cpu_kernels.cpp
    `sample_rows`: the cut from a histogram of the weights, no sort of the vocabulary, no [N, V]
    temporaries); elsewhere a row with a top-k or top-p cut computes over the tokens it keeps (sorted
    by id, so the draw is the one over the whole row: zeros add nothing to a running sum). The plain
    sampler and speculative verification both draw through here, so one uniform picks the same token
    in either."""
    native = cpu_kernels() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if native is not None:
        params = [r.params for r in requests]
        return cast(torch.Tensor, native.sample_rows(
            logits.contiguous(), torch.tensor([p.temperature for p in params]),
            torch.tensor([p.top_k for p in params], dtype=torch.long), torch.tensor([p.top_p for p in params]),
            torch.tensor([p.min_p for p in params]), uniforms))
    vocab = logits.shape[1]
    out = torch.empty(len(requests), dtype=torch.long, device=logits.device)
    whole: list[int] = []
    for row, request in enumerate(requests):
        k, p = _top_k(request, vocab), request.params.top_p
        if k >= vocab and p >= 1.0:
            whole.append(row)
            continue
        scaled = logits[row] / request.params.temperature
        ids = _kept_ids(scaled, k, p).sort().values
        weights = _min_p(_weights(scaled[ids].unsqueeze(0)), [request.params.min_p])
        out[row] = ids[draw_tokens(weights, uniforms[row:row + 1])[0]]
    if whole:
        index = torch.tensor(whole, device=logits.device)
        rows = logits if len(whole) == len(requests) else logits[index]
        temps = torch.tensor([requests[i].params.temperature for i in whole], device=rows.device, dtype=rows.dtype)
        weights = _min_p(_weights(rows / temps.unsqueeze(1)), [requests[i].params.min_p for i in whole])
        out[index] = draw_tokens(weights, uniforms[index.cpu()])
    return out


def _weights(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised softmax, exp(x - max x) per row: the largest is 1."""
    return torch.exp(x - x.amax(dim=-1, keepdim=True))


def _min_p(weights: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """Zero the weights below min_p × the top one (which is 1)."""
    if not any(min_ps):
        return weights
    threshold = torch.tensor(min_ps, device=weights.device, dtype=weights.dtype).unsqueeze(1)
    return weights.masked_fill(weights < threshold, 0.0)


def draw_tokens(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row i's token by inverse CDF: the first whose cumulative probability exceeds uniforms[i] × the
    row's total (probs [N, V] unnormalised is fine; uniforms [N] in [0, 1), float64). Never a token of
    probability 0: the running sum does not rise there, and a target rounded up to the total falls back
    to the row's last token of positive probability."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    targets = (uniforms.to(cdf.device, torch.float64) * cdf[:, -1]).unsqueeze(1)
    picked = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    over = picked >= probs.shape[1]
    if bool(over.any()):
        last = probs.shape[1] - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1)
        picked = torch.where(over, last, picked)
    return picked
