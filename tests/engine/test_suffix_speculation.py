"""`--speculative suffix` in the engine: outputs of finished requests make the guesses of later ones,
and the tokens stay exactly those of the engine without speculation."""

from __future__ import annotations

import random

import pytest

from tests.engine.test_engine_invariants import run_random_requests_with_aborts
from tests.engine.test_speculative import PARAMS, PROMPTS, _run_counting, plain, spec_core
from tests.engine.tiny import ARCH_NAMES, ArchName, assert_all_free, greedy, random_prompts, tiny_model
from tokenmill.engine.spec.suffix import SuffixProposer


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_suffix_greedy_is_token_identical(arch: ArchName) -> None:
    core = spec_core(tiny_model(arch), "suffix")
    outputs, drafts, _ = _run_counting(core, PROMPTS, PARAMS)
    assert [tuple(o) for o in outputs] == list(plain(arch))
    assert drafts > 0
    assert_all_free(core)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_later_request_draws_on_an_earlier_ones_output(method: str) -> None:
    """The same random prompt twice, one after the other: its own context repeats nothing the output
    will say, so prompt lookup finds little; the cache holds the first answer, which the second repeats."""
    model = tiny_model("llama")
    prompt = random_prompts([12], seed=77)[0]
    core = spec_core(model, method, k=4)  # every decoding request proposes up to 4
    first, _, _ = _run_counting(core, [prompt], [greedy(24)])
    second, drafts, accepted = _run_counting(core, [prompt], [greedy(24)])
    assert second == first
    if method == "suffix":  # 23 tokens after the first in 5 steps of 4 guesses + 1, from the first decode
        assert (drafts, accepted) == (5, 18)  # on (the prompt's end is the cached answer's lead-in)
    else:
        assert accepted <= 2
    assert_all_free(core)


def test_no_block_leak_and_a_bounded_cache_after_random_requests_with_aborts() -> None:
    core = spec_core(tiny_model("qwen2"), "suffix", num_blocks=48, adaptive=True)
    assert core.speculator is not None
    proposer = core.speculator.proposer
    assert isinstance(proposer, SuffixProposer)
    proposer.cache.max_tokens = 200
    aborted, finished = run_random_requests_with_aborts(core, random.Random(9), 400,
                                                        lambda rng: greedy(rng.randrange(1, 20)),
                                                        salts=(None, "tenant-a", "tenant-b"))
    assert aborted > 20 and finished > 300
    assert_all_free(core)
    assert 0 < proposer.cache.num_tokens <= 200
    assert core.stats().spec_cached_tokens == proposer.cache.num_tokens  # the metrics' gauge
    assert not proposer._live and not proposer._choices  # nothing kept of finished requests


def test_suffix_draft_is_token_identical_and_guesses_from_earlier_outputs() -> None:
    """`suffix-draft` with another random model as the draft (its guesses are mostly wrong): the tokens
    are exactly plain decoding's, and a repeated prompt's answer comes from the cache, not the draft."""
    core = spec_core(tiny_model("llama"), "suffix-draft", "qwen2", k=4)
    outputs, drafts, _ = _run_counting(core, PROMPTS, PARAMS)
    assert [tuple(o) for o in outputs] == list(plain("llama")) and drafts > 0
    prompt = random_prompts([12], seed=77)[0]
    first, _, first_accepted = _run_counting(core, [prompt], [greedy(24)])
    second, _, accepted = _run_counting(core, [prompt], [greedy(24)])
    assert second == first
    assert first_accepted <= 4 and accepted >= 16
    assert_all_free(core)


def test_suffix_draft_leaks_no_block_of_either_pool_after_random_requests_with_aborts() -> None:
    core = spec_core(tiny_model("llama"), "suffix-draft", "qwen2", num_blocks=48, adaptive=True)
    aborted, finished = run_random_requests_with_aborts(core, random.Random(4), 300,
                                                        lambda rng: greedy(rng.randrange(1, 20)),
                                                        salts=(None, "tenant-a"))
    assert aborted > 20 and finished > 200
    assert_all_free(core)
    assert core.speculator is not None
    draft = core.speculator.proposer.draft  # type: ignore[attr-defined]
    assert draft.kv.block_tables == {} and draft.kv.pool.num_free == draft.kv.num_blocks
