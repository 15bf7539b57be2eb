"""Sampler.verify: greedy acceptance, penalties and min_tokens over proposals, and rejection
sampling that preserves the target distribution (chi-square, fixed seeds, small vocabularies)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from tokenmill.engine.distributions import filtered_probs
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.engine.sampler import Sampler

V = 6


def _request(rid: str = "r", eos: tuple[int, ...] = (), **params: object) -> Request:
    return Request(rid, [0, 1], SamplingParams(max_tokens=None, **params), eos)  # type: ignore[arg-type]


def _rows(*argmaxes: int) -> torch.Tensor:
    """One logit row per argument, peaked at that token."""
    logits = torch.zeros(len(argmaxes), V)
    for row, token in enumerate(argmaxes):
        logits[row, token] = 5.0
    return logits


def test_greedy_accepts_while_the_proposal_is_the_argmax_then_emits_the_argmax() -> None:
    sampler = Sampler(torch.device("cpu"), 0)
    r = _request(temperature=0.0)
    [(tokens, _)] = sampler.verify(_rows(3, 4, 1, 2), [r], [[3, 4, 5]])
    assert tokens == [3, 4, 1]
    [(tokens, _)] = sampler.verify(_rows(3, 4, 5, 2), [r], [[3, 4, 5]])
    assert tokens == [3, 4, 5, 2]  # all accepted: the bonus token
    [(tokens, _)] = sampler.verify(_rows(0, 4, 5, 2), [r], [[3, 4, 5]])
    assert tokens == [0]


def test_requests_of_a_batch_are_verified_independently() -> None:
    sampler = Sampler(torch.device("cpu"), 0)
    rs = [_request("a", temperature=0.0), _request("b", temperature=0.0), _request("c", temperature=0.0)]
    logits = torch.cat([_rows(1, 2), _rows(5), _rows(3, 3, 3)])
    out = sampler.verify(logits, rs, [[1], [], [3, 4]])
    assert [tokens for tokens, _ in out] == [[1, 2], [5], [3, 3]]


def test_penalties_count_the_proposals_before_each_row() -> None:
    sampler = Sampler(torch.device("cpu"), 0)
    logits = torch.zeros(2, V)
    logits[:, 2], logits[:, 3] = 1.0, 0.9
    r = _request(temperature=0.0, repetition_penalty=2.0)
    [(tokens, _)] = sampler.verify(logits, [r], [[2]])
    # Row 0: 2 is unseen, so 2 is the argmax and the proposal is accepted; row 1 has seen 2: 0.5 < 0.9.
    assert tokens == [2, 3]


def test_min_tokens_counts_the_proposals_before_each_row() -> None:
    sampler = Sampler(torch.device("cpu"), 0)
    r = _request(eos=(4,), temperature=0.0, min_tokens=2)  # no output yet
    [(tokens, _)] = sampler.verify(_rows(4, 4, 4), [r], [[1, 4]])
    # Rows 0 and 1 are outputs 1 and 2: EOS banned there, so the proposal 1 is not the argmax.
    assert tokens[0] != 4 and tokens[0] != 1
    [(tokens, _)] = sampler.verify(_rows(1, 4, 4), [r], [[1, 4]])
    assert tokens[:1] == [1] and tokens[1] != 4  # row 1 still bans EOS
    logits = _rows(1, 2, 4)
    [(tokens, _)] = sampler.verify(logits, [r], [[1, 2]])
    assert tokens == [1, 2, 4]  # row 2 is output 3: EOS allowed


def test_logprobs_are_the_targets_raw_logprobs_of_each_emitted_token() -> None:
    sampler = Sampler(torch.device("cpu"), 0)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    r = _request(temperature=0.0, logprobs=2)
    [(tokens, logprobs)] = sampler.verify(logits, [r], [[int(logits[0].argmax()), 5]])
    expected = torch.log_softmax(logits, dim=-1)
    assert len(logprobs) == len(tokens) >= 1
    for row, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        assert lp is not None and lp.token_id == token
        assert lp.logprob == pytest.approx(float(expected[row, token]), abs=1e-5)
        assert len(lp.top) == 2


def _draws(logits: torch.Tensor, drafts: list[int], n: int, q: torch.Tensor | None = None,
           **params: object) -> list[list[int]]:
    """n independent verifications of the same rows (one request each, in batches)."""
    sampler = Sampler(torch.device("cpu"), 1234)
    out: list[list[int]] = []
    batch = 500
    for start in range(0, n, batch):
        rs = [_request(f"r{start + i}", **params) for i in range(batch)]  # type: ignore[arg-type]
        qs: list[torch.Tensor | None] | None = None if q is None else [q] * batch
        draft_lists = [list(drafts)] * batch if q is None else [_sample_q(q, i + start) for i in range(batch)]
        verified = sampler.verify(logits.repeat(batch, 1), rs, draft_lists, qs)
        out.extend(tokens for tokens, _ in verified)
    return out


def _sample_q(q: torch.Tensor, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(10_000 + seed)
    return [int(torch.multinomial(q[j], 1, generator=g)) for j in range(q.shape[0])]


def _assert_distributed_as(samples: list[int], p: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(samples), minlength=len(p)).double()
    support = p > 0
    assert counts[~support].sum() == 0, f"tokens outside the target's support: {counts}"
    expected = p[support].double() / p[support].double().sum() * len(samples)
    result = chisquare(counts[support].numpy(), expected.numpy())
    assert result.pvalue > 1e-3, f"counts {counts.tolist()} vs expected {(p * len(samples)).tolist()}"


TARGET = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0],
                       [0.0, 1.5, 0.3, 1.0, -0.2, 0.4],
                       [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]])


@pytest.mark.parametrize("drafts", [[0, 1], [3, 3], [5, 0]], ids=["likely", "mid", "unlikely"])
def test_point_mass_rejection_sampling_preserves_the_target_distribution(drafts: list[int]) -> None:
    draws = _draws(TARGET, drafts, 4000, temperature=1.0)
    p = torch.softmax(TARGET, dim=-1)
    _assert_distributed_as([d[0] for d in draws], p[0])
    # Given the first proposal was accepted, the second token is distributed as p_1.
    _assert_distributed_as([d[1] for d in draws if d[0] == drafts[0]], p[1])


def test_rejection_sampling_with_a_mismatched_draft_distribution_preserves_the_target() -> None:
    q = torch.softmax(torch.tensor([[-1.0, 0.0, 2.0, 1.0, 0.0, 0.5], [1.0, -1.0, 0.0, 2.0, 0.0, 0.0]]), dim=-1)
    draws = _draws(TARGET, [], 4000, q=q, temperature=1.0)
    p = torch.softmax(TARGET, dim=-1)
    _assert_distributed_as([d[0] for d in draws], p[0])
    firsts = torch.tensor([d[0] for d in draws])
    assert 0.5 < float((firsts == 0).double().mean()) < 0.58  # p0(0) = 0.54, q0(0) = 0.03


def test_temperature_top_k_and_min_p_shape_the_target_that_is_preserved() -> None:
    draws = _draws(TARGET, [4, 1], 4000, temperature=0.7, top_k=4, min_p=0.05)
    p = filtered_probs(TARGET, [_request(temperature=0.7, top_k=4, min_p=0.05)] * 3)
    _assert_distributed_as([d[0] for d in draws], p[0])
    assert p[0, 4] == 0 and p[0, 5] == 0  # the draft's 4 is outside top-k: always rejected


def test_a_seeded_request_verifies_the_same_way_whatever_shares_its_batch() -> None:
    def run(others: int) -> list[int]:
        sampler = Sampler(torch.device("cpu"), others)
        rs = [_request("seeded", temperature=1.0, seed=7)] + [_request(f"o{i}", temperature=1.0) for i in range(others)]
        logits = TARGET.repeat(1 + others, 1)
        return sampler.verify(logits, rs, [[3, 3]] * (1 + others))[0][0]

    assert run(0) == run(3) == run(5)
