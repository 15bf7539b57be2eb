"""engine/distributions.py: the top-k/top-p cut without a full sort, and inverse-CDF draws."""

from __future__ import annotations

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
