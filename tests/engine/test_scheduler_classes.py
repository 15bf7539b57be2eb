"""SLO-aware step building over service classes, with a fixed step-time model; no model runs (the
online model and the core's feed into it: test_step_time_model.py).

The fixed model used throughout: a step takes 10 ms + 1 ms per token (+ 0 per sequence), and the
interactive TPOT target is 15 ms with margin 1.0, so a step holding interactive decodes may carry
5 tokens in all.
"""

from __future__ import annotations

import itertools
import random

import pytest

from tokenmill.config import SchedulerConfig, ServiceClassConfig, SLOTarget
from tokenmill.engine.interfaces import RunnerOutput, SampledTokens, SchedulerOutput
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import Request, RequestStatus, SamplingParams
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.service_class import ServiceClass
from tokenmill.engine.step_time import FixedStepTimeModel, OnlineStepTimeModel, StepTimeFit

BS = 4
TOKEN = 7
INT, STD, BAT = ServiceClass.INTERACTIVE, ServiceClass.STANDARD, ServiceClass.BATCH
LIMIT_S = 0.015
FIT = FixedStepTimeModel(base_s=0.010, per_token_s=0.001, per_seq_s=0.0)
_PROMPT_BASES = itertools.count(1)


def _classes(**overrides: object) -> ServiceClassConfig:
    values: dict[str, object] = {"interactive": SLOTarget(ttft_s=1.0, tpot_s=LIMIT_S),
                                 "standard": SLOTarget(ttft_s=5.0, tpot_s=0.5), "step_time_margin": 1.0,
                                 "min_prefill_chunk": 2, "unfitted_step_tokens": 5,
                                 "protected_slowdown": None}  # the relative bound has its own tests
    values.update(overrides)
    return ServiceClassConfig(**values)  # type: ignore[arg-type]


def _scheduler(num_blocks: int = 256, budget: int = 64, max_num_seqs: int = 64, policy: str = "fcfs",
               model: object = FIT, **classes: object) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, policy=policy,
                             service_classes=_classes(**classes))
    return Scheduler(config, KVCacheManager(num_blocks, BS, True), 1024, model)  # type: ignore[arg-type]


def _request(rid: str, num_prompt: int, arrival: float, cls: ServiceClass, max_tokens: int = 100,
             priority: int = 0) -> Request:
    base = 1000 * next(_PROMPT_BASES)
    prompt = [base + i for i in range(num_prompt)]  # distinct: no prefix-cache hits
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), (), priority, arrival, cls)


def _step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sampled = {s.request.request_id: SampledTokens([TOKEN], [None]) for s in out.scheduled if s.needs_sample}
    sched.update(out, RunnerOutput(sampled=sampled))
    return out


def _plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]


def _ids(out: SchedulerOutput) -> list[str]:
    return [s.request.request_id for s in out.scheduled]


def _batch_decoding(sched: Scheduler, n: int, num_prompt: int = 4, max_tokens: int = 100) -> None:
    """n batch requests alone (whole budget): one step prefills them all; they decode from then on."""
    for i in range(n):
        sched.add(_request(f"b{i}", num_prompt, arrival=i, cls=BAT, max_tokens=max_tokens))
    out = _step(sched)
    assert _plan(out) == [(f"b{i}", 0, num_prompt) for i in range(n)]


def _interactive_decoding(sched: Scheduler, n: int, max_tokens: int = 100) -> None:
    """Add n interactive prompts of 4 tokens and run their prefill step: batch pauses for it (no
    interactive decodes yet, so the prompts get the budget; the step is already over the limit)."""
    for i in range(n):
        sched.add(_request(f"i{i}", 4, arrival=100 + i, cls=INT, max_tokens=max_tokens))
    out = _step(sched)
    assert _plan(out) == [(f"i{i}", 0, 4) for i in range(n)]


# ---- exact step compositions -------------------------------------------------------------------


def test_batch_fills_only_the_budget_the_interactive_tpot_leaves_and_rotates() -> None:
    sched = _scheduler()
    _batch_decoding(sched, 6)
    _interactive_decoding(sched, 2)
    assert sched.last_plan.num_deferred == 6
    # 2 interactive decodes + 3 batch decodes = 5 tokens = 15 ms, the target: the longest-paused first.
    plans = [_plan(_step(sched)) for _ in range(3)]
    assert plans[0] == [("i0", 4, 1), ("i1", 4, 1), ("b0", 4, 1), ("b1", 4, 1), ("b2", 4, 1)]
    assert plans[1] == [("i0", 5, 1), ("i1", 5, 1), ("b3", 4, 1), ("b4", 4, 1), ("b5", 4, 1)]
    assert plans[2] == [("i0", 6, 1), ("i1", 6, 1), ("b0", 5, 1), ("b1", 5, 1), ("b2", 5, 1)]
    plan = sched.last_plan
    assert plan.scheduled_tokens == {"interactive": 2, "standard": 0, "batch": 3}
    assert plan.scheduled_seqs == {"interactive": 2, "standard": 0, "batch": 3}
    assert plan.num_deferred == 3 and plan.protected_class == "interactive"
    assert plan.step_time_limit_s == LIMIT_S and plan.predicted_step_time_s == pytest.approx(0.015)
    assert plan.step_time_fit == StepTimeFit(0.010, 0.001, 0.0, 0)


def test_batch_fills_at_most_protected_slowdown_over_the_interactive_work_alone() -> None:
    # 2 interactive decodes alone: 12 ms. Slowdown 0.1 allows 13.2 ms: one batch token (13 ms), not the
    # three the 15 ms target alone would allow.
    sched = _scheduler(protected_slowdown=0.1)
    _batch_decoding(sched, 6)
    _interactive_decoding(sched, 2)
    plans = [_plan(_step(sched)) for _ in range(2)]
    assert plans == [[("i0", 4, 1), ("i1", 4, 1), ("b0", 4, 1)], [("i0", 5, 1), ("i1", 5, 1), ("b1", 4, 1)]]
    assert sched.last_plan.step_time_limit_s == pytest.approx(0.0132)
    # A loose bound leaves the TPOT target as the limit.
    loose = _scheduler(protected_slowdown=1.0)
    _batch_decoding(loose, 6)
    _interactive_decoding(loose, 2)
    assert _ids(_step(loose)) == ["i0", "i1", "b0", "b1", "b2"]
    assert loose.last_plan.step_time_limit_s == LIMIT_S


def test_the_relative_bound_leaves_batch_alone_untouched() -> None:
    sched = _scheduler(protected_slowdown=0.0)
    _batch_decoding(sched, 6)
    assert _ids(_step(sched)) == [f"b{i}" for i in range(6)]  # nothing protected: the whole budget


def test_per_sequence_cost_limits_batch_sequences() -> None:
    # 10 ms + 0.5 ms/token + 1 ms/seq: 2 interactive decodes = 13 ms; each batch decode 1.5 ms: one fits.
    sched = _scheduler(model=FixedStepTimeModel(0.010, 0.0005, 0.001))
    _batch_decoding(sched, 3)
    _interactive_decoding(sched, 2)
    assert _ids(_step(sched)) == ["i0", "i1", "b0"]
    assert _ids(_step(sched)) == ["i0", "i1", "b1"]


def test_a_new_interactive_prompt_is_prefilled_in_chunks_that_fit_the_target() -> None:
    sched = _scheduler()
    _batch_decoding(sched, 2)
    _interactive_decoding(sched, 2)
    sched.add(_request("p", 10, arrival=200, cls=INT))
    # The decodes hold 2 tokens: the prompt gets the other 3, batch waits for it.
    assert _plan(_step(sched)) == [("i0", 4, 1), ("i1", 4, 1), ("p", 0, 3)]
    assert _plan(_step(sched)) == [("i0", 5, 1), ("i1", 5, 1), ("p", 3, 3)]
    assert _plan(_step(sched)) == [("i0", 6, 1), ("i1", 6, 1), ("p", 6, 3)]
    # Its last prompt token, then it decodes: 3 interactive tokens, room for both batch decodes.
    assert _plan(_step(sched)) == [("i0", 7, 1), ("i1", 7, 1), ("p", 9, 1), ("b0", 4, 1), ("b1", 4, 1)]
    assert _plan(_step(sched)) == [("i0", 8, 1), ("i1", 8, 1), ("p", 10, 1), ("b0", 5, 1), ("b1", 5, 1)]


def test_an_interactive_prompt_advances_min_prefill_chunk_when_decodes_fill_the_target() -> None:
    sched = _scheduler()
    _interactive_decoding(sched, 4)  # 4 decodes: 14 ms of the 15 ms target, room for 1 token < the floor of 2
    sched.add(_request("b0", 4, arrival=0, cls=BAT))
    sched.add(_request("p", 10, arrival=200, cls=INT))
    out = _step(sched)
    assert _plan(out)[-1] == ("p", 0, 2) and "b0" not in _ids(out)


def test_an_interactive_prompt_is_prefilled_whole_when_its_decodes_already_miss_the_target() -> None:
    # Chunking could not save the decodes' TPOT (16 ms > 15 ms whatever the prompt does); it would
    # only stretch the prompt's TTFT, so the prompt gets the budget. Batch still waits.
    sched = _scheduler()
    _interactive_decoding(sched, 6)
    sched.add(_request("b0", 4, arrival=0, cls=BAT))
    sched.add(_request("p", 10, arrival=200, cls=INT))
    out = _step(sched)
    assert _plan(out)[-1] == ("p", 0, 10) and "b0" not in _ids(out)


def test_standard_fills_before_batch_under_the_interactive_target() -> None:
    sched = _scheduler()
    sched.add(_request("b0", 4, arrival=0, cls=BAT))
    sched.add(_request("s0", 4, arrival=1, cls=STD))
    sched.add(_request("s1", 4, arrival=2, cls=STD))
    sched.add(_request("i0", 4, arrival=3, cls=INT))
    # Nothing decodes yet: the interactive prompt first, then the fillers within 5 tokens (one 1-token chunk).
    assert _plan(_step(sched)) == [("i0", 0, 4), ("s0", 0, 1)]
    assert _plan(_step(sched)) == [("i0", 4, 1), ("s0", 1, 3), ("s1", 0, 1)]
    assert _plan(_step(sched)) == [("i0", 5, 1), ("s0", 4, 1), ("s1", 1, 3)]
    assert _plan(_step(sched)) == [("i0", 6, 1), ("s0", 5, 1), ("s1", 4, 1), ("b0", 0, 2)]


def test_standard_alone_with_batch_is_protected_by_its_own_target() -> None:
    # Standard's 0.5 s target at 10 ms + 1 ms/token: 490 tokens; the budget (64) binds first.
    sched = _scheduler(budget=64, standard=SLOTarget(tpot_s=0.016))
    sched.add(_request("s0", 4, arrival=0, cls=STD))
    sched.add(_request("b0", 4, arrival=1, cls=BAT))
    sched.add(_request("b1", 4, arrival=2, cls=BAT))
    assert _plan(_step(sched)) == [("s0", 0, 4), ("b0", 0, 2)]
    assert _plan(_step(sched)) == [("s0", 4, 1), ("b0", 2, 2), ("b1", 0, 3)]
    assert sched.last_plan.protected_class == "standard"


# ---- the TPOT target is never broken by batch work ----------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batch_never_runs_when_it_would_push_the_interactive_step_over_target(seed: int) -> None:
    rng = random.Random(seed)
    fit = FixedStepTimeModel(0.004, 0.0005, 0.0008)
    limit = 0.02
    sched = _scheduler(model=fit, interactive=SLOTarget(tpot_s=limit), min_prefill_chunk=1)
    n = 0
    batch_ran_under_interactive = 0
    for step in range(300):
        if rng.random() < 0.15:
            cls = rng.choice([INT, STD, BAT, BAT])
            sched.add(_request(f"r{n}", rng.randint(1, 40), arrival=step, cls=cls, max_tokens=rng.randint(1, 30)))
            n += 1
        out = _step(sched)
        classes = [s.request.service_class for s in out.scheduled]
        interactive_decodes = [s for s in out.scheduled if s.request.service_class is INT and s.num_new_tokens == 1
                               and s.num_computed_tokens >= s.request.num_prompt_tokens]
        if interactive_decodes and any(c is not INT for c in classes):
            batch_ran_under_interactive += 1
            predicted = fit.fit().predict(out.num_tokens, len(out.scheduled))  # type: ignore[union-attr]
            assert predicted <= limit + 1e-12, (step, _plan(out))
    assert batch_ran_under_interactive > 10  # the property was exercised, not vacuous


# ---- alone, batch gets the whole budget -----------------------------------------------------


def _trace(sched: Scheduler, requests: list[Request], steps: int) -> list[list[tuple[str, int, int]]]:
    for r in requests:
        sched.add(r)
    return [_plan(_step(sched)) for _ in range(steps)]


def test_after_interactive_traffic_batch_steps_end_within_a_share_of_the_ttft_target() -> None:
    """A chat that arrives during a batch prefill waits for the step in flight: while chats are
    recent, steps without protected work stay under arrival_step_share x the interactive TTFT target
    (FIT: 10 ms + 1 ms a token; 0.25 x 1 s -> 240 tokens); before any chat, the whole budget."""
    sched = _scheduler(num_blocks=512, budget=1024, arrival_step_share=0.25)
    sched.add(_request("b0", 600, arrival=0, cls=BAT))
    assert _plan(_step(sched)) == [("b0", 0, 600)]  # no chat seen yet: one step, whole prompt
    sched.add(_request("i0", 4, arrival=1, cls=INT, max_tokens=1))
    _step(sched)  # the chat runs (and finishes): interactive traffic is now recent
    assert "i0" not in sched.requests
    sched.add(_request("b1", 600, arrival=2, cls=BAT))
    assert _plan(_step(sched)) == [("b0", 601, 1), ("b1", 0, 239)]  # 240 tokens in all: b0's decode + a chunk
    sched.classes = _classes(arrival_step_share=0.25, interactive_recent_s=0.0)
    assert _plan(_step(sched)) == [("b0", 602, 1), ("b1", 239, 361)]  # the chat is no longer recent


def test_with_no_recent_chat_batch_steps_still_end_within_a_share_of_the_ttft_target() -> None:
    """The first chat after a quiet spell waits for the batch step in flight: even with no
    interactive traffic seen, steps stay within quiet_step_share x the TTFT target (FIT: 10 ms +
    1 ms a token; 1.0 x 1 s -> 990 tokens); None gives the whole budget."""
    sched = _scheduler(num_blocks=1024, budget=2048)
    sched.add(_request("b0", 1500, arrival=0, cls=BAT))
    assert _plan(_step(sched)) == [("b0", 0, 990)]
    sched = _scheduler(num_blocks=1024, budget=2048, quiet_step_share=None)
    sched.add(_request("b0", 1500, arrival=0, cls=BAT))
    assert _plan(_step(sched)) == [("b0", 0, 1500)]


def test_batch_alone_is_scheduled_exactly_as_without_classes() -> None:
    def requests(cls: ServiceClass) -> list[Request]:
        return [_request(f"r{i}", 4 + i, arrival=i, cls=cls, max_tokens=5 + i) for i in range(12)]

    with_classes = _trace(_scheduler(budget=64, max_num_seqs=8), requests(BAT), 80)
    without = _trace(_scheduler(budget=64, max_num_seqs=8, enabled=False), requests(STD), 80)
    assert with_classes == without
    assert with_classes[0] == [(f"r{i}", 0, 4 + i) for i in range(8)]  # the whole max_num_seqs
    assert with_classes[5] == [(f"r{i}", 4 + i + 4, 1) for i in range(1, 8)] + [("r8", 0, 12)]  # the whole budget
    assert sum(n for plan in with_classes for _, _, n in plan) == sum(4 + i + 5 + i - 1 for i in range(12))


def test_standard_alone_and_interactive_alone_keep_their_whole_budget() -> None:
    sched = _scheduler(budget=32)
    for i in range(3):
        sched.add(_request(f"s{i}", 20, arrival=i, cls=STD))
    assert _plan(_step(sched)) == [("s0", 0, 20), ("s1", 0, 12)]
    assert sched.last_plan.protected_class is None  # nothing lower to hold back


# ---- memory: batch is preempted first; paused batch keeps its blocks ----------------------------


def _until_preemption(sched: Scheduler) -> SchedulerOutput:
    """4 blocks of 4: b0 (older) and i0 take 2 each for 7 prompt tokens; both decode until the
    8th token needs a third block, which only a preemption frees."""
    sched.add(_request("b0", 7, arrival=0, cls=BAT))
    _step(sched)
    sched.add(_request("i0", 7, arrival=1, cls=INT))
    for _ in range(5):
        out = _step(sched)
        if out.num_preempted:
            return out
    raise AssertionError("no preemption")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_batch_is_preempted_first_when_blocks_run_short(policy: str) -> None:
    out = _until_preemption(_scheduler(num_blocks=4, policy=policy))
    assert out.num_preempted == 1 and _plan(out) == [("i0", 8, 1)]
    assert sched_status(out, "i0") is RequestStatus.RUNNING
    assert sched_status(out, "b0") is RequestStatus.PREEMPTED


def test_without_classes_the_same_shortage_preempts_the_younger_interactive_request() -> None:
    out = _until_preemption(_scheduler(num_blocks=4, enabled=False))
    assert sched_status(out, "i0") is RequestStatus.PREEMPTED
    assert sched_status(out, "b0") is RequestStatus.RUNNING


def sched_status(out: SchedulerOutput, rid: str) -> RequestStatus:
    for s in out.scheduled:
        if s.request.request_id == rid:
            return s.request.status
    return RequestStatus.PREEMPTED  # not in the step: it was the victim (checked by num_preempted)


def test_a_paused_batch_request_keeps_its_blocks_and_resumes_without_recompute() -> None:
    sched = _scheduler()
    _batch_decoding(sched, 6)
    _interactive_decoding(sched, 2)
    tables = {f"b{i}": list(sched.kv.block_tables[f"b{i}"]) for i in range(6)}
    out = _step(sched)  # b3..b5 paused
    assert _ids(out) == ["i0", "i1", "b0", "b1", "b2"]
    for rid in ("b3", "b4", "b5"):
        request = sched.requests[rid]
        assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == 4
        assert sched.kv.block_tables[rid] == tables[rid]
    assert _plan(_step(sched))[2:] == [("b3", 4, 1), ("b4", 4, 1), ("b5", 4, 1)]
    assert sched.stats.num_preemptions == 0


def test_an_interactive_prompt_preempts_paused_batch_for_blocks_rather_than_wait() -> None:
    sched = _scheduler(num_blocks=6)
    _batch_decoding(sched, 3, num_prompt=8)  # 3 x 2 blocks + decode: the pool is full
    _step(sched)
    sched.add(_request("i0", 4, arrival=100, cls=INT))
    out = _step(sched)
    assert ("i0", 0, 4) in _plan(out) and out.num_preempted >= 1
    assert sched.requests["b2"].status is RequestStatus.PREEMPTED  # the least urgent batch request


def test_interactive_is_admitted_past_max_num_seqs_of_batch_which_then_pauses() -> None:
    sched = _scheduler(max_num_seqs=3)
    _batch_decoding(sched, 3)
    sched.add(_request("i0", 4, arrival=100, cls=INT))
    assert _plan(_step(sched)) == [("i0", 0, 4), ("b0", 4, 1)]  # 4 running, 2 scheduled
    assert _ids(_step(sched)) == ["i0", "b1", "b2"]  # at most 3 a step: one batch request pauses


# ---- no starvation ------------------------------------------------------------------------------


def test_batch_finishes_and_never_pauses_long_under_intermittent_interactive_load() -> None:
    sched = _scheduler()
    _batch_decoding(sched, 6, max_tokens=40)
    last_ran = {f"b{i}": 0 for i in range(6)}
    longest_pause = 0
    n = 0
    for step in range(1, 400):
        if step % 10 == 1 and step < 200:  # a short chat every 10 steps, for the first 200
            sched.add(_request(f"i{n}", 4, arrival=1000 + step, cls=INT, max_tokens=6))
            n += 1
        out = _step(sched)
        for rid in _ids(out):
            if rid in last_ran:
                longest_pause = max(longest_pause, step - last_ran[rid] - 1)
                last_ran[rid] = step
        if not sched.requests:
            break
    assert not sched.requests  # every batch request finished
    assert sched.stats.num_preemptions == 0
    assert longest_pause <= 2  # 6 batch decodes share 3 slots, plus the one prefill step


def test_priority_orders_within_the_batch_class() -> None:
    sched = _scheduler(policy="priority")
    for i, prio in enumerate([5, 0, 5, 5]):
        sched.add(_request(f"b{i}", 4, arrival=i, cls=BAT, priority=prio))
    _step(sched)
    _interactive_decoding(sched, 2)
    # 3 batch slots: b1 (priority 0) every step, the priority-5 ones share the other two.
    assert _ids(_step(sched))[2:] == ["b1", "b0", "b2"]
    assert _ids(_step(sched))[2:] == ["b1", "b3", "b0"]


# ---- without a fit yet: a conservative token count ---------------------------------------------


def test_until_the_model_is_fitted_a_protected_step_holds_unfitted_step_tokens() -> None:
    sched = _scheduler(model=OnlineStepTimeModel(min_samples=1000))
    _batch_decoding(sched, 6)
    _interactive_decoding(sched, 2)
    out = _step(sched)
    assert out.num_tokens == 5 and _ids(out) == ["i0", "i1", "b0", "b1", "b2"]
    assert sched.last_plan.predicted_step_time_s is None and sched.last_plan.step_time_fit is None
