"""The service-class half of the scheduler (docs/workload_classes.md), mixed into `Scheduler`.

Which class is protected, the step-time limit that protects it, how each lower class fills only
what is left of that limit (rotating, the longest-paused first), how an interactive prompt is
chunked under interactive decodes, how protected prompts may preempt lower classes for blocks, the
arrival cap on steps without protected work, and the per-step plan the metrics read. The token
bookkeeping of one request at a time (`_schedule_running`, `_first_chunk`, `_admit`, `_preempt`)
stays in scheduler.py; this half only decides which requests, in which order, under which cap.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenmill.engine.interfaces import SchedulerOutput
from tokenmill.engine.request import Request
from tokenmill.engine.service_class import ServiceClass
from tokenmill.engine.stats import ClassStepStats
from tokenmill.engine.step_time import StepTimeLimit

if TYPE_CHECKING:
    from tokenmill.config import SchedulerConfig, ServiceClassConfig
    from tokenmill.engine.kv_cache import KVCacheManager
    from tokenmill.engine.policy import RequestQueue, SchedulingPolicy
    from tokenmill.engine.shared_prefix import BlocksInFlight
    from tokenmill.engine.step_time import StepTimeModel

# (tokens already in the step, sequences already in it) -> tokens one more request may add.
TokenCap = Callable[[int, int], int]


class ClassScheduling:
    # The scheduler's state and per-request steps this half works with (scheduler.py sets them).
    config: SchedulerConfig
    classes: ServiceClassConfig
    kv: KVCacheManager
    in_flight: BlocksInFlight
    policy: SchedulingPolicy
    running: RequestQueue
    waiting: RequestQueue
    requests: dict[str, Request]
    step_time: StepTimeModel
    last_plan: ClassStepStats
    _step_index: int
    _last_scheduled: dict[str, int]
    _interactive_seen_s: float | None

    if TYPE_CHECKING:
        def _schedule_running(self, out: SchedulerOutput, requests: list[Request], budget: int,
                              scheduled_ids: set[str], cap: TokenCap | None = None) -> int: ...

        def _first_chunk(self, request: Request,
                         allowed: int) -> tuple[list[int], tuple[int, int] | None, int, int] | None: ...

        def _allocate_first(self, out: SchedulerOutput, request: Request, num_new: int, cached: list[int],
                            partial: tuple[int, int] | None) -> bool: ...

        def _admit(self, out: SchedulerOutput, request: Request, num_computed: int, num_new: int) -> None: ...

        def _preempt(self, request: Request) -> None: ...

    def _protected_class(self) -> ServiceClass | None:
        """The most urgent class present with a TPOT target, when it constrains anything: lower
        classes are present, or it is interactive (its prompts are chunked under its decodes)."""
        if not self.classes.enabled:
            return None
        present = {r.service_class for r in self.requests.values()}
        targeted = [c for c in present if self.classes.target(c).tpot_s is not None]
        if not targeted:
            return None
        protected = min(targeted, key=lambda c: c.rank)
        if protected is ServiceClass.INTERACTIVE or any(c.rank > protected.rank for c in present):
            return protected
        return None

    def _unprotected_budget(self) -> int:
        """A step's tokens with no protected work: what the fit says ends within arrival_step_share x
        the interactive TTFT target while interactive requests were here within interactive_recent_s,
        else within quiet_step_share x it (None: all of max_num_batched_tokens); the running
        sequences' tokens always fit."""
        full = self.config.max_num_batched_tokens
        now = time.monotonic()
        ttft_s, fit = self.classes.interactive.ttft_s, self.step_time.fit()
        if not self.classes.enabled or ttft_s is None or fit is None:
            return full
        recent = (self._interactive_seen_s is not None
                  and now - self._interactive_seen_s <= self.classes.interactive_recent_s)
        share = self.classes.arrival_step_share if recent else self.classes.quiet_step_share
        if share is None:
            return full
        # The tokens one more sequence may add to a step of the other running ones, under the cap.
        limit = StepTimeLimit(share * ttft_s, fit, full)
        tokens = limit.max_new_tokens(0, len(self.running) - 1)
        return min(full, max(tokens, len(self.running), self.classes.min_prefill_chunk))

    def _step_limit(self, protected: ServiceClass) -> StepTimeLimit:
        tpot_s = self.classes.target(protected).tpot_s
        assert tpot_s is not None
        return StepTimeLimit(self.classes.step_time_margin * tpot_s, self.step_time.fit(),
                             self.classes.unfitted_step_tokens)

    def _schedule_by_class(self, out: SchedulerOutput, protected: ServiceClass,
                           limit: StepTimeLimit) -> StepTimeLimit:
        """Protected work first, then lower classes as fillers; returns the limit the fillers met."""
        budget, ids = self.config.max_num_batched_tokens, set[str]()
        num_admission_preemptions = 0  # lower-class requests preempted to admit protected ones
        # Fixed at the first filler, when the step holds exactly the protected classes' work.
        filler_limit: list[StepTimeLimit] = []

        def filler_cap(step_tokens: int, step_seqs: int) -> int:
            if not filler_limit:
                filler_limit.append(self._filler_limit(limit, step_tokens, step_seqs))
            return filler_limit[0].max_new_tokens(step_tokens, step_seqs)

        for cls in sorted(ServiceClass, key=lambda c: c.rank):
            members = [r for r in self.running if r.service_class is cls]
            if cls.rank > protected.rank:
                members.sort(key=lambda r: self.policy.rotation_key(r, self._last_scheduled.get(r.request_id, -1)))
                budget = self._schedule_running(out, members, budget, ids, filler_cap)
                if out.num_preempted == 0:  # never re-admit a request preempted this step
                    budget = self._admit_class(out, cls, budget, ids, filler_cap, preempt_lower=False)
                continue
            cap = None
            if cls is ServiceClass.INTERACTIVE:
                decodes = [r for r in members if r.num_tokens - r.num_computed_tokens == 1]
                budget = self._schedule_running(out, decodes, budget, ids)
                cap = self._own_prefill_cap(limit, any(r.request_id in ids for r in decodes))
                decode_ids = {r.request_id for r in decodes}
                members = [r for r in members if r.request_id not in decode_ids]
            budget = self._schedule_running(out, members, budget, ids, cap)
            if out.num_preempted == num_admission_preemptions:  # blocks are short: admit nobody
                before = out.num_preempted
                budget = self._admit_class(out, cls, budget, ids, cap, preempt_lower=True)
                num_admission_preemptions += out.num_preempted - before
        return filler_limit[0] if filler_limit else limit

    def _filler_limit(self, limit: StepTimeLimit, own_tokens: int, own_seqs: int) -> StepTimeLimit:
        """What lower classes may fill: up to the TPOT target's limit, and at most protected_slowdown
        beyond the protected work's own predicted time. The absolute target alone let a fast machine's
        chat, 45 ms a token alone, run at the 80 ms the target allows once batch work filled its steps
        (1.6x slower, measured); the relative bound keeps it near its speed alone."""
        slowdown = self.classes.protected_slowdown
        own_s = limit.predict(own_tokens, own_seqs)
        if slowdown is None or own_s is None or own_seqs == 0:
            return limit
        return StepTimeLimit(min(limit.limit_s, (1.0 + slowdown) * own_s), limit.fit, limit.unfitted_tokens)

    def _own_prefill_cap(self, limit: StepTimeLimit, has_decodes: bool) -> TokenCap | None:
        """Interactive prompts under running interactive decodes: chunks that fit the limit, but at
        least min_prefill_chunk (its TTFT must stay bounded); with no decodes to protect, or decodes that
        already miss the target on their own, TTFT first."""
        if not has_decodes:
            return None
        floor = self.classes.min_prefill_chunk

        def cap(step_tokens: int, step_seqs: int) -> int:
            predicted = limit.predict(step_tokens, step_seqs)
            if predicted is not None and predicted > limit.limit_s:
                # The decodes alone already miss the TPOT target: chunking the prompt would only add
                # to its TTFT (measured: 16-token chunks gave 1.8 s TTFT) and save no TPOT, so meet
                # the target that can still be met.
                return self.config.max_num_batched_tokens
            return max(limit.max_new_tokens(step_tokens, step_seqs), floor)

        return cap

    def _admit_class(self, out: SchedulerOutput, cls: ServiceClass, budget: int, ids: set[str],
                     cap: TokenCap | None, preempt_lower: bool) -> int:
        """Admit waiting requests of one class, most urgent first, while budget, blocks, the cap and
        max_num_seqs (counting running requests of this class and more urgent ones) allow.
        A protected class may preempt unscheduled running requests of lower classes for blocks."""
        full = self.config.max_num_batched_tokens
        for request in [r for r in self.waiting if r.service_class is cls]:
            if budget <= 0 or len(out.scheduled) >= self.config.max_num_seqs:
                break
            if sum(1 for r in self.running if r.service_class.rank <= cls.rank) >= self.config.max_num_seqs:
                break
            allowed = budget if cap is None else min(budget, cap(full - budget, len(out.scheduled)))
            if allowed <= 0:
                break
            chunk = self._first_chunk(request, allowed)
            if chunk is None:
                break
            cached, partial, num_computed, num_new = chunk
            if self.in_flight.should_wait(request, len(cached)):
                continue  # the requests behind it go on
            while not self._allocate_first(out, request, num_new, cached, partial):
                victim = self._lower_class_victim(cls, ids) if preempt_lower else None
                if victim is None:
                    return budget
                self._preempt(victim)
                out.num_preempted += 1
            self.waiting.remove(request)
            self._admit(out, request, num_computed, num_new)
            ids.add(request.request_id)
            budget -= num_new
        return budget

    def _lower_class_victim(self, cls: ServiceClass, scheduled_ids: set[str]) -> Request | None:
        for request in reversed(list(self.running)):
            if request.service_class.rank > cls.rank and request.request_id not in scheduled_ids:
                return request
        return None

    def _record_plan(self, out: SchedulerOutput, protected: ServiceClass | None, limit: StepTimeLimit | None) -> None:
        names = [c.value for c in ServiceClass]
        plan = ClassStepStats({n: 0 for n in names}, {n: 0 for n in names})
        for s in out.scheduled:
            name = s.request.service_class.value
            plan.scheduled_tokens[name] += s.num_new_tokens
            plan.scheduled_seqs[name] += 1
            self._last_scheduled[s.request.request_id] = self._step_index
        fit = self.step_time.fit()
        plan.step_time_fit = fit
        plan.predicted_step_time_s = fit.predict(out.num_tokens, len(out.scheduled)) if fit else None
        if protected is not None and limit is not None:
            scheduled = {s.request.request_id for s in out.scheduled}
            plan.protected_class = protected.value
            plan.step_time_limit_s = limit.limit_s
            plan.num_deferred = sum(1 for r in self.running
                                    if r.service_class.rank > protected.rank and r.request_id not in scheduled)
        self.last_plan = plan
        self._step_index += 1

    def class_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Requests running and waiting now, per class name."""
        running = {c.value: 0 for c in ServiceClass}
        waiting = dict(running)
        for r in self.running:
            running[r.service_class.value] += 1
        for r in self.waiting:
            waiting[r.service_class.value] += 1
        return running, waiting
