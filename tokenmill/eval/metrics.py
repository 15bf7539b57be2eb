"""The numbers an eval reports, as plain functions over per-item values (numpy, no engine).

Every aggregate is a function of per-item arrays (`Columns`), so one bootstrap routine serves all
of them: resample items with replacement, recompute the aggregate, take percentiles. Ratio
metrics (perplexity = exp(Σ nll / Σ tokens)) stay ratios under resampling, as they should: a
long passage weighs more than a short one, in the estimate and in its interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

Columns = Mapping[str, np.ndarray]
Aggregate = Callable[[Columns], float]
TokenKey = int | str  # a token id, or its text where a server reports only text

LN2 = math.log(2.0)
# A floor for probabilities we cannot see (outside a top-k list): keeps logs finite. 1e-10 is far below
# anything a top-20 list leaves out of a real vocabulary, so it only matters when mass is truly missing.
PROB_FLOOR = 1e-10


@dataclass(frozen=True, slots=True)
class Metric:
    """A named aggregate over per-item columns; `higher_is_better` orients deltas and plots."""

    name: str
    aggregate: Aggregate
    higher_is_better: bool = True
    unit: str = ""


# ------------------------------------------------------------------ language modelling


def perplexity(nll_sum: float, num_tokens: int) -> float:
    """exp of the mean negative log-likelihood (nats) per token."""
    if num_tokens <= 0:
        return math.nan
    return math.exp(nll_sum / num_tokens)


def bits_per_byte(nll_sum: float, num_bytes: int) -> float:
    """Total nats over UTF-8 bytes, in bits: comparable across tokenizers, unlike perplexity."""
    if num_bytes <= 0:
        return math.nan
    return nll_sum / (num_bytes * LN2)


def top1(top: Mapping[TokenKey, float]) -> TokenKey | None:
    """The most likely token of a top-k list (ties: the first listed, as the server orders them)."""
    best: TokenKey | None = None
    best_lp = -math.inf
    for key, lp in top.items():
        if lp > best_lp:
            best, best_lp = key, lp
    return best


def topk_kl(reference: Mapping[TokenKey, float], candidate: Mapping[TokenKey, float]) -> float:
    """KL(reference ‖ candidate) in nats from two top-k logprob lists of the same position.

    The vocabulary is coarsened to the reference's top-k tokens plus one bucket for the rest, so
    the result is the KL of the two coarsened distributions, a lower bound of the full-vocabulary
    KL (data processing) when every probability is known. A reference token missing from the
    candidate's list gets the candidate's smallest listed probability at most (it ranked lower),
    shared out of the candidate's unlisted mass; both "rest" buckets are floored at PROB_FLOOR.
    """
    ref = {k: math.exp(v) for k, v in reference.items()}
    cand_listed = {k: math.exp(v) for k, v in candidate.items()}
    missing = [k for k in ref if k not in cand_listed]
    cand_unlisted_mass = max(1.0 - sum(cand_listed.values()), 0.0)
    cap = min(cand_listed.values()) if cand_listed else 1.0
    share = cand_unlisted_mass / len(missing) if missing else 0.0
    cand = {k: cand_listed[k] if k in cand_listed else max(min(cap, share), PROB_FLOOR) for k in ref}
    ref_rest = max(1.0 - sum(ref.values()), PROB_FLOOR)
    cand_rest = max(1.0 - sum(cand.values()), PROB_FLOOR)
    kl = sum(p * (math.log(p) - math.log(max(cand[k], PROB_FLOOR))) for k, p in ref.items() if p > 0)
    kl += ref_rest * (math.log(ref_rest) - math.log(cand_rest))
    return max(kl, 0.0)


# ------------------------------------------------------------------ generation and choice


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """The unbiased pass@k estimator of Chen et al. (2021): 1 - C(n-c, k) / C(n, k)."""
    if num_samples < k:
        raise ValueError("pass@k needs at least k samples")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(num_samples - num_correct + 1, num_samples + 1)))


def accuracy(correct: Sequence[bool] | np.ndarray) -> float:
    values = np.asarray(correct, dtype=float)
    return float(values.mean()) if values.size else math.nan


def choose(logprob_sums: Sequence[float], lengths: Sequence[int] | None = None) -> int:
    """lm-evaluation-harness's choice: argmax of the summed continuation logprob, or of it per
    unit of length (acc_norm uses the continuation's bytes). Ties go to the first choice."""
    scores = np.asarray(logprob_sums, dtype=float)
    if lengths is not None:
        scores = scores / np.maximum(np.asarray(lengths, dtype=float), 1.0)
    return int(np.argmax(scores))


# ------------------------------------------------------------------ intervals and tests


@dataclass(frozen=True, slots=True)
class Interval:
    low: float
    high: float

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high


def resample_indices(num_items: int, num_resamples: int, seed: int) -> np.ndarray:
    """[num_resamples, num_items] bootstrap draws; a fixed seed gives the same draws on every run."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, num_items, size=(num_resamples, num_items))


def bootstrap_interval(columns: Columns, aggregate: Aggregate, *, num_resamples: int = 1000, seed: int = 0,
                       confidence: float = 0.95) -> Interval:
    """Percentile bootstrap over items: the central `confidence` range of the resampled aggregate."""
    num_items = _num_items(columns)
    if num_items == 0:
        return Interval(math.nan, math.nan)
    draws = resample_indices(num_items, num_resamples, seed)
    values = np.array([aggregate({k: v[idx] for k, v in columns.items()}) for idx in draws])
    return _percentiles(values, confidence)


def paired_bootstrap_delta(reference: Columns, candidate: Columns, aggregate: Aggregate, *,
                           relative: bool = False, num_resamples: int = 1000, seed: int = 0,
                           confidence: float = 0.95) -> Interval:
    """Interval of aggregate(candidate) - aggregate(reference) (or their ratio - 1 with `relative`),
    resampling the same items on both sides: item difficulty cancels, so the interval is tight."""
    num_items = _num_items(reference)
    if num_items == 0 or _num_items(candidate) != num_items:
        return Interval(math.nan, math.nan)
    draws = resample_indices(num_items, num_resamples, seed)
    values = []
    for idx in draws:
        ref = aggregate({k: v[idx] for k, v in reference.items()})
        cand = aggregate({k: v[idx] for k, v in candidate.items()})
        values.append(cand / ref - 1.0 if relative else cand - ref)
    return _percentiles(np.array(values), confidence)


def mcnemar_p(reference_correct: Sequence[bool] | np.ndarray, candidate_correct: Sequence[bool] | np.ndarray) -> float:
    """Exact (binomial) two-sided McNemar test on paired right/wrong outcomes: only the items where
    the two disagree carry information; under the null each way is equally likely."""
    ref = np.asarray(reference_correct, dtype=bool)
    cand = np.asarray(candidate_correct, dtype=bool)
    b = int(np.sum(ref & ~cand))
    c = int(np.sum(~ref & cand))
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def sign_flip_p(differences: Sequence[float] | np.ndarray, *, num_resamples: int = 10000, seed: int = 0) -> float:
    """Paired permutation test of mean difference = 0: flip each item's sign at random (fixed seed).
    Two-sided; the observed arrangement counts once (so p is never 0)."""
    diffs = np.asarray(differences, dtype=float)
    diffs = diffs[np.isfinite(diffs)]
    if diffs.size == 0 or not np.any(diffs):
        return 1.0
    observed = abs(diffs.mean())
    rng = np.random.default_rng(seed)
    signs = rng.choice(np.array([-1.0, 1.0]), size=(num_resamples, diffs.size))
    means = np.abs((signs * diffs).mean(axis=1))
    # A tolerance so float noise in the permuted means does not decide ties with the observed one.
    return float((np.sum(means >= observed - 1e-12 * max(observed, 1.0)) + 1) / (num_resamples + 1))


def _num_items(columns: Columns) -> int:
    sizes = {len(v) for v in columns.values()}
    if len(sizes) > 1:
        raise ValueError(f"columns of different lengths: {sorted(sizes)}")
    return sizes.pop() if sizes else 0


def _percentiles(values: np.ndarray, confidence: float) -> Interval:
    values = values[np.isfinite(values)]
    if values.size == 0:
        return Interval(math.nan, math.nan)
    tail = (1.0 - confidence) / 2.0 * 100.0
    low, high = np.percentile(values, [tail, 100.0 - tail])
    return Interval(float(low), float(high))


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share (a greedy path may fork late on a rounding near-tie)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
