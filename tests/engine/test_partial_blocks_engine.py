"""Partial-block reuse in the engine: a next turn (the previous prompt and answer, then new tokens) reports
every token the previous request computed as cached, and its greedy answer is the one an engine without
prefix caching gives, on three architectures, fp32 and int8 KV caches, synchronous and asynchronous
scheduling; beam search steps compute about one token a beam; no block leaks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.server.conftest import flattened_copy
from tokenmill import LLM, SamplingParams
from tokenmill.engine.beam_search import BeamSearchParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def flat(tiny_hf_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The tiny models with flatter logits (tests/server/conftest.py): a wrong KV row shows in the logprobs."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = flattened_copy(tiny_hf_dir(arch), tmp_path_factory.mktemp("flat") / arch)
        return made[arch]

    return get


def _llm(path: Path, **kwargs: object) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=96, block_size=16, max_model_len=256,
               **kwargs)  # type: ignore[arg-type]


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize(("kv", "scheduling"), [("auto", "auto"), ("int8", "auto"), ("auto", "on")])
def test_a_next_turn_reuses_every_computed_token_and_answers_the_same(flat: Callable[[str], Path], arch: str,
                                                                      kv: str, scheduling: str) -> None:
    llm = _llm(flat(arch), kv_cache_dtype=kv, async_scheduling=scheduling)
    reference = _llm(flat(arch), kv_cache_dtype=kv, enable_prefix_caching=False)
    prompt = _prompt(llm.core.arch.vocab_size, 21, seed=1)
    (first,) = llm.generate([prompt], GREEDY)
    turn = [*prompt, *first.outputs[0].token_ids, 5, 6, 7]  # 21 + 6 + 3: the partial block holds 10 rows
    (second,) = llm.generate([turn], GREEDY)
    assert second.num_cached_tokens == len(prompt) + 6 - 1  # all but the last answer token, never computed
    (expected,) = reference.generate([turn], GREEDY)
    assert second.outputs[0].token_ids == expected.outputs[0].token_ids
    # and the same distributions: the copied rows are the keys and values a recompute gives (a wrong or
    # missing copy moves the top-5 logprobs even where the peaked tiny model keeps its argmax)
    ours = [v for lp in second.outputs[0].logprobs or [] for _, v in lp.top]
    theirs = [v for lp in expected.outputs[0].logprobs or [] for _, v in lp.top]
    assert ours == pytest.approx(theirs, abs=2e-3 if kv == "int8" else 1e-4)
    assert llm.core.kv.pool.num_free == llm.core.kv.num_blocks  # nothing held after


def test_beam_search_steps_compute_about_one_token_a_beam(tiny_hf_dir: Callable[[str], Path]) -> None:
    llm = _llm(tiny_hf_dir("qwen2"))
    plain = _llm(tiny_hf_dir("qwen2"), enable_prefix_caching=False)
    prompt = _prompt(llm.core.arch.vocab_size, 19, seed=2)
    params = BeamSearchParams(3, 12, ignore_eos=True)
    (ours,) = llm.beam_search([prompt], params)
    assert [o.token_ids for o in ours.outputs] == [o.token_ids for o in plain.beam_search([prompt], params)[0].outputs]
    stats = llm.core.kv.pool.stats
    computed = stats.queries - stats.hits  # prompt tokens the steps' requests computed
    num_requests = 1 + 3 * 11  # the first step scores the prompt, then three beams a step
    assert computed <= len(prompt) + num_requests + 3, (computed, stats)  # ~one token a request, not a block's
    assert llm.core.kv.pool.num_free == llm.core.kv.num_blocks


def test_beam_search_steps_reuse_the_blocks_they_continued(tiny_hf_dir: Callable[[str], Path]) -> None:
    """Each step copies its beams' partial blocks into new ones; the continued ones are taken next (a big
    pool would otherwise hand out never-used blocks, whose first writes fault in fresh memory, every step)."""
    llm = LLM(str(tiny_hf_dir("qwen2")), dtype="float32", device="cpu", num_kv_blocks=2048, block_size=16,
              max_model_len=256)
    llm.beam_search([_prompt(llm.core.arch.vocab_size, 19, seed=2)], BeamSearchParams(3, 40, ignore_eos=True))
    touched = [b.block_id for b in llm.core.kv.pool.blocks if b.block_hash is not None or b.partial_key is not None]
    # 40 steps of 3 copies: 119 blocks without the reuse; with it, a new block a step is one for a beam whose
    # parent block no step continued (it was pruned), plus the full blocks of the context (54 measured)
    assert len(touched) <= 60, (len(touched), touched)
