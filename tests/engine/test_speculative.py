"""Speculative decoding end to end on tiny random models, fp32.

Greedy: with either proposer, in mixed batches, with chunked prefill, prefix-cache hits and forced
preemption, the tokens are exactly those of the engine without speculation. Sampling exactness (the
chi-square tests) is in test_speculative_sampling.py.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from tests.engine.tiny import (
    ARCH_NAMES,
    VOCAB_SIZE,
    ArchName,
    TinyModel,
    assert_all_free,
    greedy,
    make_core,
    random_prompts,
    run_to_completion,
    tiny_model,
)
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.engine import block_hash
from tokenmill.engine.core import EngineCore
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.engine.spec.draft import DraftModelProposer

# Repeating prompts give the n-gram proposer something to find; random ones mostly do not.
PROMPTS = [*random_prompts((1, 3, 7, 9, 16, 17, 31, 40), seed=321), [5, 6, 7, 8] * 6, [*[9, 10, 11] * 9, 9]]
PARAMS = [greedy(6 + (7 * i) % 19) for i in range(len(PROMPTS))]  # 6..24 new tokens, mixed


def spec_core(model: TinyModel, method: str, draft: ArchName | None = None, *, k: int = 3, block_size: int = 4,
              num_blocks: int = 256, max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
              seed: int = 0, adaptive: bool = False, draft_quantization: str = "auto",
              draft_sampling: bool = True, draft_vocab: int | None = None) -> EngineCore:
    """`draft_quantization` "auto" keeps a float checkpoint's draft dense, so a model drafting for
    itself guesses exactly its own tokens (the tests of the draft's KV rely on it)."""
    config = EngineConfig(
        ModelConfig("tiny", dtype="float32", device="cpu", seed=seed),
        CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching),
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens),
        speculative=SpeculativeConfig(method, k, ngram_min=1, ngram_max=3, draft_model=draft, adaptive=adaptive,
                                      draft_quantization=draft_quantization, draft_sampling=draft_sampling,
                                      draft_vocab=draft_vocab),
    )
    weights = None if draft is None else (tiny_model(draft).arch, tiny_model(draft).state_dict)
    return EngineCore(config, model.arch, model.state_dict, weights)


@functools.cache
def plain(arch: ArchName) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(t) for t in run_to_completion(make_core(tiny_model(arch)), PROMPTS, PARAMS))


def _run_counting(core: EngineCore, prompts: list[list[int]],
                  params: list[SamplingParams]) -> tuple[list[list[int]], int, int]:
    """Outputs, plus the drafts verified and proposals accepted over the run."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(str(i), prompt, p, ())
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    drafts = accepted = 0
    while core.has_unfinished:
        step = core.step()
        drafts += step.stats.spec_num_drafts
        accepted += step.stats.spec_num_accepted_tokens
        for out in step.outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[str(i)] for i in range(len(prompts))], drafts, accepted


def _assert_greedy_identical(core: EngineCore, arch: ArchName) -> tuple[int, int]:
    outputs, drafts, accepted = _run_counting(core, PROMPTS, PARAMS)
    expected = plain(arch)
    bad = [i for i, (a, e) in enumerate(zip(outputs, expected, strict=True)) if tuple(a) != e]
    assert not bad, f"requests {bad} differ with speculation: {outputs[bad[0]]} != {list(expected[bad[0]])}"
    assert drafts > 0
    assert_all_free(core)
    return drafts, accepted


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_ngram_greedy_is_token_identical(arch: ArchName) -> None:
    _, accepted = _assert_greedy_identical(spec_core(tiny_model(arch), "ngram"), arch)
    assert accepted > 0


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_draft_model_greedy_is_token_identical(arch: ArchName) -> None:
    # The same model as its own draft: (nearly) every proposal accepted, KV kept in step.
    _, accepted = _assert_greedy_identical(spec_core(tiny_model(arch), "draft", arch), arch)
    assert accepted > 0
    other: ArchName = "qwen2" if arch != "qwen2" else "llama"
    _assert_greedy_identical(spec_core(tiny_model(arch), "draft", other), arch)  # mostly rejected


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
@pytest.mark.parametrize("budget", [2, 5, 64])
def test_greedy_identical_with_chunked_prefill(method: str, budget: int) -> None:
    draft: ArchName | None = "llama" if method == "draft" else None
    _assert_greedy_identical(spec_core(tiny_model("llama"), method, draft, max_num_batched_tokens=budget), "llama")


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "no-prefix"])
def test_greedy_identical_under_forced_preemption(method: str, prefix: bool) -> None:
    draft: ArchName | None = "gemma3" if method == "draft" else None
    core = spec_core(tiny_model("gemma3"), method, draft, num_blocks=20, enable_prefix_caching=prefix)
    _assert_greedy_identical(core, "gemma3")
    assert core.scheduler.stats.num_preemptions > 0


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_greedy_identical_with_prefix_cache_hits(method: str) -> None:
    """Second-round prompts reuse blocks the first round published, including blocks of generated
    tokens that were accepted proposals: their KV must be the target's."""
    model = tiny_model("qwen2")
    core = spec_core(model, method, "qwen2" if method == "draft" else None)
    first_prompts, params = [PROMPTS[-2], PROMPTS[-1]], [greedy(24)] * 2
    first, _, accepted = _run_counting(core, first_prompts, params)
    assert first == run_to_completion(make_core(model), first_prompts, params) and accepted > 0
    second_prompts = [first_prompts[0] + first[0][:13], first_prompts[1] + first[1][:9] + [1], first_prompts[0]]
    hits_before = core.kv.pool.stats.hits
    second, _, _ = _run_counting(core, second_prompts, [greedy(12)] * 3)
    assert core.kv.pool.stats.hits - hits_before >= 3 * 4 * 4  # several blocks of 4 per prompt
    assert second == run_to_completion(make_core(model, enable_prefix_caching=False), second_prompts, [greedy(12)] * 3)


def test_the_draft_reuses_cached_prefixes_and_its_kv_stays_exact() -> None:
    """The model as its own draft, requests sharing a prefix one after another: the draft's pool
    hits the shared blocks (fewer draft tokens computed), and every proposal is still accepted, so
    no cached block held KV of tokens other than its hash's (publishing blocks past the target's
    tokens, which a rollback overwrites, breaks this)."""
    model = tiny_model("llama")
    core = spec_core(model, "draft", "llama", k=3)
    proposer = core.speculator.proposer  # type: ignore[union-attr]
    assert isinstance(proposer, DraftModelProposer)
    computed: list[int] = []
    execute = proposer.runner.sample_logits

    def counting(out):  # type: ignore[no-untyped-def]
        computed.append(sum(s.num_new_tokens for s in out.scheduled))
        return execute(out)

    proposer.runner.sample_logits = counting  # type: ignore[method-assign]
    shared = random_prompts((41,), seed=5)[0]
    prompts = [[*shared, 3, 1, 4], [*shared, 1, 5], [*shared, 9, 2, 6, 5]]
    totals, outputs = [], []
    for i, prompt in enumerate(prompts):
        computed.clear()
        core.add_request(f"r{i}", prompt, greedy(10), ())
        tokens: list[int] = []
        drafts = accepted = 0
        while core.has_unfinished:
            step = core.step()
            drafts += step.stats.spec_num_draft_tokens
            accepted += step.stats.spec_num_accepted_tokens
            tokens += [t for out in step.outputs for t in out.new_token_ids]
        assert drafts > 0 and accepted == drafts, f"request {i}: {accepted} of {drafts} proposals accepted"
        totals.append(sum(computed))
        outputs.append(tokens)
    assert outputs == run_to_completion(make_core(model), prompts, [greedy(10)] * 3)
    assert proposer.kv.pool.stats.hits >= 2 * 40  # the 41-token prefix's 10 full blocks, twice
    assert totals[1] < totals[0] - 30 and totals[2] < totals[0] - 30
    assert_all_free(core)


def test_the_draft_publishes_only_blocks_of_the_targets_tokens() -> None:
    """A mismatched draft (proposals rejected, its KV rolled back and overwritten in place): every
    block the draft's pool publishes holds target tokens only. A block holding proposals would be
    published under the hash of tokens a rollback then overwrites."""
    core = spec_core(tiny_model("llama"), "draft", "qwen2", k=3)
    proposer = core.speculator.proposer  # type: ignore[union-attr]
    assert isinstance(proposer, DraftModelProposer)
    outputs, drafts, accepted = _run_counting(core, PROMPTS, PARAMS)
    assert drafts > 0 and accepted < drafts  # rollbacks happened
    bs = core.kv.block_size
    valid = set()
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        tokens, parent = prompt + out, block_hash._ROOT_HASH
        for i in range(len(tokens) // bs):
            parent = block_hash.hash_block(parent, tuple(tokens[i * bs:(i + 1) * bs]))
            valid.add(parent)
    published = set(proposer.kv.pool.cached)
    assert published and published <= valid, f"{len(published - valid)} blocks of proposals published"


def test_a_draft_rollback_rehashes_the_block_it_rewrites() -> None:
    """A 7-token prompt in blocks of 4: the first proposal d_1 completes block 1, which is hashed
    with d_1 in it. The target then rejects d_1; once its own token fills that block, the block is
    published under the hash of the target's tokens, not the stale one."""
    core = spec_core(tiny_model("llama"), "draft", "llama", k=1)
    proposer = core.speculator.proposer  # type: ignore[union-attr]
    assert isinstance(proposer, DraftModelProposer)
    prompt = random_prompts((7,), seed=11)[0]
    request = Request("r", list(prompt), greedy(4))
    [[d1]] = proposer.propose([request], [1])
    other = (d1 + 1) % core.runner.arch.vocab_size
    request.token_ids.append(other)  # the target rejected d_1 and sampled `other`
    proposer.propose([request], [1])
    first = block_hash.hash_block(block_hash._ROOT_HASH, tuple(prompt[:4]))
    assert set(proposer.kv.pool.cached) == {first, block_hash.hash_block(first, (*prompt[4:7], other))}


def test_mixed_batch_of_speculating_sampled_and_prefilling_requests() -> None:
    model = tiny_model("llama")
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=11)
    prompts = [PROMPTS[-1], PROMPTS[5], PROMPTS[-2], PROMPTS[7]]
    params = [greedy(20), sampled, greedy(15), SamplingParams(max_tokens=9, temperature=1.0, seed=3, top_k=20)]
    reference = run_to_completion(make_core(model), [prompts[0], prompts[2]], [params[0], params[2]])
    alone = [run_to_completion(spec_core(model, "ngram", max_num_batched_tokens=16), [p], [q])[0]
             for p, q in zip(prompts, params, strict=True)]
    core = spec_core(model, "ngram", max_num_batched_tokens=16)  # long prompts prefill in chunks beside decodes
    together, drafts, _ = _run_counting(core, prompts, params)
    assert [together[0], together[2]] == reference
    assert together == alone  # seeded requests sample the same way whatever shares the batch
    assert drafts > 0
    assert_all_free(core)


# At temperature 0.001 a seeded request mostly takes the argmax and so the lookups that a greedy one accepts;
# at 0.3 and 2 the seeds decide (rejections, draws from the rest of p).
SEEDED = [SamplingParams(max_tokens=6 + (5 * i) % 17, temperature=(0.001, 0.3, 2.0)[i % 3], seed=100 + i,
                         top_k=0 if i % 2 else 40) for i in range(len(PROMPTS))]


@pytest.mark.parametrize(("method", "adaptive"), [("ngram", False), ("ngram", True), ("suffix", True),
                                                  ("draft", False)])
def test_seeded_sampled_requests_emit_the_tokens_they_emit_without_speculation(method: str, adaptive: bool) -> None:
    """Point-mass proposals (lookups, a seeded request's argmax guesses) are verified by the plain sampler's
    own draw, one noise row of the request's stream per emitted token: whatever k the controller picks,
    a seeded request's tokens are those of the engine without speculation."""
    model = tiny_model("llama")
    reference = run_to_completion(make_core(model), PROMPTS, SEEDED)
    reseeded = [SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, seed=7, top_k=p.top_k)
                for p in SEEDED]
    assert run_to_completion(make_core(model), PROMPTS, reseeded) != reference  # the seeds do matter here
    core = spec_core(model, method, "llama" if method == "draft" else None, adaptive=adaptive)
    if adaptive:  # measured costs of a host where rows are nearly free: the controller's k varies by gains
        assert core.speculator is not None  # (before a fit, weak buckets would propose nothing here)
        for n in (1, 2, 4, 8, 16, 32) * 4:
            core.speculator.controller.observe(n, 0.05 + 0.0001 * n)
    outputs, drafts, accepted = _run_counting(core, PROMPTS, SEEDED)
    assert outputs == reference
    assert drafts > 0 and accepted > 0
    assert_all_free(core)


def test_no_block_leak_after_random_speculative_requests_with_aborts() -> None:
    rng = random.Random(5)
    core = spec_core(tiny_model("llama"), "draft", "llama", num_blocks=48)
    for i in range(300):
        length = rng.randrange(1, 30)
        repeating = rng.random() < 0.5
        prompt = [3, 4, 5] * (length // 3 + 1) if repeating else [rng.randrange(VOCAB_SIZE) for _ in range(length)]
        params = greedy(rng.randrange(1, 20)) if rng.random() < 0.6 else \
            SamplingParams(max_tokens=rng.randrange(1, 20), temperature=1.0, seed=i)
        core.add_request(f"r{i}", prompt, params, (rng.randrange(VOCAB_SIZE),))
        for _ in range(rng.randrange(0, 3)):
            core.step()
        if rng.random() < 0.2 and core.scheduler.requests:
            core.abort(rng.choice(sorted(core.scheduler.requests)))
    while core.has_unfinished:
        core.step()
    assert_all_free(core)
    assert core.speculator is not None
    proposer = core.speculator.proposer
    assert isinstance(proposer, DraftModelProposer)
    assert proposer.kv.block_tables == {} and proposer.kv.pool.num_free == proposer.kv.num_blocks


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_a_draft_with_a_cut_head_guesses_only_kept_ids_and_stays_token_identical(arch: ArchName) -> None:
    """draft_vocab: the draft scores the first 150 ids only. Drafting for itself, its guesses past the
    cut turn into other ids and are rejected; the output stays the target's."""
    core = spec_core(tiny_model(arch), "draft", arch, draft_vocab=150)
    proposer = core.speculator.proposer
    assert isinstance(proposer, DraftModelProposer)
    assert proposer.runner.model.lm_head.out_features == 150
    guessed: list[int] = []
    propose = proposer.propose

    def recording(*args: object, **kwargs: object) -> list[list[int]]:
        out = propose(*args, **kwargs)  # type: ignore[arg-type]
        guessed.extend(t for guesses in out for t in guesses)
        return out

    proposer.propose = recording  # type: ignore[method-assign]
    _, accepted = _assert_greedy_identical(core, arch)
    assert accepted > 0 and guessed and max(guessed) < 150
    outputs = [t for tokens in plain(arch) for t in tokens]
    assert max(outputs) >= 150  # the target does emit ids past the cut: the test could fail


def test_draft_weights_load_before_the_memory_probe_and_its_kv_shares_the_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both models' weights are in memory before the KV budget is probed, and the target's and the
    draft's pools (one draft block per target block) together fit that budget."""
    from typing import Any

    from tokenmill.engine import model_runner
    from tokenmill.layers.kv_cache import kv_cache_spec
    from tokenmill.models.llama import LlamaForCausalLM

    total, weight, fraction = 64 << 20, 16 << 20, 0.5
    in_use = {"bytes": 0}
    load_weights = LlamaForCausalLM.load_weights

    def loading(self: LlamaForCausalLM, *args: Any, **kwargs: Any) -> Any:
        result = load_weights(self, *args, **kwargs)
        in_use["bytes"] += weight
        return result

    monkeypatch.setattr(LlamaForCausalLM, "load_weights", loading)
    monkeypatch.setattr(model_runner, "available_memory_bytes", lambda device: total - in_use["bytes"])
    target, draft = tiny_model("llama"), tiny_model("llama")
    config = EngineConfig(ModelConfig("tiny", dtype="float32", device="cpu"),
                          CacheConfig(block_size=4, memory_fraction=fraction),
                          speculative=SpeculativeConfig("draft", 3, draft_model="tiny-draft"))
    core = EngineCore(config, target.arch, target.state_dict, (draft.arch, draft.state_dict))
    spec = kv_cache_spec("auto", torch.float32)
    per_block = model_runner.kv_bytes_per_block(target.arch, 4, spec)
    draft_per_block = model_runner.kv_bytes_per_block(draft.arch, 4, spec)
    budget = int((total - 2 * weight) * fraction)  # after both weights
    assert core.kv.num_blocks == budget // per_block * per_block // (per_block + draft_per_block)
    proposer = core.speculator.proposer if core.speculator is not None else None
    assert isinstance(proposer, DraftModelProposer)
    assert proposer.kv.num_blocks == core.kv.num_blocks
    used = sum(c.nbytes for c in core.runner.kv_caches) + sum(c.nbytes for c in proposer.runner.kv_caches)
    assert used <= budget


def test_verification_reads_the_paged_cache_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request verifying k proposals is k + 1 rows of the decode group: the native decode kernel
    reads its keys in place, never the prefill path's gather (and the tokens stay exact)."""
    from tokenmill.kernels import cpu_kernels
    from tokenmill.layers.kv_cache import DenseKVCache

    if cpu_kernels() is None:
        pytest.skip("the native CPU kernel does not build here")
    calls = {"gather": 0, "decode_rows": []}
    gather, native = DenseKVCache.gather, DenseKVCache.native_decode

    def counting_gather(self: DenseKVCache, *args: object, **kwargs: object) -> object:
        calls["gather"] += 1
        return gather(self, *args, **kwargs)  # type: ignore[arg-type]

    def counting_native(self: DenseKVCache, kernels: object, q: torch.Tensor, *args: object) -> object:
        calls["decode_rows"].append(q.shape[0])
        return native(self, kernels, q, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DenseKVCache, "gather", counting_gather)
    monkeypatch.setattr(DenseKVCache, "native_decode", counting_native)
    model = tiny_model("llama")
    core = spec_core(model, "ngram", k=4)
    prompt = [*[9, 10, 11, 12] * 6, 9]  # periodic: the n-gram proposer finds it
    core.add_request("0", prompt, greedy(20), ())
    tokens = [t for o in core.step().outputs for t in o.new_token_ids]  # the prompt: a prefill (gathers)
    calls["gather"], calls["decode_rows"] = 0, []
    drafts = 0
    while core.has_unfinished:
        step = core.step()
        drafts += step.stats.spec_num_drafts
        tokens += [t for o in step.outputs for t in o.new_token_ids]
    assert drafts > 0 and max(calls["decode_rows"]) > 1  # verification rows went to the kernel
    assert calls["gather"] == 0
    assert tokens == run_to_completion(make_core(model), [prompt], greedy(20))[0]
