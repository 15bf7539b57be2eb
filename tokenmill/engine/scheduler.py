"""Token-budget scheduler: moves each request's `num_computed_tokens` towards `num_tokens`.

One step, within `max_num_batched_tokens` and the free KV blocks:
  1. running requests, most urgent first: a decode token each, or the next prefill chunk;
     when blocks run out, the least urgent running request is preempted (recompute: its
     blocks are freed and it re-queues with num_computed_tokens = 0; the prefix cache
     usually gives most of them back)
  2. waiting requests, most urgent first, while budget, blocks and max_num_seqs allow;
     the prefix cache may cover part of the prompt
Prefill and decode are not separate phases: a prefill is just a request with many tokens
left to compute, so chunked prefill is the budget cutting that number.

Speculative decoding is the same idea once more: a request carrying proposed tokens schedules
them after its known ones (1 + k query tokens in the same budget). After verification the accepted
tokens are appended with the stop rules checked after each, and num_computed_tokens is rolled back
past the rejected ones: their KV slots are overwritten by the next step and, lying beyond
num_computed_tokens, never reach the prefix cache (commit_computed publishes computed blocks only).

Service classes (docs/workload_classes.md): queues order by class first (interactive, standard,
batch), so batch is preempted first. The most urgent class present with a TPOT target is
protected: its requests are scheduled as above; every lower class only fills what is left of
margin x that target by the step-time model (step_time.py), the longest-paused first, so each
progresses when capacity exists; a request skipped this way keeps its KV blocks (pausing costs
nothing) until blocks run short. An interactive prompt is prefilled, under running interactive
decodes, in chunks that fit the same limit. With no protected class present (a batch job alone)
the step is built exactly as without classes: the whole token and sequence budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenmill.config import SchedulerConfig
from tokenmill.engine.class_scheduling import ClassScheduling, TokenCap
from tokenmill.engine.interfaces import RunnerOutput, SampledTokens, ScheduledRequest, SchedulerOutput
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.policy import RequestQueue, build_policy
from tokenmill.engine.request import PLACEHOLDER, EngineOutput, FinishReason, Request, RequestStatus, TokenLogprob
from tokenmill.engine.service_class import ServiceClass
from tokenmill.engine.shared_prefix import BlocksInFlight
from tokenmill.engine.stats import ClassStepStats
from tokenmill.engine.step_time import OnlineStepTimeModel, StepTimeModel
from tokenmill.engine.stop import check_stop, length_reached


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    num_finished: int = 0


@dataclass(slots=True)
class StepTokenStats:
    """What one update() observed; reset every step."""

    num_prompt_tokens: int = 0  # prompt tokens computed (excluding prefix-cache hits)
    num_generation_tokens: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)
    num_drafts: int = 0  # requests whose proposals were verified
    num_draft_tokens: int = 0  # proposed tokens verified
    num_accepted_tokens: int = 0  # of those, accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts whose token i was accepted
    num_prediction_accepted: int = 0  # of the accepted, proposed by a request's prediction
    num_prediction_rejected: int = 0  # prediction tokens verified and refused
    classes: ClassStepStats = field(default_factory=ClassStepStats)  # what schedule() decided for this step
    ttfts_s_by_class: dict[str, list[float]] = field(default_factory=dict)
    inter_token_latencies_s_by_class: dict[str, list[float]] = field(default_factory=dict)


class Scheduler(ClassScheduling):
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 step_time: StepTimeModel | None = None) -> None:
        self.config = config
        self.classes = config.service_classes
        self.kv = kv
        self.max_model_len = max_model_len
        self.policy = build_policy(config.policy, rank_classes=self.classes.enabled)
        self.waiting = RequestQueue(self.policy)
        self.running = RequestQueue(self.policy)
        self.requests: dict[str, Request] = {}
        self.in_flight = BlocksInFlight(config.shared_prefix_wait_tokens, kv.block_size, kv.enable_prefix_caching)
        self.stats = SchedulerStats()
        self.step_stats = StepTokenStats()
        self.step_time = step_time or OnlineStepTimeModel(self.classes.min_step_samples)
        self.last_plan = ClassStepStats()
        self._step_index = 0
        self._last_scheduled: dict[str, int] = {}  # request id -> the step it last ran in (rotation)
        self._interactive_seen_s: float | None = None  # monotonic time an interactive request was last present

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, FinishReason.ABORT)
        return request

    def observe_step(self, out: SchedulerOutput, step_time_s: float) -> None:
        """Feed one measured step to the step-time model (the core calls this after each step)."""
        if not out.is_empty:
            self.step_time.observe(out.num_tokens, len(out.scheduled), step_time_s)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.in_flight.reset(self.running)
        protected = self._protected_class()
        if protected is ServiceClass.INTERACTIVE:
            self._interactive_seen_s = time.monotonic()
        limit = None
        if protected is None:
            budget = self._schedule_running(out, list(self.running), self._unprotected_budget(), set())
            if out.num_preempted == 0:
                self._schedule_waiting(out, budget)
        else:
            limit = self._step_limit(protected)
            limit = self._schedule_by_class(out, protected, limit)
        self._record_plan(out, protected, limit)
        self.kv.demote_superseded()
        now = time.monotonic()
        for s in out.scheduled:
            if s.request.times.first_scheduled is None:
                s.request.times.first_scheduled = now
        return out

    # ---- one request at a time ---------------------------------------------------------------

    def _schedule_running(self, out: SchedulerOutput, requests: list[Request], budget: int,
                          scheduled_ids: set[str], cap: TokenCap | None = None) -> int:
        """Schedule `requests` (running, in the given order) within the budget; `cap`, when given,
        bounds each one's tokens by what the step already holds (the SLO limit)."""
        full = self.config.max_num_batched_tokens
        for request in requests:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if request.has_pending_token and length_reached(request, self.max_model_len):
                continue  # its running step is its last: a row for it now would be thrown away
            allowed = budget
            if cap is not None:
                if len(out.scheduled) >= self.config.max_num_seqs:
                    break
                allowed = min(budget, cap(full - budget, len(out.scheduled)))
                if allowed <= 0:
                    continue  # paused this step: keeps its blocks
            remaining = request.num_tokens - request.num_computed_tokens
            q = request.spec_draft_probs  # consumed with the proposals (_spec_tokens)
            request.spec_draft_probs = None
            spec = self._spec_tokens(request, remaining, allowed)
            num_new = min(remaining + len(spec), allowed)
            if not spec or not self.kv.allocate(request, num_new):
                spec, num_new = [], min(remaining, allowed)  # proposals never cost another request its blocks
                if not self._allocate_or_preempt(request, num_new, scheduled_ids, out):
                    continue
            scheduled = self._scheduled(request, num_new, spec)
            if spec and q is not None:
                scheduled.spec_draft_probs = q[:len(spec)]
            out.scheduled.append(scheduled)
            scheduled_ids.add(request.request_id)
            budget -= num_new
        return budget

    def _spec_tokens(self, request: Request, remaining: int, budget: int) -> list[int]:
        """The request's proposals that fit: the budget after its known tokens, the context, and
        max_tokens (a step emits at most len(proposals) + 1 tokens). Consumed either way."""
        spec, request.spec_token_ids = request.spec_token_ids, []
        if not spec:
            return []
        limit = min(len(spec), budget - remaining, self.max_model_len - request.num_tokens - 1)
        max_tokens = request.params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - request.num_output_tokens - 1)
        return spec[:max(limit, 0)]

    def _allocate_or_preempt(self, request: Request, num_new: int, scheduled_ids: set[str],
                             out: SchedulerOutput) -> bool:
        while not self.kv.allocate(request, num_new):
            victim = self._least_urgent_unscheduled(scheduled_ids)
            self._preempt(victim)
            out.num_preempted += 1
            if victim is request:
                return False
        return True

    def _least_urgent_unscheduled(self, scheduled_ids: set[str]) -> Request:
        for request in reversed(list(self.running)):
            if request.request_id not in scheduled_ids:
                return request
        raise AssertionError("the request being scheduled is always a candidate")

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids, request.spec_draft_probs = [], None
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.add(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            chunk = self._first_chunk(request, budget)
            if chunk is None:
                break
            cached, partial, num_computed, num_new = chunk
            if self.in_flight.should_wait(request, len(cached)):
                continue  # the requests behind it go on
            if not self._allocate_first(out, request, num_new, cached, partial):
                break
            self.waiting.remove(request)
            self._admit(out, request, num_computed, num_new)
            budget -= num_new

    def _first_chunk(self, request: Request,
                     allowed: int) -> tuple[list[int], tuple[int, int] | None, int, int] | None:
        """(cached blocks, a cached partial block after them (block id, rows) or None, tokens they cover, tokens
        to compute now) for a waiting request within `allowed` tokens, or None when its prompt must go whole
        and does not fit (no chunked prefill), or when it was preempted with a step still running
        (asynchronous scheduling): it waits for that step's token, since a prefill needs every input token
        and the prefix cache every block's."""
        if request.has_pending_token:
            return None
        cached = self.kv.find_cached_prefix(request)
        partial = self.kv.find_cached_partial(request, len(cached))
        num_computed = len(cached) * self.kv.block_size + (partial[1] if partial is not None else 0)
        num_new = request.num_tokens - num_computed
        if not self.config.enable_chunked_prefill and num_new > allowed:
            return None
        return cached, partial, num_computed, min(num_new, allowed)

    def _allocate_first(self, out: SchedulerOutput, request: Request, num_new: int, cached: list[int],
                        partial: tuple[int, int] | None) -> bool:
        """Blocks for a waiting request's first chunk (False: none free now); a cached partial block's rows
        are copied into its first new block before the step's forward."""
        if partial is None:
            return self.kv.allocate(request, num_new, cached)
        copy = self.kv.allocate_with_copy(request, num_new, cached, partial)
        if copy is not None:
            out.block_copies.append(copy)
        return copy is not None

    def _admit(self, out: SchedulerOutput, request: Request, num_computed: int, num_new: int) -> None:
        """A waiting request whose blocks are allocated starts running with its first chunk."""
        self.kv.record_lookup(request.num_tokens, num_computed)
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_computed
        request.num_computed_tokens = num_computed
        request.status = RequestStatus.RUNNING
        self.running.add(request)
        self.in_flight.note(request)  # what it computes from now on, its siblings behind it wait for
        out.scheduled.append(self._scheduled(request, num_new))

    def _scheduled(self, request: Request, num_new: int, spec: list[int] | None = None) -> ScheduledRequest:
        return ScheduledRequest(request, request.num_computed_tokens, num_new,
                                self.kv.block_tables[request.request_id], spec or [])

    def advance(self, out: SchedulerOutput) -> None:
        """Asynchronous scheduling: apply a step that is running but whose result is not here yet, so
        the next step can be scheduled meanwhile. Computed counts move on; a request that samples gets
        a PLACEHOLDER token, which the next step's input takes from this step's result on the executing
        thread and `update(..., advanced=True)` replaces. No proposals here (speculation runs in step)."""
        for s in out.scheduled:
            request = s.request
            if request.status is not RequestStatus.RUNNING:
                continue  # its step ends it (update finished it) or it was aborted: the row is thrown away
            samples = s.needs_sample  # before num_computed_tokens moves
            request.num_computed_tokens += s.num_new_tokens
            if samples:
                request.token_ids.append(PLACEHOLDER)

    def update(self, out: SchedulerOutput, result: RunnerOutput, advanced: bool = False) -> list[EngineOutput]:
        """Advance computed counts, append sampled tokens, finish requests that stop. `advanced`: the
        step went through `advance` (its counts moved; each sampled token replaces its placeholder), and
        a request preempted since still takes its token (it was sampled from valid KV)."""
        outputs = []
        now = time.monotonic()
        self.step_stats = StepTokenStats(classes=self.last_plan)
        for s in out.scheduled:
            request = s.request
            if request.status is not RequestStatus.RUNNING and not (
                    advanced and request.status is RequestStatus.PREEMPTED and request.has_pending_token):
                continue  # aborted (or finished) while the step ran
            start = s.num_computed_tokens
            end = min(start + s.num_new_tokens, request.num_prompt_tokens)
            self.step_stats.num_prompt_tokens += max(0, end - start)
            sampled = result.sampled.get(request.request_id)
            num_rejected = 0
            if s.spec_token_ids:
                num_accepted = len(sampled.token_ids) - 1 if sampled is not None else 0
                num_rejected = len(s.spec_token_ids) - num_accepted
                self._record_spec(request, len(s.spec_token_ids), num_accepted)
            if advanced:
                if sampled is not None:
                    assert request.token_ids[-1] == PLACEHOLDER, "one step in flight per request"
                    request.token_ids.pop()
            else:
                # Rejected proposals' KV is garbage: computed stops after the last accepted one, so
                # commit_computed below publishes verified blocks only.
                request.num_computed_tokens += s.num_new_tokens - num_rejected
            # Entry i scores prompt token i + 1. A preempted request recomputes its prompt from position 0:
            # the positions it already scored keep their first entries.
            scored = result.prompt_logprobs.get(request.request_id, [])
            request.prompt_logprobs.extend(scored[max(0, len(request.prompt_logprobs) - start):])
            if request.status is RequestStatus.RUNNING:
                self.kv.commit_computed(request)
            if sampled is not None:
                outputs.append(self._append_tokens(request, sampled, now))
                if s.spec_token_ids and request.status is RequestStatus.RUNNING:
                    self.kv.commit_computed(request)  # accepted proposals are token_ids only now
        return outputs

    def _append_tokens(self, request: Request, sampled: SampledTokens, now: float) -> EngineOutput:
        """Append the step's tokens one by one with the stop rules checked after each: a token past
        a stop is never appended."""
        is_first = request.times.first_token is None
        new_ids: list[int] = []
        new_logprobs: list[TokenLogprob] = []
        reason = None
        for token_id, logprob in zip(sampled.token_ids, sampled.logprobs, strict=True):
            request.token_ids.append(token_id)
            new_ids.append(token_id)
            if logprob is not None:
                request.logprobs.append(logprob)
                new_logprobs.append(logprob)
            self._record_latency(request, now)
            reason = check_stop(request, self.max_model_len)
            if reason is not None:
                self._finish(request, reason)
                break
        if sampled.confidences is not None:  # of the tokens appended only: none past a stop
            request.spec_stats.target_confidences.extend(sampled.confidences[:len(new_ids)])
        prompt_logprobs = request.prompt_logprobs if is_first and request.params.prompt_logprobs is not None else None
        spec = request.spec_stats if request.spec_stats.num_drafts else None
        return EngineOutput(request.request_id, new_ids, new_logprobs, reason, request.num_prompt_tokens,
                            request.num_cached_tokens, request.times, prompt_logprobs, spec)

    def _record_spec(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        stats, step = request.spec_stats, self.step_stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_proposed
        stats.num_accepted_tokens += num_accepted
        stats.note_acceptance(num_accepted / num_proposed)
        if request.spec_from_prediction:
            stats.num_prediction_accepted += num_accepted
            stats.num_prediction_rejected += num_proposed - num_accepted
            step.num_prediction_accepted += num_accepted
            step.num_prediction_rejected += num_proposed - num_accepted
        step.num_drafts += 1
        step.num_draft_tokens += num_proposed
        step.num_accepted_tokens += num_accepted
        if len(step.accepted_per_position) < num_proposed:
            step.accepted_per_position.extend([0] * (num_proposed - len(step.accepted_per_position)))
        for i in range(num_accepted):
            step.accepted_per_position[i] += 1

    def _record_latency(self, request: Request, now: float) -> None:
        times = request.times
        self.step_stats.num_generation_tokens += 1
        name = request.service_class.value
        if times.first_token is None:
            times.first_token = now
            self.step_stats.ttfts_s.append(now - times.arrival)
            self.step_stats.ttfts_s_by_class.setdefault(name, []).append(now - times.arrival)
        elif times.last_token is not None:
            self.step_stats.inter_token_latencies_s.append(now - times.last_token)
            self.step_stats.inter_token_latencies_s_by_class.setdefault(name, []).append(now - times.last_token)
        times.last_token = now

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is not RequestStatus.FINISHED:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.times.finished = time.monotonic()
        self.requests.pop(request.request_id, None)
        self._last_scheduled.pop(request.request_id, None)
        self.stats.num_finished += 1
