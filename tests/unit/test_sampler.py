"""Sampler math against hand-computed values and known distributions.

Every test is deterministic: unseeded rows draw from the sampler's own seeded generator.
"""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.engine.request import Request, SamplingParams
from tokenmill.engine.sampler import Sampler

CPU = torch.device("cpu")


def _req(rid: str, params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None,
         eos: tuple[int, ...] = ()) -> Request:
    r = Request(rid, list(prompt or [0]), params, eos)
    r.token_ids.extend(output or [])
    return r


def _tokens(sampler: Sampler, logits: torch.Tensor, requests: list[Request]) -> list[int]:
    return [token for token, _ in sampler(logits, requests)]


def _frequencies(probs: list[float], params: SamplingParams, n: int = 8000) -> list[float]:
    """Sample n independent rows of the same distribution; the empirical frequency of each token."""
    logits = torch.tensor(probs).log().expand(n, -1).contiguous()
    requests = [_req(str(i), params) for i in range(n)]
    counts = torch.bincount(torch.tensor(_tokens(Sampler(CPU, 0), logits, requests)), minlength=len(probs))
    return (counts.float() / n).tolist()


def _random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# ---- greedy and truncation ---------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = _random_logits(16, 100, 0)
    requests = [_req(str(i), SamplingParams(temperature=0.0)) for i in range(16)]
    assert _tokens(Sampler(CPU, 0), logits, requests) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.1, 1.0, 10.0, 1000.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature: float) -> None:
    logits = _random_logits(64, 100, 1)
    requests = [_req(str(i), SamplingParams(temperature=temperature, top_k=1)) for i in range(64)]
    assert _tokens(Sampler(CPU, 0), logits, requests) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 100.0])
def test_tiny_top_p_keeps_only_the_top_token(temperature: float) -> None:
    logits = _random_logits(64, 100, 2)
    requests = [_req(str(i), SamplingParams(temperature=temperature, top_p=1e-6)) for i in range(64)]
    assert _tokens(Sampler(CPU, 0), logits, requests) == logits.argmax(-1).tolist()


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability() -> None:
    # threshold = 0.5 × 0.5 = 0.25: only tokens 0 and 1 survive, renormalised to 5/8 and 3/8.
    freqs = _frequencies([0.5, 0.3, 0.15, 0.05], SamplingParams(min_p=0.5))
    assert freqs[2] == 0.0 and freqs[3] == 0.0
    assert freqs[0] == pytest.approx(0.625, abs=0.03)
    assert freqs[1] == pytest.approx(0.375, abs=0.03)


def test_min_p_one_keeps_only_the_top_token() -> None:
    logits = _random_logits(32, 50, 3)
    requests = [_req(str(i), SamplingParams(min_p=1.0)) for i in range(32)]
    assert _tokens(Sampler(CPU, 0), logits, requests) == logits.argmax(-1).tolist()


# ---- distributions ---------------------------------------------------------------------------


PROBS = [0.1, 0.2, 0.3, 0.4]


def _normalised(weights: list[float]) -> list[float]:
    return [w / sum(weights) for w in weights]


@pytest.mark.parametrize(("params", "expected"), [
    (SamplingParams(), PROBS),
    (SamplingParams(temperature=0.5), _normalised([p**2 for p in PROBS])),
    (SamplingParams(temperature=2.0), _normalised([p**0.5 for p in PROBS])),
    (SamplingParams(top_k=2), [0.0, 0.0, 3 / 7, 4 / 7]),
    (SamplingParams(top_p=0.45), [0.0, 0.0, 3 / 7, 4 / 7]),  # 0.4 < 0.45: one more token needed
    (SamplingParams(top_p=0.8), [0.0, 2 / 9, 3 / 9, 4 / 9]),
], ids=["plain", "t0.5", "t2", "top_k2", "top_p0.45", "top_p0.8"])
def test_sampled_frequencies_match_the_distribution(params: SamplingParams, expected: list[float]) -> None:
    # 8000 draws: one standard error is at most 0.0056, so 0.025 is > 4 sigma.
    freqs = _frequencies(PROBS, params)
    for freq, p in zip(freqs, expected, strict=True):
        if p == 0.0:
            assert freq == 0.0
        else:
            assert freq == pytest.approx(p, abs=0.025)


# ---- penalties --------------------------------------------------------------------------------


def test_penalties_follow_the_formulas() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0], [2.0, -1.0, 0.5, -0.5, 3.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    penalised = _req("p", params, prompt=[0, 1], output=[1, 2, 2])
    plain = _req("q", SamplingParams(temperature=0.0), prompt=[0, 1], output=[1, 2, 2])
    out = Sampler(CPU, 0)._apply_penalties(logits.clone(), [penalised, plain])
    # repetition (prompt + output ids 0, 1, 2): positive / 2, negative × 2 → 1.0, -2.0, 0.25
    # frequency × count and presence × [count > 0] over output ids only: 1 once, 2 twice
    expected = [
        2.0 / 2,  # prompt only: repetition, no presence/frequency
        -1.0 * 2 - 0.25 * 1 - 0.5,
        0.5 / 2 - 0.25 * 2 - 0.5,
        -0.5,  # never seen
        3.0,
    ]
    assert out[0].tolist() == pytest.approx(expected)
    assert out[1].tolist() == logits[1].tolist()


def test_repetition_penalty_below_one_boosts_seen_tokens() -> None:
    logits = torch.tensor([[1.0, -2.0, 0.0]])
    r = _req("r", SamplingParams(repetition_penalty=0.5), prompt=[0, 1, 2])
    out = Sampler(CPU, 0)._apply_penalties(logits.clone(), [r])
    assert out[0].tolist() == pytest.approx([2.0, -1.0, 0.0])


def test_penalties_change_the_greedy_choice_but_not_the_reported_logprob() -> None:
    logits = torch.tensor([[1.0, 0.9, -5.0]])
    r = _req("r", SamplingParams(temperature=0.0, presence_penalty=0.2, logprobs=1), prompt=[2], output=[0])
    [(token, lp)] = Sampler(CPU, 0)(logits, [r])
    assert token == 1
    assert lp is not None
    assert lp.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())
    assert lp.rank == 2


def test_frequency_penalty_grows_with_the_count() -> None:
    logits = torch.tensor([[1.0, 0.0]])
    once = _req("a", SamplingParams(temperature=0.0, frequency_penalty=0.6), output=[0])
    twice = _req("b", SamplingParams(temperature=0.0, frequency_penalty=0.6), output=[0, 0])
    assert _tokens(Sampler(CPU, 0), logits.repeat(2, 1), [once, twice]) == [0, 1]


# ---- min_tokens ----------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_token_ids() -> None:
    logits = torch.tensor([[0.0, 0.0, 10.0, 9.0, 1.0]])  # EOS (2) on top, then stop id 3
    sampler = Sampler(CPU, 0)
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    assert _tokens(sampler, logits, [_req("a", params, eos=(2,))]) == [4]
    assert _tokens(sampler, logits, [_req("b", params, output=[4], eos=(2,))]) == [4]
    assert _tokens(sampler, logits, [_req("c", params, output=[4, 4], eos=(2,))]) == [2]


def test_min_tokens_masks_eos_when_sampling() -> None:
    logits = torch.tensor([[0.0, 0.0, 5.0, 0.0]]).expand(500, -1).contiguous()
    requests = [_req(str(i), SamplingParams(min_tokens=1), eos=(2,)) for i in range(500)]
    assert 2 not in _tokens(Sampler(CPU, 0), logits, requests)


def test_ignore_eos_leaves_eos_sampleable() -> None:
    logits = torch.tensor([[0.0, 0.0, 10.0]])
    r = _req("r", SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True), eos=(2,))
    assert _tokens(Sampler(CPU, 0), logits, [r]) == [2]


# ---- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_logits_with_rank_and_sorted_top_n() -> None:
    logits = _random_logits(3, 40, 4)
    requests = [
        _req("greedy", SamplingParams(temperature=0.0, logprobs=5)),
        _req("hot", SamplingParams(temperature=3.0, logprobs=0)),
        _req("none", SamplingParams(temperature=0.0)),
    ]
    results = Sampler(CPU, 0)(logits, requests)
    logp = torch.log_softmax(logits, -1)
    for row in (0, 1):
        token, lp = results[row]
        assert lp is not None and lp.token_id == token
        assert lp.logprob == pytest.approx(logp[row, token].item(), abs=1e-6)
        assert lp.rank == 1 + int((logp[row] > logp[row, token]).sum())
    _, lp0 = results[0]
    assert lp0 is not None and lp0.rank == 1
    top_vals, top_ids = logp[0].topk(5)
    assert [t for t, _ in lp0.top] == top_ids.tolist()
    assert [v for _, v in lp0.top] == pytest.approx(top_vals.tolist())
    assert all(a[1] >= b[1] for a, b in zip(lp0.top, lp0.top[1:], strict=False))
    _, lp1 = results[1]
    assert lp1 is not None and lp1.top == []
    assert results[2][1] is None


def test_logprobs_are_not_tempered() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    r = _req("r", SamplingParams(temperature=0.25, top_k=1, logprobs=2))
    [(token, lp)] = Sampler(CPU, 0)(logits, [r])
    assert token == 0 and lp is not None
    expected = 2.0 - math.log(math.exp(2.0) + math.exp(1.0) + 1.0)
    assert lp.logprob == pytest.approx(expected, abs=1e-6)


# ---- seeds ----------------------------------------------------------------------------------


def _run_seeded(sampler: Sampler, target: Request, others: list[Request], steps: int, position: int) -> list[int]:
    """Sample `steps` tokens for `target` placed at `position` among `others`; every row sees its own logits."""
    tokens = []
    for step in range(steps):
        batch = [*others[:position], target, *others[position:]]
        logits = torch.stack([_random_logits(1, 64, 1000 * step + sum(map(ord, r.request_id)))[0] for r in batch])
        results = sampler(logits, batch)
        for r, (token, _) in zip(batch, results, strict=True):
            r.token_ids.append(token)
        tokens.append(results[position][0])
    return tokens


def test_seeded_request_samples_the_same_alone_or_in_a_batch() -> None:
    params = SamplingParams(temperature=1.5, top_p=0.9, seed=1234)
    alone = _run_seeded(Sampler(CPU, 0), _req("x", params), [], 8, 0)
    others = [
        _req("u1", SamplingParams(temperature=1.0)),
        _req("g", SamplingParams(temperature=0.0)),
        _req("s2", SamplingParams(temperature=0.7, seed=99)),
        _req("u2", SamplingParams(temperature=2.0, top_k=5)),
    ]
    batched = _run_seeded(Sampler(CPU, 7), _req("x", params), others, 8, 2)
    assert batched == alone
    assert len(set(alone)) > 1  # it really sampled


def test_different_seeds_give_different_streams() -> None:
    a = _run_seeded(Sampler(CPU, 0), _req("x", SamplingParams(seed=1)), [], 8, 0)
    b = _run_seeded(Sampler(CPU, 0), _req("x", SamplingParams(seed=2)), [], 8, 0)
    assert a != b


def test_forget_restarts_a_seeded_stream() -> None:
    sampler = Sampler(CPU, 0)
    logits = _random_logits(1, 64, 5)
    params = SamplingParams(temperature=1.0, seed=5)
    first = [_tokens(sampler, logits, [_req("x", params)])[0] for _ in range(6)]
    sampler.forget("x")
    again = [_tokens(sampler, logits, [_req("x", params)])[0] for _ in range(6)]
    assert first == again
