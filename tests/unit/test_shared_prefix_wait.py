"""In-batch prefix sharing: a waiting request whose next uncached prompt blocks (>= shared_prefix_wait_tokens)
a running request as urgent is computing waits for them, and finds them cached; requests behind it are not
held up. Exact scheduling decisions over a fake request set (block size 4, so 128 tokens = 32 blocks)."""

from __future__ import annotations

from tokenmill.config import SchedulerConfig
from tokenmill.engine.interfaces import RunnerOutput, SampledTokens, SchedulerOutput
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.service_class import ServiceClass

BS = 4
SHARED = list(range(1000, 1160))  # 160 tokens: 40 full blocks every sibling shares


def _scheduler(wait_tokens: int = 128, budget: int = 2048) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, shared_prefix_wait_tokens=wait_tokens)
    return Scheduler(config, KVCacheManager(256, BS, True), 1024)


def _request(rid: str, tokens: list[int], arrival: float, klass: ServiceClass = ServiceClass.STANDARD) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), (), 0, arrival, service_class=klass)


def _step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sampled = {s.request.request_id: SampledTokens([7], [None]) for s in out.scheduled if s.needs_sample}
    sched.update(out, RunnerOutput(sampled=sampled))
    return out


def _plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]


def test_siblings_wait_a_step_for_the_shared_prompt_and_others_go_on() -> None:
    sched = _scheduler()
    sched.add(_request("a", [*SHARED, 1, 2], arrival=0))
    sched.add(_request("b", [*SHARED, 3, 4], arrival=1))  # shares 160 tokens with a: waits
    sched.add(_request("other", list(range(5000, 5010)), arrival=2))  # behind b, shares nothing: goes
    assert _plan(_step(sched)) == [("a", 0, 162), ("other", 0, 10)]
    assert _plan(_step(sched)) == [("a", 162, 1), ("other", 10, 1), ("b", 160, 2)]  # b: the prompt was cached


def test_a_short_shared_prefix_or_a_less_urgent_computer_is_not_waited_for() -> None:
    sched = _scheduler(wait_tokens=200)  # 160 shared tokens are fewer
    sched.add(_request("a", [*SHARED, 1], arrival=0))
    sched.add(_request("b", [*SHARED, 2], arrival=1))
    assert [rid for rid, _, _ in _plan(_step(sched))] == ["a", "b"]
    sched = _scheduler()
    sched.add(_request("batch", [*SHARED, 1], arrival=0, klass=ServiceClass.BATCH))
    _step(sched)
    sched.add(_request("chat", [*SHARED, 2, 3, 4], arrival=1, klass=ServiceClass.INTERACTIVE))
    # the batch request's prompt is computed by now (cached): the chat takes it; and had it not been, an
    # interactive request would not wait on a batch one
    assert ("chat", 160, 3) in _plan(_step(sched))


def test_chunked_prompts_are_waited_for_while_enough_of_the_shared_part_is_left() -> None:
    sched = _scheduler(wait_tokens=32, budget=64)  # the shared prompt takes three steps to compute
    sched.add(_request("a", [*SHARED, 1], arrival=0))
    sched.add(_request("b", [*SHARED, 2], arrival=1))
    assert _plan(_step(sched)) == [("a", 0, 64)]
    assert _plan(_step(sched)) == [("a", 64, 64)]  # b: 64 tokens cached, 96 shared ones left to a
    assert _plan(_step(sched)) == [("a", 128, 33)]  # 32 left: still worth the wait
    assert _plan(_step(sched)) == [("a", 161, 1), ("b", 160, 1)]
    sched = _scheduler(wait_tokens=128, budget=64)  # with 96 left, fewer than 128: b goes, computing them too
    sched.add(_request("a", [*SHARED, 1], arrival=0))
    sched.add(_request("b", [*SHARED, 2], arrival=1))
    assert _plan(_step(sched)) == [("a", 0, 64)]
    assert _plan(_step(sched)) == [("a", 64, 64)]  # the budget's all a's: b has no room anyway
    assert _plan(_step(sched)) == [("a", 128, 33), ("b", 128, 31)]


def test_off_with_zero() -> None:
    sched = _scheduler(wait_tokens=0)
    sched.add(_request("a", [*SHARED, 1], arrival=0))
    sched.add(_request("b", [*SHARED, 2], arrival=1))
    assert [rid for rid, _, _ in _plan(_step(sched))] == ["a", "b"]
