"""One API request as several engine requests (prompts × n, from `engine.inputs.fan_out`), their
outputs merged into one stream.

    GenerationRun ──pump task per child──▶ AsyncEngine.generate(child)
         ▲                                        │
         └───────────── one asyncio.Queue ◀───────┘   (child, output) | (child, error)

Each child runs its own engine request, so `n > 1` samples in parallel inside the batch.
`close()` cancels the pumps, which closes their generators and so aborts whatever is still
running in the engine: a client that goes away frees its KV blocks within one step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from tokenmill.engine.inputs import ChildRequest
from tokenmill.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.engine.request import FinishReason, TokenLogprob
from tokenmill.engine.service_class import ServiceClass
from tokenmill.server.admission import Ticket
from tokenmill.server.state import ServerState


@dataclass(slots=True)
class ChoiceUpdate:
    child: ChildRequest
    output: CompletionOutput  # cumulative text and tokens, plus this update's text delta
    is_first: bool
    prompt_logprobs: list[TokenLogprob | None] | None  # [None, lp(token 1), ...] when asked for
    metrics: RequestMetrics | None = None  # the engine request's timeline, on its finishing update

    @property
    def finish_reason(self) -> str | None:
        reason = self.output.finish_reason
        return None if reason is None else reason.value

    @property
    def is_finished(self) -> bool:
        return self.output.finish_reason is not None


def cached_prompt_tokens(updates: Iterable[ChoiceUpdate]) -> int:
    """Prompt tokens served from the prefix cache (usage.prompt_tokens_details.cached_tokens): once
    per prompt, whose n children share it, the most any of them got; finishing updates carry it."""
    best: dict[int, int] = {}
    for u in updates:
        if u.metrics is not None:
            best[u.child.prompt_index] = max(best.get(u.child.prompt_index, 0), u.metrics.num_cached_tokens)
    return sum(best.values())


def prediction_counts(updates: Iterable[ChoiceUpdate]) -> tuple[int, int] | None:
    """(accepted, rejected) prediction tokens over the choices (usage.completion_tokens_details), summed;
    None when the request sent no prediction."""
    done = [(u.child, u.metrics) for u in updates if u.metrics is not None]
    if not any(child.params.prediction for child, _ in done):
        return None
    return (sum(m.accepted_prediction_tokens for _, m in done), sum(m.rejected_prediction_tokens for _, m in done))


@dataclass(slots=True)
class _Failure:
    child: ChildRequest
    error: Exception


class GenerationRun:
    def __init__(self, state: ServerState, children: list[ChildRequest], engine_id: str, request_id: str,
                 priority: int, ticket: Ticket, received_s: float | None = None,
                 service_class: ServiceClass = ServiceClass.STANDARD) -> None:
        self.state = state
        self.children = children
        self.engine_id = engine_id  # unique per API request; children add "-<index>"
        self.request_id = request_id  # X-Request-Id, for logs
        self.priority = priority  # orders requests within the class
        self.service_class = service_class
        self.ticket = ticket
        self.received_s = received_s  # when the HTTP request arrived, for the request log
        self._queue: asyncio.Queue[tuple[ChildRequest, RequestOutput] | _Failure] = asyncio.Queue()
        self._pumps: list[asyncio.Task[None]] = []
        self._prompt_logprobs: dict[int, list[TokenLogprob | None]] = {}
        self._seen: set[int] = set()
        self._is_closed = False
        # Set by a non-streamed response before updates() starts: each child's first and final outputs
        # are all it reads (outputs are cumulative).
        self.final_only = False

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """Every child's outputs as they come, until all have finished; an engine error is raised."""
        self._start()
        num_open = len(self.children)
        try:
            while num_open > 0:
                item = await self._queue.get()
                if isinstance(item, _Failure):
                    raise item.error
                update = self._update(*item)
                if update.is_finished:
                    num_open -= 1
                yield update
        finally:
            self.close()

    def _start(self) -> None:
        if not self._pumps and not self._is_closed:
            self._pumps = [asyncio.create_task(self._pump(child)) for child in self.children]

    async def _pump(self, child: ChildRequest) -> None:
        engine = self.state.require_engine()
        try:
            async for output in engine.generate(child.prompt.token_ids, child.params,
                                                f"{self.engine_id}-{child.index}", self.priority,
                                                self.service_class, every_output=not self.final_only,
                                                min_interval_s=self._stream_interval_s(),
                                                cache_salt=child.prompt.cache_salt):
                self._queue.put_nowait((child, output))
        except Exception as exc:  # handed to the consumer, which owns the HTTP answer
            self._queue.put_nowait(_Failure(child, exc))

    def _stream_interval_s(self) -> float:
        return self.state.config.batch_stream_interval_s if self.service_class is ServiceClass.BATCH else 0.0

    def _update(self, child: ChildRequest, output: RequestOutput) -> ChoiceUpdate:
        self.state.admission.mark_started(self.ticket)
        if output.prompt_logprobs is not None:
            self._prompt_logprobs[child.index] = output.prompt_logprobs
        is_first = child.index not in self._seen
        self._seen.add(child.index)
        completion = output.outputs[0]
        if output.finished and completion.finish_reason is not FinishReason.ABORT:
            self.state.on_finished(output, self.request_id, self.received_s, self.service_class)
        return ChoiceUpdate(child, completion, is_first, self._prompt_logprobs.get(child.index),
                            output.metrics if output.finished else None)

    def close(self) -> None:
        """Abort what still runs and give the admission ticket back. Safe to call twice.

        Synchronous on purpose: it runs in `finally` blocks of cancelled tasks, where anyio
        would cancel any await again. A cancelled pump closes its engine generator on its next
        turn of the loop, which aborts the engine request.
        """
        self._is_closed = True
        for pump in self._pumps:
            pump.cancel()
        self.state.admission.release(self.ticket)
