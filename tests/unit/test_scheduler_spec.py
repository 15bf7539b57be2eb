"""Scheduler decisions with speculative proposals: exact token counts, rollback of
num_computed_tokens past rejected proposals, no prefix-cache publication of their KV slots, and
the stop rules inside an accepted run. No model runs: the fake runner "verifies" by returning
whatever tokens a test says the target emitted."""

from __future__ import annotations

from tokenmill.config import SchedulerConfig
from tokenmill.engine.block_hash import update_block_hashes
from tokenmill.engine.interfaces import RunnerOutput, SampledTokens, SchedulerOutput
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import EngineOutput, FinishReason, Request, RequestStatus, SamplingParams
from tokenmill.engine.scheduler import Scheduler

BS = 4
FIRST = 7  # the token the prefill step samples


def _scheduler(num_blocks: int = 64, budget: int = 2048, max_model_len: int = 1024) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget), KVCacheManager(num_blocks, BS, True),
                     max_model_len)


def _request(rid: str, num_prompt: int, max_tokens: int | None = 100, eos: tuple[int, ...] = (),
             first_token: int = 100, **params: object) -> Request:
    prompt = list(range(first_token, first_token + num_prompt))
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), eos)  # type: ignore[arg-type]


def _run(sched: Scheduler, emitted: dict[str, list[int]]) -> tuple[SchedulerOutput, list[EngineOutput]]:
    out = sched.schedule()
    sampled = {s.request.request_id: SampledTokens(emitted[s.request.request_id],
                                                   [None] * len(emitted[s.request.request_id]))
               for s in out.scheduled if s.needs_sample}
    return out, sched.update(out, RunnerOutput(sampled=sampled))


def _plan(out: SchedulerOutput) -> list[tuple[str, int, int, list[int]]]:
    return [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens, s.spec_token_ids) for s in out.scheduled]


def _prefilled(sched: Scheduler, request: Request) -> Request:
    sched.add(request)
    _run(sched, {request.request_id: [FIRST]})
    return request


def test_proposals_are_scheduled_after_the_known_token_and_rolled_back_past_the_rejected() -> None:
    sched = _scheduler()
    r = _prefilled(sched, _request("a", 6))  # 7 tokens, 6 computed
    r.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    assert _plan(out) == [("a", 6, 4, [1, 2, 3])]
    assert out.scheduled[0].needs_sample and out.scheduled[0].num_sample_rows == 4
    assert r.spec_token_ids == []  # consumed
    outputs = sched.update(out, RunnerOutput(sampled={"a": SampledTokens([1, 2, 9], [None] * 3)}))
    assert outputs[0].new_token_ids == [1, 2, 9]
    assert r.output_token_ids == [FIRST, 1, 2, 9]
    assert r.num_computed_tokens == 9 == r.num_tokens - 1  # proposal 3 (position 9) was rejected
    out, _ = _run(sched, {"a": [5]})
    assert _plan(out) == [("a", 9, 1, [])]
    assert sched.step_stats.num_drafts == 0


def test_all_accepted_gives_a_bonus_token_and_keeps_every_slot() -> None:
    sched = _scheduler()
    r = _prefilled(sched, _request("a", 6))
    r.spec_token_ids = [1, 2, 3]
    _run(sched, {"a": [1, 2, 3, 4]})
    assert r.num_computed_tokens == 10 and r.num_tokens == 11
    stats = sched.step_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 3)
    assert stats.accepted_per_position == [1, 1, 1]
    assert stats.num_generation_tokens == 4


def test_rejected_slots_are_never_published_to_the_prefix_cache() -> None:
    sched = _scheduler()
    r = _prefilled(sched, _request("a", 4))  # block 0 full and published; token 4 not computed
    assert sched.kv.num_registered["a"] == 1
    r.spec_token_ids = [1, 2, 3]  # positions 5..7: with token 4 they would fill block 1
    out, _ = _run(sched, {"a": [9]})  # all rejected
    assert _plan(out) == [("a", 4, 4, [1, 2, 3])]
    assert len(sched.kv.block_tables["a"]) == 2
    assert r.num_computed_tokens == 5
    assert sched.kv.num_registered["a"] == 1
    assert len(sched.kv.pool.cached) == 1
    # Three decodes later block 1 holds real tokens only and is published under their hash.
    for token in (10, 11, 12):
        _run(sched, {"a": [token]})
    assert r.token_ids[4:8] == [FIRST, 9, 10, 11] and r.num_computed_tokens == 8
    update_block_hashes(r, BS)
    assert sched.kv.pool.lookup(r.block_hashes[1]) == sched.kv.block_tables["a"][1]


def test_accepted_proposals_reach_the_prefix_cache_once_computed() -> None:
    sched = _scheduler()
    r = _prefilled(sched, _request("a", 4))
    r.spec_token_ids = [1, 2, 3]
    _run(sched, {"a": [1, 2, 3, 9]})  # positions 4..7 computed and verified: block 1
    assert r.num_computed_tokens == 8
    assert sched.kv.num_registered["a"] == 2
    other = _request("b", 0)
    other.token_ids = other.prompt_token_ids = [*r.token_ids[:8], 55]
    assert sched.kv.find_cached_prefix(other) == sched.kv.block_tables["a"][:2]


def test_proposals_are_cut_to_the_token_budget() -> None:
    sched = _scheduler(budget=3)
    r = _prefilled(sched, _request("a", 3))
    r.spec_token_ids = [1, 2, 3, 4]
    out, _ = _run(sched, {"a": [1, 2, 5]})
    assert _plan(out) == [("a", 3, 3, [1, 2])]
    assert r.num_computed_tokens == 6


def test_a_budget_of_one_token_schedules_no_proposal() -> None:
    sched = _scheduler(budget=1)
    r = _request("a", 1)
    sched.add(r)
    _run(sched, {"a": [FIRST]})
    r.spec_token_ids = [1, 2]
    out, _ = _run(sched, {"a": [3]})
    assert _plan(out) == [("a", 1, 1, [])]


def test_proposals_are_cut_to_max_tokens_and_the_context() -> None:
    sched = _scheduler()
    r = _prefilled(sched, _request("a", 4, max_tokens=3))  # 1 output, 2 more allowed
    r.spec_token_ids = [1, 2, 3]
    out, outputs = _run(sched, {"a": [1, 2]})
    assert _plan(out) == [("a", 4, 2, [1])]  # one proposal plus the target's token is max_tokens
    assert outputs[0].finish_reason is FinishReason.LENGTH
    sched = _scheduler(max_model_len=8)
    r = _prefilled(sched, _request("b", 5, max_tokens=None))  # 6 tokens: 2 more fit the context
    r.spec_token_ids = [1, 2, 3]
    out, _ = _run(sched, {"b": [1, 2]})
    assert _plan(out) == [("b", 5, 2, [1])]


def test_eos_inside_an_accepted_run_ends_the_request_there() -> None:
    sched = _scheduler()
    r = _prefilled(sched, _request("a", 4, eos=(50,)))
    r.spec_token_ids = [1, 50, 3]
    _, outputs = _run(sched, {"a": [1, 50, 3, 4]})
    assert outputs[0].new_token_ids == [1, 50]
    assert outputs[0].finish_reason is FinishReason.STOP
    assert r.status is RequestStatus.FINISHED and "a" not in sched.kv.block_tables
    assert sched.kv.pool.num_free == 64


def test_stop_token_and_max_tokens_inside_an_accepted_run() -> None:
    sched = _scheduler()
    r = _prefilled(sched, _request("a", 4, stop_token_ids=[60]))
    r.spec_token_ids = [1, 2, 60]
    _, outputs = _run(sched, {"a": [1, 2, 60, 8]})
    assert (outputs[0].new_token_ids, outputs[0].finish_reason) == ([1, 2, 60], FinishReason.STOP)
    sched = _scheduler()
    r = _prefilled(sched, _request("b", 4, max_tokens=3))
    r.spec_token_ids = [1]
    _, outputs = _run(sched, {"b": [1, 2]})
    assert (r.output_token_ids, outputs[0].finish_reason) == ([FIRST, 1, 2], FinishReason.LENGTH)


def test_min_tokens_lets_an_early_eos_in_an_accepted_run_pass() -> None:
    sched = _scheduler()
    r = _prefilled(sched, _request("a", 4, eos=(50,), min_tokens=3))  # 1 output so far
    r.spec_token_ids = [50, 50, 2]
    _, outputs = _run(sched, {"a": [50, 50, 2, 3]})
    # outputs 2 (50) is before min_tokens; output 3 (50) reaches it and stops.
    assert outputs[0].new_token_ids == [50, 50]
    assert outputs[0].finish_reason is FinishReason.STOP


def test_no_room_for_proposals_drops_them_instead_of_preempting() -> None:
    sched = _scheduler(num_blocks=3)
    a, b = _request("a", 4, first_token=100), _request("b", 3, first_token=200)
    sched.add(a)
    sched.add(b)
    _run(sched, {"a": [FIRST], "b": [FIRST]})  # one block each, one left
    a.spec_token_ids = [1, 2, 3, 4]  # positions 4..8 would need two more blocks for a
    out, _ = _run(sched, {"a": [5], "b": [6]})
    assert _plan(out) == [("a", 4, 1, []), ("b", 3, 1, [])]
    assert out.num_preempted == 0 and sched.kv.pool.num_free == 0


def test_preemption_clears_proposals() -> None:
    sched = _scheduler()
    b = _prefilled(sched, _request("b", 4, first_token=200))
    b.spec_token_ids = [1, 2]
    sched._preempt(b)
    assert b.spec_token_ids == [] and b.status is RequestStatus.PREEMPTED


def test_acceptance_moving_average_per_request() -> None:
    sched = _scheduler()
    r = _prefilled(sched, _request("a", 4))
    r.spec_token_ids = [1, 2]
    _run(sched, {"a": [9]})
    assert r.spec_stats.num_drafts == 1 and r.spec_stats.num_accepted_tokens == 0
    assert r.spec_stats.recent_acceptance < 1.0
    assert r.spec_stats.mean_accepted_length == 1.0
