"""The engine behind the server: EngineCore on its own thread, asyncio streams in front.

    asyncio side                         engine thread
    generate() ──commands (SimpleQueue)──▶ add / abort between steps
               ◀──call_soon_threadsafe──── RequestOutput deltas into the request's asyncio.Queue

Only the engine thread touches EngineCore, so the core needs no locks. A generator that is
closed early (client disconnect) aborts its request, freeing its blocks within one step. An
exception in a step fails every in-flight request with that error (nobody hangs), resets the
core's request state, counts a restart and carries on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tokenmill.config import EngineConfig
from tokenmill.engine.loader import LoadedEngine, eos_ids, load_engine
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.request import SamplingParams
from tokenmill.engine.stats import StepStats

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed while this request was in flight."""


@dataclass(slots=True)
class _AddCommand:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


StatsListener = Callable[[StepStats, list[RequestOutput]], None]


class AsyncEngine:
    def __init__(self, loaded: LoadedEngine) -> None:
        self.loaded = loaded
        self.core = loaded.core
        self.tokenizer = loaded.tokenizer
        self.processor = OutputProcessor(self.tokenizer)
        self.eos_token_ids = eos_ids(loaded)
        self.num_restarts = 0
        self.fault_injector: Callable[[], None] | None = None  # tests raise from here
        self._listeners: list[StatsListener] = []
        self._commands: queue.SimpleQueue[_AddCommand | str | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(load_engine(config))

    def add_stats_listener(self, listener: StatsListener) -> None:
        self._listeners.append(listener)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (each carries the cumulative text and the new delta).

        Validation errors raise before the first item; the request is aborted if the consumer
        stops early.
        """
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.core.validate(len(token_ids))
        request_id = request_id or f"req-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._send(_AddCommand(request_id, text, token_ids, params, priority))
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
        self._send(request_id)

    def shutdown(self) -> None:
        self._stopped = True
        self._send(None)
        self._thread.join(timeout=10)

    def _send(self, command: _AddCommand | str | None) -> None:
        self._commands.put(command)
        self._wake.set()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopped:
            try:
                self._drain_commands()
                if not self.core.has_unfinished:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self._step()
            except Exception as exc:  # any failure must reach every waiting client
                self._recover(exc)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _AddCommand):
                self._add(command)
            elif isinstance(command, str):
                self.core.abort(command)
                self.processor.abort(command)

    def _add(self, c: _AddCommand) -> None:
        if c.request_id not in self._streams:
            return  # aborted before it reached the engine
        try:
            self.core.add_request(c.request_id, c.prompt_token_ids, c.params, self.eos_token_ids, c.priority)
        except Exception as exc:  # report to the one client, keep the engine alive
            self._streams[c.request_id].put(exc)
            return
        self.processor.add(c.request_id, c.prompt, c.prompt_token_ids, c.params)

    def _step(self) -> None:
        if self.fault_injector is not None:
            self.fault_injector()
        result = self.core.step()
        finished: list[RequestOutput] = []
        for out in result.outputs:
            processed = self.processor.process(out)
            if processed is None:
                continue
            if processed.stopped_by_string:
                self.core.abort(out.request_id)
            if processed.output.finished:
                finished.append(processed.output)
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(processed.output)
        for listener in self._listeners:
            try:
                listener(result.stats, finished)
            except Exception:  # observability must never fail requests
                log.exception("stats listener failed")

    def _recover(self, exc: Exception) -> None:
        log.exception("engine step failed; failing in-flight requests and restarting the engine loop")
        self.num_restarts += 1
        error = EngineDeadError(f"the engine failed while running this request: {exc}")
        # Rebuild the scheduler and block tables from scratch: after a failure mid-step their
        # state may be inconsistent, and a clean slate is cheap (weights and KV tensors stay).
        self.core.reset()
        self.processor = OutputProcessor(self.tokenizer)
        for stream in list(self._streams.values()):
            stream.put(error)
