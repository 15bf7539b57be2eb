"""Asynchronous scheduling (engine/pipeline.py): step N + 1 is scheduled and built while step N runs.

The tokens must be those of the synchronous engine whatever the scheduler does meanwhile: chunked
prefill, prefix-cache hits, preemption of a request whose token is still pending, a stop token that
ends a request whose next row was already submitted, aborts, and requests that force one step at a time.
"""

from __future__ import annotations

import random
import threading

import pytest

from tests.engine.test_engine_invariants import (
    PARAMS,
    PROMPTS,
    _check_pool,
    _random_params,
    run_random_requests_with_aborts,
)
from tests.engine.tiny import (
    ARCH_NAMES,
    ArchName,
    assert_all_free,
    greedy,
    make_core,
    random_prompts,
    run_to_completion,
    tiny_model,
)
from tokenmill.config import EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.engine.block_hash import update_block_hashes
from tokenmill.engine.core import EngineCore
from tokenmill.engine.pipeline import async_scheduling_enabled
from tokenmill.engine.request import PLACEHOLDER, Request, SamplingParams
from tokenmill.errors import TokenmillError


def _run(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams],
         eos: tuple[int, ...] = ()) -> list[list[int]]:
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(str(i), prompt, p, eos)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for _ in range(5_000):
        if not core.has_unfinished:
            break
        for out in core.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
        _check_pool(core)
    assert not core.has_unfinished, "engine still busy after 5,000 steps"
    return [tokens[str(i)] for i in range(len(prompts))]


def _overlapped_steps(core: EngineCore) -> list[int]:
    """Counts the steps that overlapped (in a list, so the test can read it after the run)."""
    count = [0]
    inner = core._step_overlapped

    def counted(pipeline):  # type: ignore[no-untyped-def]
        count[0] += 1
        return inner(pipeline)

    core._step_overlapped = counted  # type: ignore[method-assign]
    return count


@pytest.mark.parametrize("arch", ARCH_NAMES)
@pytest.mark.parametrize("setting", [{}, {"max_num_batched_tokens": 7}, {"num_blocks": 16},
                                     {"num_blocks": 14, "max_num_batched_tokens": 5, "max_num_seqs": 6}],
                         ids=["batched", "chunked", "preempting", "preempting-chunked"])
def test_greedy_tokens_equal_the_synchronous_engine(arch: ArchName, setting: dict[str, int]) -> None:
    model = tiny_model(arch)
    expected = run_to_completion(make_core(model, async_scheduling="off", **setting), PROMPTS, PARAMS)
    core = make_core(model, async_scheduling="on", **setting)
    overlapped = _overlapped_steps(core)
    assert _run(core, PROMPTS, PARAMS) == expected
    assert overlapped[0] > 10
    if "num_blocks" in setting:
        assert core.scheduler.stats.num_preemptions > 0
    assert_all_free(core)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_stop_tokens_end_requests_whose_next_row_was_submitted(arch: ArchName) -> None:
    """EOS and stop ids are only known after the step; the row scheduled meanwhile is thrown away."""
    model = tiny_model(arch)
    free_run = run_to_completion(make_core(model), PROMPTS, [greedy(12)] * len(PROMPTS))
    eos = (free_run[0][3],)  # a token the first request emits fourth: it ends there
    params = [SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[t[5]]) for t in free_run]
    expected = _run(make_core(model, async_scheduling="off"), PROMPTS, params, eos)
    assert len(expected[0]) <= 4 and sum(len(t) < 12 for t in expected) > len(PROMPTS) // 2
    core = make_core(model, async_scheduling="on")
    assert _run(core, PROMPTS, params, eos) == expected
    assert_all_free(core)


def test_prefix_cache_hits_and_shared_prompts_give_the_same_tokens() -> None:
    model = tiny_model("llama")
    [shared] = random_prompts([26], seed=7)
    prompts = [shared + s for s in random_prompts([1, 2, 3, 5, 6, 9], seed=8)] + [list(shared)] * 3
    params = [greedy(9)] * len(prompts)
    expected = [run_to_completion(make_core(model, enable_prefix_caching=False), [p], greedy(9))[0] for p in prompts]
    core = make_core(model, async_scheduling="on", max_num_batched_tokens=12)
    first = _run(core, prompts[:1], params[:1])
    assert first + _run(core, prompts[1:], params[1:]) == expected
    assert core.kv.pool.stats.hits >= 24 * (len(prompts) - 1)
    assert_all_free(core)


def test_requests_that_read_their_history_step_synchronously_beside_plain_ones() -> None:
    """Penalties, logprobs and min_tokens need every token on the host: while one runs, the engine
    drains the running step and goes one step at a time; the others' tokens do not change. The
    min_tokens requests would stop one token early if their sampler counted a pending token."""
    model = tiny_model("qwen2")
    free_run = run_to_completion(make_core(model), PROMPTS, [greedy(12)] * len(PROMPTS))
    params = []
    for i, tokens in enumerate(free_run):
        if i % 4 == 0:  # its sixth token is a stop id, masked while fewer than 6 tokens are out
            params.append(SamplingParams(max_tokens=12, temperature=0.0, min_tokens=6, stop_token_ids=[tokens[5]]))
        elif i % 4 == 1:
            params.append(SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3, logprobs=2))
        else:
            params.append(greedy(4 + i % 9))
    expected = run_to_completion(make_core(model, async_scheduling="off", max_num_batched_tokens=16), PROMPTS, params)
    assert all(len(expected[i]) > 6 for i in range(0, len(PROMPTS), 4))
    core = make_core(model, async_scheduling="on", max_num_batched_tokens=16)
    overlapped = _overlapped_steps(core)
    assert _run(core, PROMPTS, params) == expected
    assert overlapped[0] > 0  # after the special requests finished
    assert_all_free(core)


def _run_with_logprobs(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]) -> list[object]:
    """Per request: its tokens, each token's logprob and top ids, and its prompt logprobs."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(str(i), prompt, p, ())
    got: dict[str, list[object]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished:
        for out in core.step().outputs:
            got[out.request_id] += [(t, None if lp is None else (lp.logprob, sorted(lp.top)))
                                    for t, lp in zip(out.new_token_ids, out.new_logprobs or [None] * 99, strict=False)]
            if out.prompt_logprobs:
                got[out.request_id].append([(e.token_id, e.logprob) for e in out.prompt_logprobs])
    return [got[str(i)] for i in range(len(prompts))]


def test_seeds_logprobs_prompt_logprobs_and_bias_overlap_with_the_same_results() -> None:
    """Their sampling reads no history: their steps overlap, seeded draws and logprobs equal the
    synchronous engine's, and a finished request's generator is dropped on the device thread."""
    model = tiny_model("llama")
    params = []
    for i in range(len(PROMPTS)):
        kind = i % 4
        params.append(SamplingParams(max_tokens=10, temperature=1.0, seed=i) if kind == 0 else
                      SamplingParams(max_tokens=8, temperature=0.0, logprobs=3) if kind == 1 else
                      SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=2, logit_bias={5: -3.0, 7: 2.0})
                      if kind == 2 else greedy(4 + i % 9))
    expected = _run_with_logprobs(make_core(model, async_scheduling="off", max_num_batched_tokens=24), PROMPTS, params)
    core = make_core(model, async_scheduling="on", max_num_batched_tokens=24)
    overlapped = _overlapped_steps(core)
    assert _run_with_logprobs(core, PROMPTS, params) == expected
    assert overlapped[0] > 10
    assert core.pipeline is not None
    core.pipeline.call(lambda: None)  # the forget tasks queued behind the last step
    assert core.runner.sampler._request_generators == {}
    assert_all_free(core)


def test_no_step_is_scheduled_while_a_prefill_runs_or_may_come() -> None:
    """A step with a prefill chunk, or one after which a prefill may come (a request waits), is waited out
    before the next step is scheduled: requests arriving meanwhile make that step."""
    core = make_core(tiny_model("llama"), async_scheduling="on", max_num_batched_tokens=24)
    pipeline = core.pipeline
    assert pipeline is not None
    seen: list[bool] = []
    inner = core.scheduler.schedule

    def schedule():  # type: ignore[no-untyped-def]
        in_flight = pipeline.in_flight  # a step in flight, and a prefill running or possible next
        seen.append(in_flight is not None and (in_flight.is_long or bool(core.scheduler.waiting)))
        return inner()

    core.scheduler.schedule = schedule  # type: ignore[method-assign]
    expected = run_to_completion(make_core(tiny_model("llama"), max_num_batched_tokens=24), PROMPTS, PARAMS)
    assert _run(core, PROMPTS, PARAMS) == expected
    assert len(seen) > 20 and not any(seen)


def test_requests_added_before_schedule_make_the_next_step() -> None:
    """`before_schedule` runs in an overlapped step just before scheduling (the server adds what arrived
    while the running step ran): a request it adds is scheduled in that very step."""
    model = tiny_model("llama")
    core = make_core(model, async_scheduling="on")
    core.add_request("first", PROMPTS[5], greedy(12), ())
    for _ in range(4):
        core.step()
    added: list[str] = []

    def arrive() -> None:
        if not added:
            core.add_request("late", PROMPTS[3], greedy(5), ())
            added.append("late")

    core.before_schedule = arrive
    core.step()
    late = core.scheduler.requests["late"]
    assert late.times.first_scheduled is not None  # in the step that step() just submitted
    tokens: dict[str, list[int]] = {"first": [], "late": []}
    while core.has_unfinished:
        for out in core.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    assert tokens["late"] == run_to_completion(make_core(model), [PROMPTS[3]], greedy(5))[0]
    assert_all_free(core)


def test_a_history_reading_request_that_arrives_before_schedule_steps_synchronously() -> None:
    """The overlap decision is taken before `before_schedule` adds what arrived: a request that reads its
    history (penalties) arriving there must not join an overlapped step (its sampling on the device thread
    would read the pending token the engine thread appends meanwhile: an IndexError, seen in CI)."""
    model = tiny_model("llama")
    core = make_core(model, async_scheduling="on")
    core.add_request("first", PROMPTS[5], greedy(16), ())
    tokens: dict[str, list[int]] = {"first": [], "late": []}
    for _ in range(4):
        for out in core.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    penalized = SamplingParams(max_tokens=6, temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5)
    added: list[str] = []

    def arrive() -> None:
        if not added:
            core.add_request("late", PROMPTS[3], penalized, ())
            added.append("late")

    core.before_schedule = arrive
    while core.has_unfinished:
        for out in core.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    assert tokens["late"] == run_to_completion(make_core(model), [PROMPTS[3]], penalized)[0]
    assert tokens["first"] == run_to_completion(make_core(model), [PROMPTS[5]], greedy(16))[0]
    assert_all_free(core)


def test_every_step_runs_on_the_device_thread() -> None:
    core = make_core(tiny_model("llama"), async_scheduling="on")
    threads: set[str] = set()
    inner = core.runner.run

    def recorded(prepared, *args):  # type: ignore[no-untyped-def]
        threads.add(threading.current_thread().name)
        return inner(prepared, *args)

    core.runner.run = recorded  # type: ignore[method-assign]
    params = [greedy(5), SamplingParams(max_tokens=5, temperature=0.0, logprobs=1)]  # overlapped and not
    _run(core, PROMPTS[:2], params)
    assert len(threads) == 1 and next(iter(threads)).startswith("tokenmill-device")


def test_no_block_leaks_after_random_requests_with_aborts() -> None:
    core = make_core(tiny_model("llama"), num_blocks=24, max_num_batched_tokens=40, max_num_seqs=16,
                     policy="priority", async_scheduling="on")
    def params(rng: random.Random) -> SamplingParams:  # mostly plain (overlapping), some reading history
        return greedy(rng.randint(1, 8)) if rng.random() < 0.7 else _random_params(rng)

    num_aborted, num_finished = run_random_requests_with_aborts(core, random.Random(1), 400, params)
    assert num_aborted > 20 and num_finished + num_aborted == 400
    assert core.scheduler.stats.num_preemptions > 0
    assert_all_free(core)


def test_a_pending_token_never_reaches_a_block_hash() -> None:
    request = Request("r", list(range(7)), greedy(4))
    request.token_ids.append(PLACEHOLDER)  # fills the second block of 4
    update_block_hashes(request, 4)
    assert len(request.block_hashes) == 1
    request.token_ids[-1] = 7
    update_block_hashes(request, 4)
    assert len(request.block_hashes) == 2


def test_a_request_preempted_with_a_pending_token_waits_for_it() -> None:
    """Its prefill needs every input token: it is not admitted until the running step's result is in."""
    core = make_core(tiny_model("llama"), async_scheduling="off")
    request = core.add_request("r", [1, 2, 3, 4, 5], greedy(4), ())
    assert core.scheduler._first_chunk(request, 100) is not None
    request.token_ids.append(PLACEHOLDER)
    assert core.scheduler._first_chunk(request, 100) is None


def test_only_on_turns_it_on_and_never_with_speculation() -> None:
    assert async_scheduling_enabled("on", speculative=False)
    assert not async_scheduling_enabled("auto", speculative=False)
    assert not async_scheduling_enabled("off", speculative=False)
    assert not async_scheduling_enabled("on", speculative=True)
    assert make_core(tiny_model("llama")).pipeline is None
    assert make_core(tiny_model("llama"), async_scheduling="on").pipeline is not None
    with pytest.raises(TokenmillError, match="speculative"):
        EngineConfig(ModelConfig("tiny"), scheduler=SchedulerConfig(async_scheduling="on"),
                     speculative=SpeculativeConfig("ngram"))
    with pytest.raises(TokenmillError, match="async_scheduling"):
        SchedulerConfig(async_scheduling="yes")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_graph_staged_steps_take_their_pending_tokens(arch: ArchName) -> None:
    """With decode graphs (their CPU stand-in: the static buffers run eagerly), a step is staged on the
    device thread after its pending tokens are in: plain decodes, and short prompts arriving beside
    decodes (host-built rows)."""
    from tests.engine.test_cuda_graphs import _graph_core

    model = tiny_model(arch)
    prompts = random_prompts([3, 9, 2, 5, 7, 4], seed=7)
    params = [greedy(n) for n in (12, 5, 9, 3, 7, 14)]
    expected = run_to_completion(make_core(model), prompts, params)
    core = _graph_core(model, async_scheduling="on")  # type: ignore[arg-type]
    graphs = core.runner.graphs
    assert graphs is not None
    staged = {"plain": 0, "rows": 0}
    stage, stage_rows = graphs.stage, graphs.stage_rows

    def counted(kind, inner):  # type: ignore[no-untyped-def]
        def call(arg):  # type: ignore[no-untyped-def]
            staged[kind] += 1
            return inner(arg)
        return call

    graphs.stage, graphs.stage_rows = counted("plain", stage), counted("rows", stage_rows)  # type: ignore[method-assign]
    overlapped = _overlapped_steps(core)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for step in range(200):
        if step < len(prompts):  # one arrival per step: each prompt lands beside running decodes
            core.add_request(str(step), prompts[step], params[step], ())
        elif not core.has_unfinished:
            break
        for out in core.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    assert [tokens[str(i)] for i in range(len(prompts))] == expected
    assert staged["plain"] > 5 and staged["rows"] > 2 and overlapped[0] > 10
    assert_all_free(core)
