"""EngineCore.step(): schedule, execute, update. Three calls; everything else is a rule inside them."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.cpu_share import build_governor
from tokenmill.engine.inputs import RequestLimits
from tokenmill.engine.interfaces import RunnerOutput, SchedulerOutput
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.model_input import MAX_DECODE_QUERY
from tokenmill.engine.model_runner import ModelRunner, PreparedStep, kv_bytes_per_block, num_kv_blocks
from tokenmill.engine.pipeline import (
    InFlight,
    StepPipeline,
    async_scheduling_enabled,
    overlappable,
    release_openmp_team,
)
from tokenmill.engine.profiling import PhaseTimer
from tokenmill.engine.request import EngineOutput, FinishReason, Request, SamplingParams
from tokenmill.engine.sampler import Sampler
from tokenmill.engine.scheduler import Scheduler, StepTokenStats
from tokenmill.engine.service_class import ServiceClass
from tokenmill.engine.spec.speculator import DraftWeights, build_speculator, predictions_only_speculator
from tokenmill.engine.stats import StepStats
from tokenmill.errors import RequestValidationError
from tokenmill.layers.kv_cache import kv_cache_spec
from tokenmill.models.arch import ArchConfig
from tokenmill.platform import cpu_quota_cores, default_num_threads

log = logging.getLogger(__name__)

_MAX_DEFAULT_CONTEXT = 32768


@dataclass(slots=True)
class StepResult:
    outputs: list[EngineOutput]
    stats: StepStats


class EngineCore:
    def __init__(self, config: EngineConfig, arch: ArchConfig, tensors: Mapping[str, torch.Tensor],
                 draft: DraftWeights | None = None) -> None:
        self.config = config
        self.arch = arch
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        elif (threads := default_num_threads(quota := cpu_quota_cores())) < torch.get_num_threads():
            log.info("CPU quota of %.2f cores: %d compute thread%s (torch would start %d)", quota or 0.0,
                     threads, "" if threads == 1 else "s", torch.get_num_threads())
            torch.set_num_threads(threads)
        dtype, device = config.model.torch_dtype(), config.model.torch_device()
        block_size = config.cache.block_size
        kv_spec = kv_cache_spec(config.cache.kv_cache_dtype, dtype)
        context_limit = self._context_limit()
        # Weights first, then the memory probe: what the weights take is not free for the KV cache.
        self.runner = ModelRunner(config.model, arch, tensors, context_limit, block_size, None, kv_spec,
                                  max_num_seqs=config.scheduler.max_num_seqs)
        self.timer = PhaseTimer(device)  # per-phase step times, only while profiling (profiling.py)
        self.runner.timer = self.timer
        # A draft's weights load before the probe too; its KV pool (a block per target block) shares the budget.
        self.speculator = build_speculator(config.speculative, config.model, arch, block_size, None, context_limit,
                                           draft, enable_prefix_caching=config.cache.enable_prefix_caching,
                                           max_num_seqs=config.scheduler.max_num_seqs)
        self.runner.track_confidence = self.speculator is not None and self.speculator.wants_target_confidence
        if self.speculator is not None:
            self.speculator.grammar = _SamplerGrammars(self.runner)
        num_blocks = num_kv_blocks(arch, config.cache, kv_spec, device)
        if self.speculator is not None and config.cache.num_blocks is None:
            num_blocks = self.speculator.share_kv_budget(num_blocks, kv_bytes_per_block(arch, block_size, kv_spec))
        self.runner.allocate_kv_cache(num_blocks)
        self.max_model_len = self._max_model_len(context_limit, num_blocks * block_size)
        self.limits = RequestLimits(self.max_model_len, arch.vocab_size)
        self.kv = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching, reuse_partial_blocks=True)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        if self.speculator is not None:
            self.speculator.allocate_kv(num_blocks, self.max_model_len)
        log.info("KV cache: %s, %d tokens in %d blocks of %d, %.1f MiB (%d bytes per token over %d layers)",
                 kv_spec.describe(), num_blocks * block_size, num_blocks, block_size,
                 self.runner.kv_cache_bytes / 2**20, kv_spec.bytes_per_token(arch.num_kv_heads, arch.head_dim)
                 * arch.num_layers, arch.num_layers)
        self.governor = build_governor(device, config.adapt_threads)  # compute threads vs other processes
        # Asynchronous scheduling: every step runs on a device thread, the next one scheduled meanwhile.
        self.pipeline: StepPipeline | None = None
        self.overlap_steps = True  # False: every step synchronous on the device thread (benchmarks' A/B)
        # Called just before an overlapped step is scheduled: a server adds the requests that arrived while
        # the running step ran, so they make the next step (between step() calls they would wait for it).
        self.before_schedule: Callable[[], None] | None = None
        if async_scheduling_enabled(config.scheduler.async_scheduling, self.speculator is not None):
            self.pipeline = StepPipeline(torch.get_num_threads())
            release_openmp_team()
            log.info("asynchronous scheduling: step N + 1 is scheduled while step N runs")
        log.info("engine ready: %s, %d KV blocks of %d tokens, context %d, %s on %s",
                 arch.architecture, num_blocks, block_size, self.max_model_len, dtype, device)

    def _context_limit(self) -> int:
        """The longest context the model and the scheduler allow, before the KV cache is sized."""
        requested = self.config.model.max_model_len
        natural = min(self.arch.max_position_embeddings, _MAX_DEFAULT_CONTEXT)
        limit = min(requested or natural, self.arch.max_position_embeddings)
        if not self.config.scheduler.enable_chunked_prefill:
            # Without chunking a whole (re-)prefill must fit one step's budget, or it would wait forever.
            limit = min(limit, self.config.scheduler.max_num_batched_tokens)
        return limit

    def _max_model_len(self, context_limit: int, kv_capacity_tokens: int) -> int:
        """The context, capped so that one request alone always fits in the KV cache
        (otherwise it would preempt itself forever)."""
        limit = min(context_limit, kv_capacity_tokens)
        requested = self.config.model.max_model_len
        if requested is not None and limit < requested:
            log.warning("max_model_len %d capped to %d by the model or the KV cache size", requested, limit)
        return limit

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    eos_token_ids: tuple[int, ...], priority: int = 0, arrival_time: float | None = None,
                    service_class: ServiceClass = ServiceClass.STANDARD, cache_salt: str | None = None) -> Request:
        self.limits.check_request(prompt_token_ids, params)
        if cache_salt is not None and not cache_salt:
            raise RequestValidationError("cache_salt must be a non-empty string (or left out)", "cache_salt")
        if params.prediction and self.speculator is None and self.pipeline is None:
            # Predicted outputs on an engine started without --speculative: proposals from predictions only,
            # from now on (not grammars' forced tokens: what a request gets must not depend on another's
            # prediction; overlapped steps cannot speculate: there predictions go unused)
            self.speculator = predictions_only_speculator(self.max_model_len)
            log.info("speculation: predicted outputs only (no --speculative method)")
        if request_id in self.scheduler.requests:
            raise RequestValidationError(f"request id '{request_id}' is already in flight: use a unique id")
        request = Request(request_id, list(prompt_token_ids), params, eos_token_ids, priority,
                          arrival_time if arrival_time is not None else time.monotonic(), service_class, cache_salt)
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> EngineOutput | None:
        request = self.scheduler.abort(request_id)
        self._forget(request_id)
        if request is None:
            return None
        return EngineOutput(request_id, [], [], FinishReason.ABORT, request.num_prompt_tokens,
                            request.num_cached_tokens, request.times)

    def reset(self) -> None:
        """Drop every request and all block bookkeeping (the KV tensors and weights stay)."""
        in_flight = self.pipeline.take() if self.pipeline is not None else None
        if in_flight is not None:
            with contextlib.suppress(Exception):  # a failed step is why we reset
                in_flight.result.result()  # the device thread must be done with the runner's state
        cache = self.config.cache
        self.kv = KVCacheManager(self.kv.num_blocks, cache.block_size, cache.enable_prefix_caching,
                                 reuse_partial_blocks=True)
        # The step-time fit describes the machine, not the requests: it survives the reset.
        self.scheduler = Scheduler(self.config.scheduler, self.kv, self.max_model_len, self.scheduler.step_time)
        self.runner.sampler = Sampler(self.runner.device, self.config.model.seed)
        self.runner.reset()
        if self.speculator is not None:
            self.speculator.reset()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or (self.pipeline is not None and self.pipeline.in_flight is not None)

    def step(self) -> StepResult:
        pipeline = self.pipeline
        if pipeline is None:
            return self._step(self._execute)
        overlap = self.overlap_steps and not self.timer.enabled and all(
            overlappable(r) for r in self.scheduler.requests.values())
        in_flight = pipeline.in_flight
        drained: list[EngineOutput] = []
        # A request that needs its history steps one at a time; after (or before) a prefill chunk the
        # next step is scheduled with whatever arrived meanwhile.
        if not overlap:
            return self._step_synchronously(pipeline)
        if in_flight is not None and (in_flight.is_long or self._may_prefill()):
            drained = self._complete(pipeline.take())
        result = self._step_overlapped(pipeline)
        result.outputs[:0] = drained
        return result

    def _step_synchronously(self, pipeline: StepPipeline) -> StepResult:
        """One step on the device thread, after the running one (if any) has ended."""
        drained = self._complete(pipeline.take())
        result = self._step(lambda scheduled: pipeline.call(self._execute, scheduled))
        result.outputs[:0] = drained
        return result

    def _may_prefill(self) -> bool:
        """The next step may hold a prefill chunk (a request waits, or one has prompt left): it is scheduled
        after the running step ends, with whatever arrived meanwhile. Scheduled early, a long prefill step
        could shut out a chat that arrived in the last milliseconds of the running one until it ended."""
        scheduler = self.scheduler
        return bool(scheduler.waiting) or any(
            r.num_tokens - r.num_computed_tokens > MAX_DECODE_QUERY for r in scheduler.running)

    def _execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        """One step's device work, on the thread that owns the compute threads."""
        if self.governor is not None:
            self.governor.tick()  # its thread count governs this thread's parallel regions
        return self.runner.execute(scheduled)

    def _step(self, execute: Callable[[SchedulerOutput], RunnerOutput]) -> StepResult:
        started = time.monotonic()
        timer = self.timer
        if self.speculator is not None:
            with timer.phase("propose"):
                self.speculator.propose(self.scheduler.running)  # proposals ride on the requests into schedule()
        with timer.phase("schedule"):
            scheduled = self.scheduler.schedule()
        result = execute(scheduled) if not scheduled.is_empty else RunnerOutput()
        with timer.phase("update"):
            outputs = self.scheduler.update(scheduled, result)
        self._forget_finished(outputs)
        step_time_s = time.monotonic() - started
        self.scheduler.observe_step(scheduled, step_time_s)  # the SLO-aware scheduler's step-time model
        if self.speculator is not None:
            self.speculator.observe(scheduled.num_tokens, step_time_s)
        return StepResult(outputs, self._stats(scheduled.num_tokens, scheduled.num_preempted, started,
                                                self.scheduler.step_stats))

    def _step_overlapped(self, pipeline: StepPipeline) -> StepResult:
        """Schedule and build step N + 1 while step N runs; return step N's outputs (pipeline.py)."""
        started = time.monotonic()
        if pipeline.in_flight is not None and (fit := self.scheduler.step_time.fit()) is not None:
            running = pipeline.in_flight.scheduled
            pipeline.wait_until_due(fit.predict(running.num_tokens, len(running.scheduled)))
        if self.before_schedule is not None:
            self.before_schedule()
            # What arrived may read its history (penalties, a grammar): its sampling on the device thread
            # would meet the pending token advance() appends meanwhile, so this step runs synchronously.
            if not all(overlappable(r) for r in self.scheduler.requests.values()):
                return self._step_synchronously(pipeline)
        scheduling = time.monotonic()
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            outputs = self._complete(pipeline.take())
            return StepResult(outputs, self._stats(0, 0, started, self.scheduler.step_stats))
        prepared = self.runner.prepare(scheduled)
        previous = pipeline.take()
        forwarding = threading.Event()
        pipeline.launch(scheduled, self._run, prepared, forwarding)
        assert pipeline.in_flight is not None
        pipeline.in_flight.host_s = time.monotonic() - scheduling
        pipeline.note_scheduling(pipeline.in_flight.host_s)
        result = previous.result.result() if previous is not None else None
        # The host work below waits until step N + 1 is inside its forward, which runs without the GIL:
        # started at once, it took the GIL from the device thread's prologue (each torch call there
        # releases it and then waits for it), which made the device's step longer by the host work.
        forwarding.wait()
        outputs = self._apply(previous, *result) if previous is not None and result is not None else []
        self.scheduler.advance(scheduled)
        if not self.scheduler.has_work:  # all ended: the running step's rows are thrown away
            self._complete(pipeline.take())
        return StepResult(outputs, self._stats(scheduled.num_tokens, scheduled.num_preempted, started,
                                                self.scheduler.step_stats))

    def _run(self, prepared: PreparedStep, forwarding: threading.Event) -> RunnerOutput:
        try:
            if self.governor is not None:
                self.governor.tick()
            return self.runner.run(prepared, forwarding.set)
        finally:
            forwarding.set()  # also when the step failed before its forward

    def _complete(self, in_flight: InFlight | None) -> list[EngineOutput]:
        """Wait for a running step and apply its samples to the requests it advanced."""
        return [] if in_flight is None else self._apply(in_flight, *in_flight.result.result())

    def _apply(self, in_flight: InFlight, result: RunnerOutput, step_time_s: float) -> list[EngineOutput]:
        started = time.monotonic()
        outputs = self.scheduler.update(in_flight.scheduled, result, advanced=True)
        self._forget_finished(outputs)
        # The step-time model hears what the step would take synchronously (device + host work), the
        # time it predicts for the steps the class scheduler sizes (those run synchronously). Fed device
        # times alone, its fit under-priced each sequence's host work: after a batch job's overlapped
        # steps, chats beside it got slower steps than their targets allowed.
        host_s = in_flight.host_s + time.monotonic() - started
        self.scheduler.observe_step(in_flight.scheduled, step_time_s + host_s)
        return outputs

    def _forget_finished(self, outputs: list[EngineOutput]) -> None:
        for o in outputs:
            if o.finished:
                self._forget(o.request_id)

    def _forget(self, request_id: str) -> None:
        pipeline = self.pipeline
        self.runner.forget(request_id, sampler=pipeline is None)
        if pipeline is not None:  # the sampler belongs to the device thread
            pipeline.submit(self.runner.sampler.forget, request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def stats(self) -> StepStats:
        """The gauges as they stand, outside any step (after aborts, or while idle)."""
        return self._stats(0, 0, time.monotonic(), StepTokenStats())

    def _stats(self, num_tokens: int, num_preempted: int, started: float, tokens: StepTokenStats) -> StepStats:
        pool = self.kv.pool
        class_running, class_waiting = self.scheduler.class_counts()
        return StepStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_scheduled_tokens=num_tokens, num_preempted=num_preempted, kv_usage=self.kv.usage,
            prefix_cache_queries=pool.stats.queries, prefix_cache_hits=pool.stats.hits,
            step_time_s=time.monotonic() - started, num_prompt_tokens=tokens.num_prompt_tokens,
            num_generation_tokens=tokens.num_generation_tokens,
            num_preemptions_total=self.scheduler.stats.num_preemptions,
            cpu_threads=0 if self.governor is None else self.governor.threads,
            cpu_other_cores=0.0 if self.governor is None else self.governor.others_cores,
            ttfts_s=tokens.ttfts_s, inter_token_latencies_s=tokens.inter_token_latencies_s,
            spec_num_drafts=tokens.num_drafts, spec_num_draft_tokens=tokens.num_draft_tokens,
            spec_num_accepted_tokens=tokens.num_accepted_tokens,
            spec_accepted_per_position=tokens.accepted_per_position,
            spec_is_on=None if self.speculator is None else self.speculator.is_on,
            spec_num_gated_tokens=0 if self.speculator is None else self.speculator.last_gated,
            spec_cached_tokens=0 if self.speculator is None else self.speculator.proposer.cached_tokens,
            spec_num_forced_tokens=0 if self.speculator is None else self.speculator.last_forced,
            spec_num_prediction_accepted=tokens.num_prediction_accepted,
            spec_num_prediction_rejected=tokens.num_prediction_rejected,
            classes=tokens.classes, class_ttfts_s=tokens.ttfts_s_by_class,
            class_inter_token_latencies_s=tokens.inter_token_latencies_s_by_class,
            class_num_running=class_running, class_num_waiting=class_waiting)


class _SamplerGrammars:
    """The speculator's view of the requests' grammars: the sampler's logits processor holds them, looked
    up at each call (a reset replaces the sampler, and the engine sets the processor after the core)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def forced_tokens(self, request: Request) -> list[int]:
        processor = self.runner.sampler.logits_processor
        return [] if processor is None else processor.forced_tokens(request)

    def count_valid(self, request: Request, tokens: Sequence[int]) -> int:
        processor = self.runner.sampler.logits_processor
        return len(tokens) if processor is None else processor.count_valid(request, tokens)
