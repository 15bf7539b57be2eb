"""`cache_salt`: requests share prefix-cache blocks, a draft model's cached blocks and `--speculative
suffix`'s cached outputs only with requests of the same salt; unsalted requests share among themselves
as before. Output never depends on the salt."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.engine.test_speculative import spec_core
from tests.engine.tiny import assert_all_free, greedy, make_core, random_prompts, tiny_model
from tokenmill.engine.block_hash import update_block_hashes
from tokenmill.engine.core import EngineCore
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.engine.spec.draft import DraftModelProposer
from tokenmill.engine.spec.output_cache import OutputCache, salt_key
from tokenmill.errors import RequestValidationError
from tokenmill.llm import LLM

PROMPT = random_prompts([18], seed=31)[0]  # 4 full blocks of 4 tokens, the prefix cache's reach


def _hashes(salt: str | None) -> list[int]:
    request = Request("r", list(PROMPT), SamplingParams(), cache_salt=salt)
    update_block_hashes(request, 4)
    return request.block_hashes


def test_a_salt_changes_every_block_hash_and_only_its_own_salt_repeats_them() -> None:
    plain, a, b = _hashes(None), _hashes("tenant-a"), _hashes("tenant-b")
    assert len(plain) == len(a) == len(b) == 4
    assert not set(plain) & set(a) and not set(a) & set(b)
    assert _hashes("tenant-a") == a and _hashes(None) == plain


def _run(core: EngineCore, request_id: str, salt: str | None) -> tuple[list[int], int, int]:
    """Output tokens, prompt tokens served from the prefix cache, proposals accepted."""
    core.add_request(request_id, PROMPT, greedy(24), (), cache_salt=salt)
    tokens: list[int] = []
    cached = accepted = 0
    while core.has_unfinished:
        step = core.step()
        accepted += step.stats.spec_num_accepted_tokens
        for out in step.outputs:
            tokens.extend(out.new_token_ids)
            cached = max(cached, out.num_cached_tokens)
    return tokens, cached, accepted


def test_prefix_cache_hits_stay_within_a_salt() -> None:
    core = make_core(tiny_model("llama"))
    first, cached, _ = _run(core, "a1", "tenant-a")
    assert cached == 0
    runs = {rid: _run(core, rid, salt) for rid, salt in
            [("b1", "tenant-b"), ("none1", None), ("a2", "tenant-a"), ("none2", None), ("b2", "tenant-b")]}
    assert {rid: run[1] for rid, run in runs.items()} == {"b1": 0, "none1": 0, "a2": 16, "none2": 16, "b2": 16}
    assert all(run[0] == first for run in runs.values())
    assert_all_free(core)


def test_suffix_cache_guesses_only_from_outputs_of_the_same_salt() -> None:
    """The cached answer to the same random prompt is the whole guess (tests/engine/test_suffix_speculation.py:
    18 of 23 tokens accepted when it is found); under another salt prompt lookup alone finds almost nothing."""
    core = spec_core(tiny_model("llama"), "suffix", k=4)
    first, _, _ = _run(core, "a1", "tenant-a")
    other, _, other_accepted = _run(core, "b1", "tenant-b")
    unsalted, _, unsalted_accepted = _run(core, "none1", None)
    same, _, same_accepted = _run(core, "a2", "tenant-a")
    assert other == unsalted == same == first
    assert other_accepted <= 2 and unsalted_accepted <= 2
    assert same_accepted == 18
    assert_all_free(core)


def test_a_draft_models_prefix_cache_is_salted_too() -> None:
    core = spec_core(tiny_model("llama"), "draft", draft="llama", k=3)
    assert core.speculator is not None
    proposer = core.speculator.proposer
    assert isinstance(proposer, DraftModelProposer)
    stats = proposer.kv.pool.stats
    first, _, _ = _run(core, "a1", "tenant-a")
    hits = stats.hits
    assert _run(core, "b1", "tenant-b")[0] == first
    assert stats.hits == hits  # another salt: the draft recomputes the prompt
    assert _run(core, "a2", "tenant-a")[0] == first
    assert stats.hits >= hits + 16
    assert_all_free(core)


def test_an_empty_salt_is_refused() -> None:
    core = make_core(tiny_model("llama"))
    with pytest.raises(RequestValidationError, match="cache_salt"):
        core.add_request("r", PROMPT, greedy(2), (), cache_salt="")


def test_output_cache_entries_of_a_salt_are_found_under_it_only_and_evicted_with_it() -> None:
    cache = OutputCache(2, 4, 10)
    cache.add([1, 2, 3, 4, 5, 6], lead_in=0, salt=salt_key("a"))
    assert cache.match([9, 3, 4], salt_key("a")) == (2, 4)
    assert cache.match([9, 3, 4]) == (0, -1)
    assert cache.match([9, 3, 4], salt_key("b")) == (0, -1)
    cache.add([3, 4, 7, 8], lead_in=0)  # unsalted, the same n-gram: both entries live side by side
    n, entry = cache.match([9, 3, 4])
    assert (n, cache.continuation(entry, 2)) == (2, [7, 8])
    assert cache.continuation(cache.match([9, 3, 4], salt_key("a"))[1], 2) == [5, 6]
    cache.add([6, 6, 6, 6, 6, 6], lead_in=0)  # 16 tokens > 10: the oldest (salted) output goes
    assert cache.match([9, 3, 4], salt_key("a")) == (0, -1)
    assert cache.continuation(cache.match([9, 3, 4])[1], 2) == [7, 8]


def test_the_offline_api_takes_a_salt(tiny_hf_dir: Callable[[str], Path]) -> None:
    llm = LLM(str(tiny_hf_dir("llama")), dtype="float32", device="cpu", num_kv_blocks=64)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    prompt = [t % 250 for t in PROMPT * 3]  # 54 ids of the tiny vocabulary: three 16-token blocks

    def cached(salt: str | None) -> int:
        return llm.generate([prompt], params, cache_salt=salt)[0].num_cached_tokens

    assert [cached("a"), cached("b"), cached(None), cached("a"), cached(None)] == [0, 0, 0, 48, 48]
    messages = [{"role": "user", "content": "hello " * 20}]
    chat = [llm.chat(messages, params, cache_salt=salt)[0].num_cached_tokens for salt in ("a", "b", "b")]
    assert chat[:2] == [0, 0] and chat[2] > 0
    streamed = list(llm.stream(prompt, params, cache_salt="c"))[-1].text
    assert streamed == llm.generate([prompt], params)[0].outputs[0].text
    assert cached("c") == 48  # the stream's blocks are its salt's
