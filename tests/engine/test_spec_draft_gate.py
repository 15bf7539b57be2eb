"""The draft model's confidence gate and its own weight format, on tiny random models, fp32: guesses
dropped mid-proposal leave the tokens exactly those without speculation and the draft in step; a
dropped guess ends its request's forwards; --draft-quantization reaches the draft alone."""

from __future__ import annotations

import random

import pytest

from tests.engine.test_speculative import _assert_greedy_identical, spec_core
from tests.engine.tiny import ARCH_NAMES, ArchName, greedy, random_prompts, tiny_model
from tokenmill.config import ModelConfig, SpeculativeConfig
from tokenmill.engine.request import Request
from tokenmill.engine.spec.draft import DraftModelProposer


class _RandomGate:
    """Keeps each guess with probability `p` (seeded). One per step, as the controller's; `totals`
    (shared by a test's gates) adds up what all of them were asked."""

    def __init__(self, rng: random.Random, p: float, totals: dict[str, list[float]]) -> None:
        self.rng, self.p, self.totals = rng, p, totals
        self.dropped = 0

    def keep(self, request_id: str, confidence: float) -> bool:
        self.totals["confidences"].append(confidence)
        keep = self.rng.random() < self.p
        self.totals["kept" if keep else "dropped"].append(1)
        self.dropped += not keep
        return keep


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_draft_greedy_is_token_identical_when_a_gate_cuts_proposals_short(arch: ArchName,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The adaptive controller's gate ends a request's proposal at a guess it drops (the guess is
    popped from the draft's sequence before any KV is computed for it): with guesses dropped at
    random, the tokens are still exactly those without speculation, and the draft stays in step."""
    from tokenmill.engine.spec.controller import SpecController

    rng, totals = random.Random(7), {"confidences": [], "kept": [], "dropped": []}
    monkeypatch.setattr(SpecController, "gate", lambda self, n: _RandomGate(rng, 0.6, totals))
    core = spec_core(tiny_model(arch), "draft", arch, k=4, adaptive=True)
    gated, step = [], core.step

    def counting_step():  # type: ignore[no-untyped-def]
        result = step()
        gated.append(result.stats.spec_num_gated_tokens)
        return result

    core.step = counting_step  # type: ignore[method-assign]
    _, accepted = _assert_greedy_identical(core, arch)
    assert totals["kept"] and totals["dropped"] and accepted > 0
    assert sum(gated) == len(totals["dropped"])  # the step stats (tokenmill:spec_decode_num_gated_tokens) count them
    assert all(0.0 < c <= 1.0 for c in totals["confidences"])


def test_the_draft_runs_on_its_own_quantization() -> None:
    """--draft-quantization q8: the draft's matrices are packed q8 blocks on the integer kernels while
    the target stays dense (the draft only guesses: its rounding moves speed, never the tokens). By
    default a draft is q4, except next to a target on the float reference path ("none")."""
    from dataclasses import replace

    from tokenmill.engine.spec.speculator import build_speculator
    from tokenmill.layers.linear import DenseLinear, QuantLinear

    target, draft = tiny_model("llama"), tiny_model("qwen2")
    config = SpeculativeConfig("draft", 3, draft_model="tiny-draft", draft_quantization="q8")
    dense = ModelConfig("tiny", dtype="float32", device="cpu", quantization="none")
    weights = (draft.arch, draft.state_dict)
    speculator = build_speculator(config, dense, target.arch, 4, 64, 256, weights)
    assert speculator is not None and isinstance(speculator.proposer, DraftModelProposer)
    linears = speculator.proposer.runner.model.linears()
    assert all(isinstance(lin, QuantLinear) and lin.method == "q8" for lin in linears.values())
    plain = build_speculator(replace(config, draft_quantization=None), dense, target.arch, 4, 64, 256, weights)
    assert plain is not None and isinstance(plain.proposer, DraftModelProposer)
    assert all(isinstance(lin, DenseLinear) for lin in plain.proposer.runner.model.linears().values())
    auto = build_speculator(replace(config, draft_quantization=None), replace(dense, quantization="auto"),
                            target.arch, 4, 64, 256, weights)
    assert auto is not None and isinstance(auto.proposer, DraftModelProposer)
    assert {lin.method for lin in auto.proposer.runner.model.linears().values()} == {"q4"}


def test_a_dropped_guess_ends_the_proposal_and_its_forwards() -> None:
    """A gate that keeps only the first guess: proposals of one token, after two forwards (the
    second drafted the dropped guess); one that keeps nothing: no proposal, one forward."""
    model = tiny_model("llama")
    core = spec_core(model, "draft", "llama", k=4)
    proposer = core.speculator.proposer  # type: ignore[union-attr]
    assert isinstance(proposer, DraftModelProposer)
    request = Request("a", random_prompts((9,), seed=3)[0], greedy(8))

    class FirstOnly:
        def __init__(self) -> None:
            self.seen: dict[str, int] = {}

        def keep(self, request_id: str, confidence: float) -> bool:
            self.seen[request_id] = self.seen.get(request_id, 0) + 1
            return self.seen[request_id] == 1

    def forwards() -> int:
        return len(proposer.last_decode_forward_s) + len(proposer.last_catch_ups)

    [one] = proposer.propose([request], [4], FirstOnly())
    assert len(one) == 1 and forwards() == 2
    # The first forward read the 9-token prompt: a catch-up (8 tokens beyond one), priced apart.
    assert len(proposer.last_decode_forward_s) == 1 and [e for e, _ in proposer.last_catch_ups] == [8]
    assert proposer.catch_up_tokens([request]) == [0]  # in step: it proposed at the request's length
    request.token_ids.extend([1, 2, 3])
    assert proposer.catch_up_tokens([request, Request("new", [1, 2], greedy(2))]) == [3, 0]
    del request.token_ids[-3:]
    [full] = proposer.propose([request], [4])
    assert full[:1] == one and len(full) == 4 and forwards() == 4
    assert len(proposer.last_decode_forward_s) == 4  # a one-token catch-up, then three guesses

    class Never:
        def keep(self, request_id: str, confidence: float) -> bool:
            return False

    assert proposer.propose([request], [4], Never()) == [[]] and forwards() == 1
    assert proposer.propose([request], [4]) == [full]  # its KV is still in step with the request


@pytest.mark.parametrize("arch", ARCH_NAMES)
@pytest.mark.parametrize("adaptive", [False, True])
def test_lookup_then_draft_is_token_identical(arch: ArchName, adaptive: bool) -> None:
    """`ngram-draft`: the repetitive prompts take lookups, the random ones the draft (the same model,
    so its guesses are right), a request switching between them catches the draft up; the tokens are
    exactly those without speculation, nothing leaks, and both kinds of proposal were accepted."""
    core = spec_core(tiny_model(arch), "ngram-draft", arch, k=4, adaptive=adaptive)
    calls: dict[str, int] = {"lookup": 0, "draft": 0}
    hybrid = core.speculator.proposer  # type: ignore[union-attr]
    propose = hybrid.draft.propose

    def counting(requests, num_tokens, gate=None):  # type: ignore[no-untyped-def]
        calls["draft"] += len(requests)
        return propose(requests, num_tokens, gate)

    hybrid.draft.propose = counting
    buckets = hybrid.buckets

    def counting_buckets(requests):  # type: ignore[no-untyped-def]
        out = buckets(requests)
        calls["lookup"] += sum(b is not None for b in out)
        return out

    hybrid.buckets = counting_buckets
    _, accepted = _assert_greedy_identical(core, arch)
    assert accepted > 0 and calls["lookup"] > 0 and calls["draft"] > 0
