"""End-to-end engine invariants on tiny random models, fp32 greedy.

The scheduler may cut, batch, share and recompute however it likes: the tokens must not change.
Every engine configuration below is compared with the same requests run one at a time, and the
engine itself is compared with transformers' `generate`.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence

import pytest

from tests.engine.tiny import (
    ARCH_NAMES,
    GEMMA3_SLIDING_WINDOW,
    VOCAB_SIZE,
    ArchName,
    assert_all_free,
    greedy,
    hf_greedy,
    make_core,
    random_prompts,
    run_to_completion,
    tiny_model,
)
from tokenmill.engine.core import EngineCore
from tokenmill.engine.request import FinishReason, SamplingParams
from tokenmill.errors import RequestValidationError

PROMPT_LENGTHS = (1, 2, 3, 5, 7, 8, 9, 12, 15, 16, 17, 23, 31, 32, 33, 40)
PROMPTS = random_prompts(PROMPT_LENGTHS, seed=123)
PARAMS = [greedy(4 + (5 * i) % 9) for i in range(len(PROMPTS))]  # 4..12 new tokens, mixed


@functools.cache
def alone(arch: ArchName) -> tuple[tuple[int, ...], ...]:
    """The reference: each request alone in a fresh engine, no prefix cache, no chunking."""
    core = make_core(tiny_model(arch), enable_prefix_caching=False)
    outputs = []
    for prompt, params in zip(PROMPTS, PARAMS, strict=True):
        [tokens] = run_to_completion(core, [prompt], params)
        outputs.append(tuple(tokens))
        assert_all_free(core)
    return tuple(outputs)


def _assert_same(actual: list[list[int]], arch: ArchName) -> None:
    expected = alone(arch)
    mismatched = [i for i, (a, e) in enumerate(zip(actual, expected, strict=True)) if tuple(a) != e]
    assert not mismatched, f"requests {mismatched} differ from their solo runs, e.g. #{mismatched[0]}: " \
                           f"{actual[mismatched[0]]} != {list(expected[mismatched[0]])}"


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_batched_equals_alone(arch: ArchName) -> None:
    core = make_core(tiny_model(arch))
    _assert_same(run_to_completion(core, PROMPTS, PARAMS), arch)
    assert [len(t) for t in alone(arch)] == [p.max_tokens for p in PARAMS]
    assert_all_free(core)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("budget", [1, 3, 7, 64])
def test_chunked_prefill_equals_alone(arch: ArchName, budget: int) -> None:
    core = make_core(tiny_model(arch), max_num_batched_tokens=budget)
    _assert_same(run_to_completion(core, PROMPTS, PARAMS), arch)
    assert_all_free(core)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "no-prefix"])
def test_preemption_equals_alone(arch: ArchName, prefix: bool) -> None:
    # 16 blocks of 4 = 64 tokens of KV for requests needing up to 52 each: constant preemption.
    core = make_core(tiny_model(arch), num_blocks=16, enable_prefix_caching=prefix)
    _assert_same(run_to_completion(core, PROMPTS, PARAMS), arch)
    assert core.scheduler.stats.num_preemptions > 0
    assert_all_free(core)


def test_preemption_with_chunked_prefill_and_few_seqs_equals_alone() -> None:
    core = make_core(tiny_model("llama"), num_blocks=14, max_num_batched_tokens=5, max_num_seqs=6)
    _assert_same(run_to_completion(core, PROMPTS, PARAMS), "llama")
    assert core.scheduler.stats.num_preemptions > 0
    assert_all_free(core)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prefix_cache_hits_give_the_same_tokens(arch: ArchName) -> None:
    model = tiny_model(arch)
    [shared] = random_prompts([26], seed=7)
    suffixes = random_prompts([1, 2, 3, 5, 6, 9], seed=8)
    prompts = [shared + s for s in suffixes] + [list(shared)]  # the last one is the bare prefix
    params = greedy(6)

    reference = make_core(model, enable_prefix_caching=False)
    expected = [run_to_completion(reference, [p], params)[0] for p in prompts]

    core = make_core(model)
    first = run_to_completion(core, prompts[:1], params)
    assert core.kv.pool.stats.hits == 0
    rest = run_to_completion(core, prompts[1:], params)
    assert first + rest == expected
    # Every later prompt finds at least the 6 full blocks (24 tokens) of the shared prefix.
    assert core.kv.pool.stats.hits >= 24 * (len(prompts) - 1)
    assert core.kv.pool.stats.queries >= sum(len(p) for p in prompts)
    assert_all_free(core)


def test_prefix_cache_hit_counters_show_in_step_stats_and_outputs() -> None:
    core = make_core(tiny_model("llama"))
    [prompt] = random_prompts([17], seed=9)
    run_to_completion(core, [prompt], greedy(2))
    core.add_request("again", prompt, greedy(2), ())
    result = core.step()
    assert result.stats.prefix_cache_hits == 16
    assert result.stats.prefix_cache_queries == 34
    [out] = result.outputs
    assert out.num_cached_tokens == 16


def test_identical_prompts_in_one_batch_give_identical_tokens() -> None:
    core = make_core(tiny_model("llama"), max_num_batched_tokens=10)
    [prompt] = random_prompts([30], seed=10)
    outputs = run_to_completion(core, [prompt] * 5, greedy(8))
    assert all(o == outputs[0] for o in outputs)
    assert outputs[0] == list(alone_one("llama", tuple(prompt), 8))
    assert_all_free(core)


@functools.cache
def alone_one(arch: ArchName, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    core = make_core(tiny_model(arch), enable_prefix_caching=False)
    return tuple(run_to_completion(core, [list(prompt)], greedy(max_tokens))[0])


def test_gemma3_sliding_window_smaller_than_the_sequence() -> None:
    # Prompts of 20-40 tokens and 32 new ones against a window of 8: local layers must forget.
    model = tiny_model("gemma3")
    prompts = random_prompts([20, 27, 40], seed=11)
    assert min(len(p) for p in prompts) > 2 * GEMMA3_SLIDING_WINDOW
    core = make_core(model, max_num_batched_tokens=6)
    outputs = run_to_completion(core, prompts, greedy(32))
    for prompt, tokens in zip(prompts, outputs, strict=True):
        assert tokens == hf_greedy(model, prompt, 32)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_greedy_matches_transformers_generate(arch: ArchName) -> None:
    model = tiny_model(arch)
    prompts = random_prompts([1, 7, 33], seed=12)
    outputs = run_to_completion(make_core(model), prompts, greedy(32))
    for prompt, tokens in zip(prompts, outputs, strict=True):
        assert tokens == hf_greedy(model, prompt, 32)


def test_seeded_sampling_is_independent_of_the_batch() -> None:
    model = tiny_model("llama")
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=42)
    [prompt] = random_prompts([9], seed=13)
    solo = run_to_completion(make_core(model, seed=1), [prompt], params)[0]
    others = random_prompts([4, 12, 20], seed=14)
    mixed = [SamplingParams(max_tokens=10, temperature=0.8), greedy(10), SamplingParams(max_tokens=10, seed=7)]
    batched = run_to_completion(make_core(model, seed=2, max_num_batched_tokens=7), [*others, prompt],
                                [*mixed, params])[3]
    assert batched == solo


def test_eos_and_stop_token_ids_end_generation_in_the_engine() -> None:
    core = make_core(tiny_model("llama"))
    [prompt] = random_prompts([10], seed=15)
    reference = run_to_completion(core, [prompt], greedy(12))[0]
    stop_at = reference[4]
    first = reference.index(stop_at)
    core.add_request("eos", prompt, greedy(12), (stop_at,))
    core.add_request("stop-id", prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_at]), ())
    core.add_request("ignore", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), (stop_at,))
    tokens: dict[str, list[int]] = {}
    reasons = {}
    while core.has_unfinished:
        for out in core.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert tokens["eos"] == reference[:first + 1] and reasons["eos"] is FinishReason.STOP
    assert tokens["stop-id"] == reference[:first + 1] and reasons["stop-id"] is FinishReason.STOP
    assert tokens["ignore"] == reference and reasons["ignore"] is FinishReason.LENGTH
    assert_all_free(core)


def test_context_limit_finishes_with_length() -> None:
    core = make_core(tiny_model("llama"), num_blocks=5)  # 20 tokens of KV: the context is 20
    assert core.max_model_len == 20
    [prompt] = random_prompts([15], seed=16)
    core.add_request("r", prompt, SamplingParams(max_tokens=None, temperature=0.0), ())
    tokens = []
    reason = None
    while core.has_unfinished:
        for out in core.step().outputs:
            tokens += out.new_token_ids
            reason = out.finish_reason
    assert len(tokens) == 5 and reason is FinishReason.LENGTH
    with pytest.raises(RequestValidationError):
        core.add_request("too-long", list(range(20)), greedy(1), ())


def test_prompt_longer_than_the_budget_without_chunked_prefill_is_rejected_or_served() -> None:
    from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    model = tiny_model("llama")
    config = EngineConfig(ModelConfig("tiny", dtype="float32", device="cpu"), CacheConfig(block_size=4, num_blocks=64),
                          SchedulerConfig(max_num_batched_tokens=8, enable_chunked_prefill=False))
    core = EngineCore(config, model.arch, model.state_dict)
    try:
        core.add_request("long", list(range(12)), greedy(2), ())
    except RequestValidationError:
        return  # rejected up front: fine
    for _ in range(50):
        core.step()
    assert not core.has_unfinished, "the 12-token prompt was never scheduled with a budget of 8"


def test_preempted_request_without_chunked_prefill_is_always_readmitted() -> None:
    from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    model = tiny_model("llama")
    config = EngineConfig(ModelConfig("tiny", dtype="float32", device="cpu"),
                          CacheConfig(block_size=4, num_blocks=4, enable_prefix_caching=False),
                          SchedulerConfig(max_num_batched_tokens=8, enable_chunked_prefill=False))
    core = EngineCore(config, model.arch, model.state_dict)
    # Both prompts fit the budget. b gets 2 tokens out, then a (earlier, so more urgent) needs
    # b's blocks: b is preempted holding 9 tokens, one more than a step may carry unchunked.
    for i, prompt in enumerate(random_prompts([5, 7], seed=5)):
        core.add_request(str(i), prompt, greedy(8), ())
    for _ in range(100):
        if not core.has_unfinished:
            break
        core.step()
    assert not core.has_unfinished, [(r.request_id, r.num_tokens, r.status) for r in core.scheduler.requests.values()]


def test_out_of_vocabulary_prompt_ids_are_rejected_and_do_not_poison_the_batch() -> None:
    core = make_core(tiny_model("llama"))
    core.add_request("ok", [1, 2, 3], greedy(3), ())
    with pytest.raises(RequestValidationError):
        core.add_request("bad", [1, VOCAB_SIZE], greedy(3), ())
    while core.has_unfinished:
        core.step()
    assert_all_free(core)


def test_out_of_vocabulary_stop_token_ids_are_rejected() -> None:
    core = make_core(tiny_model("llama"))
    core.add_request("ok", [1, 2, 3], greedy(3), ())
    params = SamplingParams(max_tokens=3, min_tokens=1, stop_token_ids=[VOCAB_SIZE + 700])
    with pytest.raises(RequestValidationError):
        core.add_request("bad", [1, 2], params, ())
    while core.has_unfinished:
        core.step()
    assert_all_free(core)


def test_a_live_duplicate_request_id_is_rejected() -> None:
    core = make_core(tiny_model("llama"))
    first, second = random_prompts([9, 13], seed=18)
    core.add_request("x", first, greedy(5), ())
    tokens = [t for _ in range(2) for out in core.step().outputs for t in out.new_token_ids]
    with pytest.raises(RequestValidationError):
        core.add_request("x", second, greedy(5), ())
    while core.has_unfinished:
        tokens += [t for out in core.step().outputs for t in out.new_token_ids]
    assert tokens == list(alone_one("llama", tuple(first), 5))
    assert_all_free(core)


# ---- block leak ---------------------------------------------------------------------------------


def _check_pool(core: EngineCore) -> None:
    """A block is in the free queue iff its refcount is 0; refcounts equal the table references."""
    pool = core.kv.pool
    refs = [0] * core.kv.num_blocks
    for table in core.kv.block_tables.values():
        for block_id in table:
            refs[block_id] += 1
    assert [b.ref_count for b in pool.blocks] == refs
    assert set(pool.free_queue) == {b.block_id for b in pool.blocks if b.ref_count == 0}
    for block_hash, block_id in pool.cached.items():
        assert pool.blocks[block_id].block_hash == block_hash


def _random_params(rng: random.Random) -> SamplingParams:
    max_tokens = rng.randint(1, 6)
    kind = rng.random()
    if kind < 0.5:
        return greedy(max_tokens)
    if kind < 0.8:
        return SamplingParams(max_tokens=max_tokens, temperature=rng.choice([0.5, 1.0, 2.0]),
                              top_k=rng.choice([0, 5]), top_p=rng.choice([1.0, 0.9]),
                              seed=rng.choice([None, rng.randint(0, 99)]))
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, min_tokens=rng.randint(0, max_tokens),
                          stop_token_ids=[rng.randint(0, 299)], repetition_penalty=1.2, presence_penalty=0.5)


def run_random_requests_with_aborts(core: EngineCore, rng: random.Random, total: int,
                                    make_params: Callable[[random.Random], SamplingParams],
                                    salts: Sequence[str | None] = (None,)) -> tuple[int, int]:
    """`total` random requests (some sharing prefixes, 20 live at once, 15% of steps abort one, each under
    one of `salts`), the pool checked after every step; (aborted, finished)."""
    prefixes = random_prompts([8, 12, 20], seed=17)
    num_added = num_aborted = num_finished = 0
    live: set[str] = set()
    while num_added < total or core.has_unfinished:
        while num_added < total and len(live) < 20:
            length = rng.randint(1, 40)
            prefix = rng.choice([[], *prefixes])
            prompt = (prefix + [rng.randint(0, 299) for _ in range(length)])[:max(1, length)]
            rid = f"r{num_added}"
            salt = rng.choice(salts) if len(salts) > 1 else salts[0]
            core.add_request(rid, prompt, make_params(rng), (rng.randint(0, 299),), priority=rng.randint(0, 2),
                             cache_salt=salt)
            live.add(rid)
            num_added += 1
        if live and rng.random() < 0.15:
            victim = rng.choice(sorted(live))
            if core.abort(victim) is not None:
                num_aborted += 1
            live.discard(victim)
        for out in core.step().outputs:
            if out.finished:
                live.discard(out.request_id)
                num_finished += 1
        _check_pool(core)
    return num_aborted, num_finished


def test_no_block_leaks_after_1000_random_requests_with_aborts() -> None:
    core = make_core(tiny_model("llama"), num_blocks=24, max_num_batched_tokens=40, max_num_seqs=16,
                     policy="priority")
    num_aborted, num_finished = run_random_requests_with_aborts(core, random.Random(0), 1000, _random_params)
    assert num_aborted > 50 and num_finished + num_aborted == 1000
    assert core.scheduler.stats.num_preemptions > 0
    assert core.kv.pool.stats.hits > 0 and core.kv.pool.stats.evictions > 0
    assert_all_free(core)
    assert core.runner.sampler._request_generators == {}
