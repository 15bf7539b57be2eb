"""Scheduler decisions over a fake request set and a tiny block pool; no model runs.

A step is schedule() then update() with a fixed token for every request whose chunk reached its
last known token, which is all the scheduler needs to know about the model.
"""

from __future__ import annotations

import pytest

from tokenmill.config import SchedulerConfig
from tokenmill.engine.interfaces import RunnerOutput, SampledTokens, SchedulerOutput
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import EngineOutput, FinishReason, Request, RequestStatus, SamplingParams
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.stop import check_stop

BS = 4
TOKEN = 7  # what the fake model always samples


def _scheduler(num_blocks: int = 64, budget: int = 2048, max_num_seqs: int = 64, policy: str = "fcfs",
               prefix: bool = True, chunked: bool = True, max_model_len: int = 1024) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, policy=policy,
                             enable_chunked_prefill=chunked)
    return Scheduler(config, KVCacheManager(num_blocks, BS, prefix), max_model_len)


def _request(rid: str, num_prompt: int, arrival: float, priority: int = 0, max_tokens: int = 100,
             first_token: int = 0, **params: object) -> Request:
    prompt = list(range(first_token, first_token + num_prompt))
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), (), priority, arrival)  # type: ignore[arg-type]


def _update(sched: Scheduler, out: SchedulerOutput, token: int = TOKEN) -> list[EngineOutput]:
    sampled = {s.request.request_id: SampledTokens([token], [None]) for s in out.scheduled if s.needs_sample}
    return sched.update(out, RunnerOutput(sampled=sampled))


def _step(sched: Scheduler, token: int = TOKEN) -> tuple[SchedulerOutput, list[EngineOutput]]:
    out = sched.schedule()
    return out, _update(sched, out, token)


def _plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(request id, start, num_new_tokens) of every scheduled request, in scheduling order."""
    return [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]


# ---- token budget ----------------------------------------------------------------------------


def test_decodes_take_the_budget_first_then_a_chunk_of_the_waiting_prefill() -> None:
    sched = _scheduler(budget=8)
    for i in range(3):
        sched.add(_request(f"r{i}", 2, arrival=i, first_token=10 * i))
    out, outputs = _step(sched)
    assert _plan(out) == [("r0", 0, 2), ("r1", 0, 2), ("r2", 0, 2)]
    assert [o.new_token_ids for o in outputs] == [[TOKEN]] * 3
    sched.add(_request("w", 20, arrival=10, first_token=100))
    out, outputs = _step(sched)
    assert _plan(out) == [("r0", 2, 1), ("r1", 2, 1), ("r2", 2, 1), ("w", 0, 5)]
    assert not out.scheduled[3].needs_sample
    assert {o.request_id for o in outputs} == {"r0", "r1", "r2"}
    starts = []
    for _ in range(3):
        out, outputs = _step(sched)
        assert _plan(out)[:3] == [(f"r{i}", out.scheduled[i].num_computed_tokens, 1) for i in range(3)]
        starts.append(_plan(out)[3])
    assert starts == [("w", 5, 5), ("w", 10, 5), ("w", 15, 5)]
    assert "w" in {o.request_id for o in outputs}
    out, _ = _step(sched)
    assert _plan(out)[3] == ("w", 20, 1)  # now decoding like the others


@pytest.mark.parametrize("budget", [1, 3, 7, 64])
def test_chunked_prefill_covers_the_prompt_exactly_once(budget: int) -> None:
    sched = _scheduler(budget=budget)
    sched.add(_request("a", 10, arrival=0))
    covered = 0
    while True:
        out, outputs = _step(sched)
        [(rid, start, num_new)] = _plan(out)
        assert rid == "a" and start == covered and num_new == min(budget, 10 - covered)
        covered += num_new
        if covered < 10:
            assert outputs == []
        else:
            assert [o.new_token_ids for o in outputs] == [[TOKEN]]
            break
    out, _ = _step(sched)
    assert _plan(out) == [("a", 10, 1)]


def test_budget_exhausted_by_running_leaves_waiting_queued() -> None:
    sched = _scheduler(budget=2)
    sched.add(_request("a", 1, arrival=0))
    sched.add(_request("b", 1, arrival=1, first_token=5))
    _step(sched)
    sched.add(_request("c", 3, arrival=2, first_token=50))
    out, _ = _step(sched)
    assert _plan(out) == [("a", 1, 1), ("b", 1, 1)]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_max_num_seqs_caps_the_running_set() -> None:
    sched = _scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add(_request(f"r{i}", 3, arrival=i, first_token=10 * i))
    out, _ = _step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]
    out, _ = _step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in sched.waiting] == ["r2"]
    sched.abort("r0")
    out, _ = _step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["r1", "r2"]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    sched = _scheduler(budget=8, chunked=False)
    sched.add(_request("a", 5, arrival=0))
    sched.add(_request("b", 5, arrival=1, first_token=50))
    out, _ = _step(sched)
    assert _plan(out) == [("a", 0, 5)]  # b would need 5 of the 3 left: not cut, not admitted
    out, _ = _step(sched)
    assert _plan(out) == [("a", 5, 1), ("b", 0, 5)]


# ---- admission order ----------------------------------------------------------------------------


def test_fcfs_admits_by_arrival_time() -> None:
    sched = _scheduler()
    sched.add(_request("late", 2, arrival=3.0, priority=-5))
    sched.add(_request("early", 2, arrival=1.0, priority=5, first_token=10))
    sched.add(_request("middle", 2, arrival=2.0, first_token=20))
    out, _ = _step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["early", "middle", "late"]


def test_priority_admits_lowest_value_first_then_by_arrival() -> None:
    sched = _scheduler(policy="priority", max_num_seqs=1)
    sched.add(_request("p1-early", 2, arrival=1.0, priority=1))
    sched.add(_request("p0-late", 2, arrival=3.0, priority=0, first_token=10))
    sched.add(_request("p0-early", 2, arrival=2.0, priority=0, first_token=20))
    order = []
    for _ in range(3):
        out, _ = _step(sched)
        order.append(out.scheduled[0].request.request_id)
        sched.abort(order[-1])
    assert order == ["p0-early", "p0-late", "p1-early"]


def test_prefix_cache_hit_sets_computed_and_cached_tokens_on_admission() -> None:
    sched = _scheduler()
    sched.add(_request("a", 10, arrival=0))
    _step(sched)
    sched.add(_request("b", 11, arrival=1))
    out, _ = _step(sched)
    assert _plan(out) == [("a", 10, 1), ("b", 8, 3)]
    b = sched.requests["b"]
    assert b.num_cached_tokens == 8
    assert sched.kv.block_tables["b"][:2] == sched.kv.block_tables["a"][:2]


# ---- preemption -------------------------------------------------------------------------------


def _two_full_requests(policy: str = "fcfs", priorities: tuple[int, int] = (0, 0)) -> Scheduler:
    """a, b: 8-token prompts filling the 4-block pool; after one step each needs a third block."""
    sched = _scheduler(num_blocks=4, policy=policy)
    sched.add(_request("a", 8, arrival=0, priority=priorities[0]))
    sched.add(_request("b", 8, arrival=1, priority=priorities[1], first_token=100))
    _step(sched)
    assert sched.kv.pool.num_free == 0
    return sched


def test_preemption_evicts_the_least_urgent_running_request() -> None:
    sched = _two_full_requests()
    assert sched.kv.block_tables == {"a": [0, 1], "b": [2, 3]}
    b = sched.requests["b"]
    out, _ = _step(sched)
    assert _plan(out) == [("a", 8, 1)]
    assert out.num_preempted == 1
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.output_token_ids == [TOKEN]  # its output survives; only the KV is recomputed
    assert sched.stats.num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["b"]
    assert [r.request_id for r in sched.running] == ["a"]
    assert "b" not in sched.kv.block_tables
    # b's blocks were released tail first, so a's new block is b's last one.
    assert sched.kv.block_tables["a"] == [0, 1, 3]


def test_preempted_request_resumes_from_the_prefix_cache_and_finishes() -> None:
    sched = _two_full_requests()
    b = sched.requests["b"]
    _step(sched)  # b preempted
    sched.abort("a")
    out, _ = _step(sched)
    # b's first block survived in the cache (its second was reused by a); it recomputes the rest.
    assert _plan(out) == [("b", 4, 5)]
    assert b.status is RequestStatus.RUNNING and b.num_cached_tokens == 0
    assert b.output_token_ids == [TOKEN, TOKEN]


def test_the_request_needing_a_block_preempts_itself_when_it_is_the_least_urgent() -> None:
    sched = _scheduler(num_blocks=4)
    sched.add(_request("a", 6, arrival=0))  # 2 blocks, room for 2 more tokens
    sched.add(_request("b", 8, arrival=1, first_token=100))  # 2 full blocks
    _step(sched)
    out, _ = _step(sched)
    assert _plan(out) == [("a", 6, 1)]
    assert out.num_preempted == 1
    assert sched.requests["b"].status is RequestStatus.PREEMPTED
    assert sched.kv.block_tables == {"a": [0, 1]}


def test_priority_preemption_spares_the_more_urgent_request_even_if_it_arrived_later() -> None:
    sched = _two_full_requests(policy="priority", priorities=(1, 0))
    assert sched.kv.block_tables == {"b": [0, 1], "a": [2, 3]}  # b was admitted first
    out, _ = _step(sched)
    assert _plan(out) == [("b", 8, 1)]
    assert sched.requests["a"].status is RequestStatus.PREEMPTED
    assert sched.kv.block_tables == {"b": [0, 1, 3]}


def test_no_waiting_request_is_admitted_in_a_step_that_preempted() -> None:
    sched = _scheduler(num_blocks=5, policy="priority")
    sched.add(_request("a", 8, arrival=0))  # blocks 0, 1
    sched.add(_request("b", 12, arrival=1, first_token=100))  # blocks 2, 3, 4
    _step(sched)
    sched.add(_request("c", 2, arrival=2, priority=-1, first_token=200))  # fits in one block
    out, _ = _step(sched)
    assert _plan(out) == [("a", 8, 1)]
    assert out.num_preempted == 1
    assert sched.kv.pool.num_free == 2  # room for c, but not in this step
    assert [r.request_id for r in sched.waiting] == ["c", "b"]
    out, _ = _step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["a", "c"]


def test_preemption_loop_keeps_going_until_the_block_fits() -> None:
    sched = _scheduler(num_blocks=4, budget=64)
    sched.add(_request("a", 4, arrival=0))  # 1 full block
    sched.add(_request("b", 4, arrival=1, first_token=100))
    sched.add(_request("c", 4, arrival=2, first_token=200))
    sched.add(_request("d", 4, arrival=3, first_token=300))
    _step(sched)
    assert sched.kv.pool.num_free == 0
    out, _ = _step(sched)
    # a needs a block: d (least urgent) goes and a takes its block; b needs one: c goes.
    assert _plan(out) == [("a", 4, 1), ("b", 4, 1)]
    assert out.num_preempted == 2
    assert [r.request_id for r in sched.waiting] == ["c", "d"]
    assert sched.kv.pool.num_free == 0
    assert sched.kv.block_tables == {"a": [0, 3], "b": [1, 2]}


# ---- abort ------------------------------------------------------------------------------------


def test_abort_frees_blocks_of_running_and_removes_waiting() -> None:
    sched = _scheduler(num_blocks=8, max_num_seqs=1)
    sched.add(_request("a", 9, arrival=0))
    sched.add(_request("b", 3, arrival=1, first_token=50))
    _step(sched)
    assert sched.kv.pool.num_free == 5
    a = sched.abort("a")
    assert a is not None and a.finish_reason is FinishReason.ABORT and a.is_finished
    assert sched.kv.pool.num_free == 8 and "a" not in sched.kv.block_tables
    b = sched.abort("b")
    assert b is not None and b.status is RequestStatus.FINISHED
    assert len(sched.waiting) == 0 and len(sched.running) == 0 and not sched.has_work
    assert sched.abort("a") is None and sched.abort("nope") is None
    assert sched.stats.num_finished == 2


def test_abort_between_schedule_and_update_drops_the_result() -> None:
    sched = _scheduler()
    sched.add(_request("a", 5, arrival=0))
    out = sched.schedule()
    sched.abort("a")
    assert _update(sched, out) == []
    assert sched.kv.pool.num_free == 64
    assert all(b.ref_count == 0 for b in sched.kv.pool.blocks)


def test_abort_of_a_preempted_request() -> None:
    sched = _two_full_requests()
    _step(sched)
    assert sched.requests["b"].status is RequestStatus.PREEMPTED
    sched.abort("b")
    assert [r.request_id for r in sched.waiting] == [] and "b" not in sched.requests
    sched.abort("a")
    assert sched.kv.pool.num_free == 4


# ---- stop rules --------------------------------------------------------------------------------


def _with_output(params: SamplingParams, output: list[int], eos: tuple[int, ...] = (2,),
                 num_prompt: int = 3) -> Request:
    r = Request("r", list(range(10, 10 + num_prompt)), params, eos)
    r.token_ids.extend(output)
    return r


def _stop(params: SamplingParams, output: list[int], max_model_len: int = 1000) -> FinishReason | None:
    return check_stop(_with_output(params, output), max_model_len)


def test_stop_on_eos() -> None:
    assert _stop(SamplingParams(), [5, 2]) is FinishReason.STOP
    assert _stop(SamplingParams(), [2, 5]) is None


def test_stop_on_stop_token_ids() -> None:
    assert _stop(SamplingParams(stop_token_ids=[9]), [9]) is FinishReason.STOP
    assert _stop(SamplingParams(stop_token_ids=[9]), [8]) is None


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached() -> None:
    params = SamplingParams(min_tokens=3, stop_token_ids=[9])
    assert _stop(params, [2]) is None
    assert _stop(params, [5, 9]) is None
    assert _stop(params, [5, 5, 2]) is FinishReason.STOP
    assert _stop(params, [5, 5, 9]) is FinishReason.STOP


def test_ignore_eos_keeps_stop_token_ids() -> None:
    params = SamplingParams(ignore_eos=True, stop_token_ids=[9])
    assert _stop(params, [2]) is None
    assert _stop(params, [2, 9]) is FinishReason.STOP


def test_max_tokens_and_eos_on_the_same_token_is_a_stop() -> None:
    assert _stop(SamplingParams(max_tokens=2), [5, 6]) is FinishReason.LENGTH
    assert _stop(SamplingParams(max_tokens=2), [5]) is None
    assert _stop(SamplingParams(max_tokens=2), [5, 2]) is FinishReason.STOP


def test_context_limit_is_a_length_stop() -> None:
    params = SamplingParams(max_tokens=None)
    assert _stop(params, [5, 6], max_model_len=5) is FinishReason.LENGTH
    assert _stop(params, [5], max_model_len=5) is None


def test_update_finishes_and_frees_a_stopped_request() -> None:
    sched = _scheduler()
    sched.add(Request("e", [1, 2, 3], SamplingParams(max_tokens=10), (42,), 0, 0.0))
    sched.add(_request("l", 3, arrival=1, max_tokens=2, first_token=50))
    _, outputs = _step(sched, token=42)
    by_id = {o.request_id: o for o in outputs}
    assert by_id["e"].finish_reason is FinishReason.STOP and by_id["e"].finished
    assert by_id["l"].finish_reason is None
    assert "e" not in sched.requests and "e" not in sched.kv.block_tables
    _, outputs = _step(sched, token=42)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("l", FinishReason.LENGTH)]
    assert not sched.has_work
    assert sched.kv.pool.num_free == 64
    assert sched.stats.num_finished == 2


def test_context_limit_through_the_scheduler() -> None:
    sched = _scheduler(max_model_len=6)
    sched.add(_request("a", 4, arrival=0, max_tokens=None))
    _, outputs = _step(sched)
    assert outputs[0].finish_reason is None
    _, outputs = _step(sched)
    assert outputs[0].finish_reason is FinishReason.LENGTH
    assert sched.requests == {}
