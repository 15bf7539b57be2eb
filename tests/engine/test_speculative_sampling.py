"""Speculative sampling is exact in distribution, on tiny random models (fp32): with a mismatched
draft, with the draft's own sampled guesses (and their q, cut heads included), the generated tokens
follow the target's distribution (chi-square), and guesses are accepted at the rate the rule predicts.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from tests.engine.test_speculative import _run_counting, spec_core
from tests.engine.tiny import VOCAB_SIZE, TinyModel, tiny_model
from tokenmill.engine.request import SamplingParams


def _target_distribution(model: TinyModel, prompt: list[int], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """p(t1) and the marginal p(t2) = sum_x p(x) p(t2 | x), from transformers."""
    with torch.no_grad():
        p1 = torch.softmax(model.hf(torch.tensor([prompt])).logits[0, -1] / temperature, dim=-1)
        seqs = torch.tensor([[*prompt, x] for x in range(VOCAB_SIZE)])
        p2_given = torch.softmax(model.hf(seqs).logits[:, -1] / temperature, dim=-1)
    return p1.double(), (p1.double()[:, None] * p2_given.double()).sum(0)


def _chi_square_p(samples: list[int], p: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=VOCAB_SIZE).double()
    expected = p * len(samples)
    # Pool the rare tokens into one cell so every expected count is >= 5.
    order = torch.argsort(expected, descending=True)
    big = order[expected[order] >= 5]
    rest = order[expected[order] < 5]
    obs = torch.cat([counts[big], counts[rest].sum(0, keepdim=True)])
    exp = torch.cat([expected[big], expected[rest].sum(0, keepdim=True)])
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


def test_sampling_with_a_mismatched_draft_follows_the_target_distribution() -> None:
    target, prompt, temperature = tiny_model("llama"), [17, 4, 250, 9, 33], 0.4
    _, p2 = _target_distribution(target, prompt, temperature)
    # The draft proposes the target's own argmax (a point mass: draft_sampling off) while the target
    # samples at temperature 0.4: a forced mismatch, with proposals likely enough that a wrong
    # acceptance rule shifts the counts visibly (doubling the acceptance probability fails this test).
    core = spec_core(target, "draft", "llama", k=2, draft_sampling=False)
    params = SamplingParams(max_tokens=3, temperature=temperature)
    n = 3000
    outputs, drafts, accepted = _run_counting(core, [prompt] * n, [params] * n)
    assert drafts >= n * 0.9  # nearly every request verified a draft for tokens 2 and 3
    second = [o[1] for o in outputs]
    assert _chi_square_p(second, p2) > 1e-3
    assert 0 < accepted < drafts


@pytest.mark.parametrize("draft_vocab", [None, 160])
def test_sampled_drafts_from_another_model_follow_the_target_distribution(draft_vocab: int | None) -> None:
    """The draft (another architecture's tiny model, same vocabulary) draws its guesses from its own
    distribution at the request's temperature, and verification gets that q: the first and second
    tokens follow the target's distribution, and guesses are accepted often but not always. With a cut
    head (draft_vocab 160 of 300 ids) q is the draft's distribution over the kept ids, 0 past them."""
    target, prompt, temperature = tiny_model("llama"), [17, 4, 250, 9, 33], 1.0
    p1, p2 = _target_distribution(target, prompt, temperature)
    core = spec_core(target, "draft", "qwen2", k=2, draft_vocab=draft_vocab)
    params = SamplingParams(max_tokens=3, temperature=temperature)
    n = 3000
    outputs, drafts, accepted = _run_counting(core, [prompt] * n, [params] * n)
    assert drafts >= n * 0.9
    assert _chi_square_p([o[0] for o in outputs], p1) > 1e-3
    assert _chi_square_p([o[1] for o in outputs], p2) > 1e-3
    # Each request verifies one guess, for token 2 (max_tokens 3): accepted with probability
    # sum_x min(p, q)(x | prompt, t1), t1 ~ p1, where a point-mass rule gives sum_x p q (x | ...).
    draft = tiny_model("qwen2")
    with torch.no_grad():
        seqs = torch.tensor([[*prompt, x] for x in range(VOCAB_SIZE)])
        p_next = torch.softmax(target.hf(seqs).logits[:, -1].double() / temperature, dim=-1)
        q_logits = draft.hf(seqs).logits[:, -1].double() / temperature
        if draft_vocab is not None:
            q_logits[:, draft_vocab:] = float("-inf")
        q_next = torch.softmax(q_logits, dim=-1)
    expected = float((p1 * torch.minimum(p_next, q_next).sum(-1)).sum())
    point_mass = float((p1 * (p_next * q_next).sum(-1)).sum())
    sigma = (expected * (1 - expected) / drafts) ** 0.5
    assert abs(expected - point_mass) > 8 * sigma  # the two rules are told apart
    assert abs(accepted / drafts - expected) < 4 * sigma, (accepted / drafts, expected, point_mass)
