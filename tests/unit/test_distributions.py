"""engine/distributions.py: the top-k/top-p cut without a full sort, and inverse-CDF draws."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from scipy.stats import chisquare

from tokenmill.engine import distributions
from tokenmill.engine.distributions import _top_k_top_p, draw_tokens, filtered_probs, sample_tokens
from tokenmill.engine.request import Request, SamplingParams


def _reference_cut(logits: torch.Tensor, k: int, p: float) -> set[int]:
    """The whole row sorted: the k most likely, then those whose preceding mass (over the k) is below p."""
    values, order = logits.sort(descending=True)
    values, order = values[:k], order[:k]
    if p >= 1.0:
        return set(order.tolist())
    probs = torch.softmax(values.double(), dim=0)
    before = torch.cumsum(probs, dim=0) - probs
    return set(order[:max(int((before < p).sum()), 1)].tolist())


@pytest.mark.parametrize("scale", [8.0, 1.0, 0.05])  # peaked; a few hundred tokens; flat (past the first 256)
@pytest.mark.parametrize(("k", "p"), [(0, 0.9), (0, 0.5), (0, 0.999), (50, 0.9), (3000, 0.95), (20, 1.0), (0, 1e-9)])
def test_the_cut_keeps_the_tokens_a_full_sort_keeps(scale: float, k: int, p: float) -> None:
    vocab = 5000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(int(scale * 100) + k)) * scale
    k_eff = k if 0 < k < vocab else vocab
    cut = _top_k_top_p(logits, [k_eff] * 3, [p] * 3)
    for row in range(3):
        kept = set(torch.nonzero(cut[row] > float("-inf")).squeeze(1).tolist())
        assert kept == _reference_cut(logits[row], k_eff, p)
        assert torch.equal(cut[row, list(kept)], logits[row, list(kept)])


def test_filtered_probs_of_a_flat_row_with_top_p_spans_thousands_of_tokens() -> None:
    request = Request("r", [1], SamplingParams(temperature=1.0, top_p=0.9))
    probs = filtered_probs(torch.zeros(1, 10_000), [request])
    # 9,000 tokens hold exactly 0.9: the one after them is kept or not by the last bit of a sum
    assert 9000 <= int((probs > 0).sum()) <= 9001 and float(probs.sum()) == pytest.approx(1.0, abs=1e-5)


def test_draws_follow_the_distribution_and_never_pick_a_zero() -> None:
    probs = torch.tensor([[0.0, 0.1, 0.0, 0.6, 0.3, 0.0]])
    n = 20_000
    uniforms = torch.rand(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    tokens = draw_tokens(probs.expand(n, -1), uniforms)
    counts = torch.bincount(tokens, minlength=6).tolist()
    assert counts[0] == counts[2] == counts[5] == 0
    assert chisquare([counts[1], counts[3], counts[4]], [0.1 * n, 0.6 * n, 0.3 * n]).pvalue > 1e-3


def test_draw_edges_and_unnormalised_rows() -> None:
    probs = torch.tensor([[0.0, 2.0, 0.0, 2.0, 0.0]])  # unnormalised: halves
    edges = torch.tensor([0.0, 0.4999, 0.5, 1.0 - 1e-12], dtype=torch.float64)
    assert draw_tokens(probs.expand(4, -1), edges).tolist() == [1, 1, 3, 3]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_p=0.7),
                                    SamplingParams(temperature=0.6, top_k=30, min_p=0.02),
                                    SamplingParams(temperature=1.0, top_p=0.95, min_p=0.1)])
def test_sampling_over_the_kept_tokens_draws_what_the_whole_row_draws(params: SamplingParams) -> None:
    """A uniform picks the same token whether the row is cut to the tokens it keeps or drawn over all of
    them: the plain sampler and speculative verification may take either and stay coupled."""
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(9)) * 3
    requests = [Request(str(i), [1], params) for i in range(4)]
    for seed in range(25):
        uniforms = torch.rand(4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        expected = draw_tokens(filtered_probs(logits, requests), uniforms)
        assert sample_tokens(logits, requests, uniforms).tolist() == expected.tolist()


@pytest.fixture(params=["native", "torch"])
def whole_row_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Rows without a top-k/top-p cut: the CPU kernel where it builds, else (and forced here) torch ops."""
    if request.param == "torch":
        monkeypatch.setattr(distributions, "cpu_kernels", lambda: None)
    elif distributions.cpu_kernels() is None:
        pytest.skip("the CPU kernels do not build here")
    return str(request.param)


def test_whole_rows_follow_the_distribution_and_never_draw_a_masked_token(whole_row_path: str) -> None:
    vocab = 37  # not a multiple of 8: the kernel's tail
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(4)) * 2
    logits[0, [0, 5, 36]] = float("-inf")  # a grammar's or min_tokens' mask
    params = SamplingParams(temperature=0.7, min_p=0.05)
    expected = filtered_probs(logits, [Request("r", [1], params)])[0].double()
    expected /= expected.sum()  # min-p drops mass without renormalising
    n = 30_000
    uniforms = torch.rand(n, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    tokens = sample_tokens(logits.expand(n, -1).contiguous(), [Request("r", [1], params)] * n, uniforms)
    counts = torch.bincount(tokens, minlength=vocab)
    assert int(counts[expected == 0].sum()) == 0
    kept = expected > 0
    assert chisquare(counts[kept].tolist(), (expected[kept] * n).tolist()).pvalue > 1e-3
    last = sample_tokens(logits, [Request("r", [1], params)], torch.tensor([1.0 - 1e-15], dtype=torch.float64))
    assert int(last[0]) == int(torch.nonzero(kept)[-1])


def test_a_target_rounded_up_to_the_total_still_lands_on_an_allowed_token(whole_row_path: str) -> None:
    logits = torch.zeros(1, 20)
    logits[0, 11:] = float("-inf")  # masked tail, no min-p to hide it
    params = Request("r", [1], SamplingParams(temperature=1.0))
    assert int(sample_tokens(logits, [params], torch.tensor([1.0], dtype=torch.float64))[0]) == 10


@pytest.mark.parametrize("scale", [8.0, 1.0, 0.05])
@pytest.mark.parametrize(("k", "p"), [(0, 0.9), (0, 0.5), (50, 0.9), (3000, 0.95), (20, 1.0), (1, 1.0), (0, 1e-9)])
def test_draws_stay_inside_the_cut_and_reach_all_of_it(whole_row_path: str, scale: float, k: int, p: float) -> None:
    """A grid of uniforms over one row: every token drawn is in the full sort's cut, and every token of
    the cut with more than two grid steps of probability is drawn."""
    vocab = 5000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(int(scale * 100) + k)) * scale
    request = Request("r", [1], SamplingParams(temperature=1.0, top_k=k, top_p=p))
    k_eff = k if 0 < k < vocab else vocab
    cut = _reference_cut(logits[0], k_eff, p)
    grid = 20_000 if whole_row_path == "native" else 2_000  # the torch path cuts row by row in Python
    uniforms = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    drawn = set(sample_tokens(logits.expand(grid, -1).contiguous(), [request] * grid, uniforms).tolist())
    assert drawn <= cut
    probs = torch.zeros(vocab, dtype=torch.float64)
    ids = torch.tensor(sorted(cut))
    probs[ids] = torch.softmax(logits[0, ids].double(), dim=0)
    assert {i for i in cut if probs[i] > 2 / grid} <= drawn


def _native() -> Any:
    kernels = distributions.cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels do not build here")
    return kernels


def _peaked(vocab: int, seed: int) -> torch.Tensor:
    """A few likely tokens and a vocabulary far below them (> 2^-24 of the top weight: the kernel's floor)."""
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) - 40.0
    logits[[3, 777, 1500, 4999]] = torch.tensor([2.0, 1.5, 0.0, -1.0])
    return logits


@pytest.mark.parametrize(("k", "p"), [(0, 0.9), (50, 1.0), (50, 0.9), (3, 1.0), (3000, 0.95), (0, 1e-9), (0, 0.999999)])
@pytest.mark.parametrize("row", ["random-8", "random-1", "flat", "peaked"])
def test_the_kernels_cut_keeps_exactly_what_a_full_sort_keeps(row: str, k: int, p: float) -> None:
    """The histogram cut against a full sort, on rows whose cut lands among likely tokens, on a flat row
    (every token in one bucket) and on a peaked row where top-k reaches the tokens below the floor."""
    vocab = 5000
    logits = {"random-8": torch.randn(vocab, generator=torch.Generator().manual_seed(k)) * 8,
              "random-1": torch.randn(vocab, generator=torch.Generator().manual_seed(k + 1)),
              "flat": torch.zeros(vocab), "peaked": _peaked(vocab, k)}[row]
    weights = _native().sample_weights(logits.contiguous(), 1.0, k, p, 0.0)
    kept = set(torch.nonzero(weights > 0).squeeze(1).tolist())
    k_eff = k if 0 < k < vocab else vocab
    reference = _reference_cut(logits, k_eff, p)
    # A token whose preceding mass is within rounding of p (float32 weights here, float64 there) may fall
    # either side of a top-p cut; top-k alone is exact.
    slack = 1 if p < 1.0 else 0
    if row == "flat":  # equal weights: the kernel keeps the lowest ids, a sort any of them
        assert abs(len(kept) - len(reference)) <= slack and max(kept) < len(kept)
    else:  # peaked top-k 50: the cut is among weights ~e^-40, below the kernel's floor (its re-binning)
        assert len(kept ^ reference) <= slack


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=5),
                                    SamplingParams(temperature=1.0, top_p=0.8)])
def test_nan_logits_never_crash_the_kernel_or_get_drawn(params: SamplingParams) -> None:
    _native()
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(2))
    logits[0, ::7] = float("nan")
    uniforms = torch.rand(200, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tokens = sample_tokens(logits.expand(200, -1).contiguous(), [Request("r", [1], params)] * 200, uniforms)
    assert all(t % 7 != 0 for t in tokens.tolist())
