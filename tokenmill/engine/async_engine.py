"""The engine behind the server: LLMEngine on its own thread, asyncio streams in front.

    asyncio side                         engine thread
    generate() ──commands (SimpleQueue)──▶ AddRequest / AbortRequest / Shutdown between steps
               ◀──call_soon_threadsafe──── RequestOutput deltas into the request's asyncio.Queue

Only the engine thread touches the LLMEngine, so it needs no locks; other threads read only
its fixed limits. A generator that is closed early (client disconnect) aborts its request,
freeing its blocks within one step. An exception in a step fails every in-flight request with
that error (nobody hangs), resets the engine's request state, counts a restart and carries on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from tokenmill.config import EngineConfig
from tokenmill.engine.calibration import IdleCalibration
from tokenmill.engine.core import EngineCore
from tokenmill.engine.inputs import EncodedPrompt, RequestLimits
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.loader import LoadedEngine, load_engine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.request import SamplingParams
from tokenmill.engine.service_class import ServiceClass
from tokenmill.engine.stats import StepStats
from tokenmill.engine.structured.manager import StructuredOutputs

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed while this request was in flight."""


@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: str
    prompt: EncodedPrompt
    params: SamplingParams
    priority: int
    service_class: ServiceClass = ServiceClass.STANDARD


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


Command = AddRequest | AbortRequest | Shutdown


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    every_output: bool = True  # False: only the first output and the finished one (a non-streamed response)
    min_interval_s: float = 0.0  # streamed outputs at most this often; the held deltas join the next one
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    # Engine thread only:
    sent_first: bool = False
    last_sent_s: float = 0.0
    held_text: str = ""
    held_tokens: int = 0

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def take(self, output: RequestOutput, now: float) -> RequestOutput | None:
        """What this step hands the consumer: the output (with any held text deltas in front), or None
        to hold it. Outputs are cumulative in text, ids and logprobs, so only the deltas need carrying;
        the first output (TTFT) and the finished one always go at once."""
        due = self.every_output and now - self.last_sent_s >= self.min_interval_s
        if not (due or output.finished or not self.sent_first):
            if self.every_output:  # a final-only consumer reads cumulative fields: no delta to carry
                completion = output.outputs[0]
                self.held_text += completion.text_delta
                self.held_tokens += completion.num_new_tokens
            return None
        self.sent_first, self.last_sent_s = True, now
        if self.held_text or self.held_tokens:
            completion = output.outputs[0]
            merged = replace(completion, text_delta=self.held_text + completion.text_delta,
                             num_new_tokens=self.held_tokens + completion.num_new_tokens)
            output = replace(output, outputs=[merged, *output.outputs[1:]])
            self.held_text, self.held_tokens = "", 0
        return output


def _put_all(items: list[tuple[asyncio.Queue[RequestOutput | BaseException], RequestOutput]]) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)


# Called from the engine thread after every step, and after aborts even when no step follows (so
# gauges fall to zero when the engine idles); `finished` holds every request that ended, aborts too.
StatsListener = Callable[[StepStats, list[RequestOutput]], None]


def load_on_exiting_thread(config: EngineConfig) -> LoadedEngine:
    """load_engine on a thread of its own that ends with the load.

    Loading runs OpenMP regions (packing, the KV calibration's prefill), and libgomp keeps the team of
    every thread that ran one until that thread exits. A caller thread that lives on (the server's
    executor thread) left a second team beside the engine thread's, and libgomp, counting more of its
    threads than CPUs, then spins only briefly at every barrier: the compute threads slept and were
    woken ~190 times a decode step, and a batch-16 Qwen2.5-Coder-0.5B step took 52-54 ms in the server
    against 45-47 ms in-process on a 2-core Zen 5 (docs/performance.md). A thread that exits frees its
    team. (Leaving the `with` joins the executor's one thread; result() re-raises a failed load here.)"""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-load") as executor:
        return executor.submit(load_engine, config).result()


class AsyncEngine:
    def __init__(self, loaded: LoadedEngine) -> None:
        self.loaded = loaded
        self.engine = LLMEngine(loaded)
        self.tokenizer = loaded.tokenizer
        self.num_restarts = 0
        self.fault_injector: Callable[[], None] | None = None  # tests raise from here
        self._listeners: list[StatsListener] = []
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._ids = itertools.count()
        classes = loaded.core.config.scheduler.service_classes
        # The step-time fit, from synthetic steps while the fresh engine idles (engine/calibration.py).
        self.calibration = (IdleCalibration(self.engine.core, classes.calibration_steps)
                            if classes.enabled and classes.calibration_steps else None)
        self._ingested_aborts: list[RequestOutput] = []
        self.engine.core.before_schedule = self._ingest
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(load_on_exiting_thread(config))

    def add_stats_listener(self, listener: StatsListener) -> None:
        self._listeners.append(listener)

    # Fixed when the engine is built, so any thread may read them.
    @property
    def limits(self) -> RequestLimits:
        return self.engine.limits

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def structured(self) -> StructuredOutputs:
        """Grammar compiles (thread-safe, cached): the server checks a request's grammar before queueing."""
        return self.engine.structured

    @property
    def core(self) -> EngineCore:
        """For tests and diagnostics; only the engine thread may change it."""
        return self.engine.core

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None, priority: int = 0,
                       service_class: ServiceClass = ServiceClass.STANDARD,
                       every_output: bool = True, min_interval_s: float = 0.0,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (each carries the cumulative text and the new delta).

        `every_output=False` yields only the first output and the finished one: what a non-streamed
        response needs. The outputs between would wake the event loop every step for nothing (with a
        hundred batch requests in flight, that contends with the engine thread for the cores).
        `min_interval_s`: streamed outputs at most that often, each carrying the text held since the
        last (the server's batch-class streams: fewer, larger chunks).
        `cache_salt`: cached prefix blocks and outputs are shared only with requests of the same salt.
        Validation errors raise before the first item; the request is aborted if the consumer
        stops early.
        """
        encoded = replace(self.engine.encode(prompt), cache_salt=cache_salt)
        self.limits.check_request(encoded.token_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), every_output, min_interval_s)
        self._streams[request_id] = stream
        self._send(AddRequest(request_id, encoded, params, priority, service_class))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    def shutdown(self) -> None:
        self._stopped = True
        self._send(Shutdown())
        self._thread.join(timeout=10)

    def _send(self, command: Command) -> None:
        self._commands.put(command)
        self._wake.set()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopped:
            try:
                aborted = self._drain_commands()
                if aborted:
                    self._publish(self.engine.stats(), aborted)
                calibration = self.calibration
                if calibration is not None and calibration.active:
                    if not calibration.has_other_work():
                        calibration.step()
                        continue
                    calibration.stop()  # real work came: its synthetic requests go, the samples stay
                if not self.engine.has_unfinished:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self._step()
            except Exception as exc:  # any failure must reach every waiting client
                self._recover(exc)

    def _ingest(self) -> None:
        """Inside an overlapped step, just before the next one is scheduled: the requests that arrived
        while the running step ran (engine/pipeline.py). Not during calibration, whose steps' outputs
        go to nobody."""
        if self.calibration is not None and self.calibration.active:
            return
        self._ingested_aborts += self._drain_commands()

    def _drain_commands(self) -> list[RequestOutput]:
        """Apply every queued command; the final outputs of the requests it aborted."""
        aborted: list[RequestOutput] = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return aborted
            match command:
                case AddRequest():
                    self._add(command)
                case AbortRequest(request_id):
                    output = self.engine.abort(request_id)
                    if output is not None:
                        aborted.append(output)
                        self._deliver(output)
                case Shutdown():
                    return aborted

    def _add(self, c: AddRequest) -> None:
        if c.request_id not in self._streams:
            return  # aborted before it reached the engine
        try:
            self.engine.add_request(c.request_id, c.prompt, c.params, priority=c.priority,
                                    service_class=c.service_class)
        except Exception as exc:  # report to the one client, keep the engine alive
            self._streams[c.request_id].put(exc)

    def _step(self) -> None:
        if self.fault_injector is not None:
            self.fault_injector()
        step = self.engine.step()
        # One wake-up of each event loop per step, however many requests it serves.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[RequestOutput | BaseException],
                                                            RequestOutput]]] = {}
        now = time.monotonic()
        for output in step.outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # gone: its consumer left (and aborted it)
                continue
            taken = stream.take(output, now)
            if taken is not None:
                batches.setdefault(stream.loop, []).append((stream.queue, taken))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)
        self._publish(step.stats, step.finished)
        if self._ingested_aborts:
            aborted, self._ingested_aborts = self._ingested_aborts, []
            self._publish(self.engine.stats(), aborted)

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is not None:  # gone when its consumer left (that is what aborted it)
            stream.put(output)

    def _publish(self, stats: StepStats, finished: list[RequestOutput]) -> None:
        for listener in self._listeners:
            try:
                listener(stats, finished)
            except Exception:  # observability must never fail requests
                log.exception("stats listener failed")

    def _recover(self, exc: Exception) -> None:
        log.exception("engine step failed; failing in-flight requests and restarting the engine loop")
        self.num_restarts += 1
        error = EngineDeadError(f"the engine failed while running this request: {exc}")
        # Rebuild the scheduler and block tables from scratch: after a failure mid-step their
        # state may be inconsistent, and a clean slate is cheap (weights and KV tensors stay).
        self.engine.reset()
        for stream in list(self._streams.values()):
            stream.put(error)
