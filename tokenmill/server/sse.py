"""Server-sent events as the OpenAI API streams them: only `data:` lines, ending with `data: [DONE]`.

A failure after the stream has started cannot change the HTTP status any more, so it becomes
one terminal `data: {"error": ...}` event followed by `data: [DONE]`: no client hangs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Protocol

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenmill.server.errors import api_error_for
from tokenmill.server.fanout import ChoiceUpdate, GenerationRun
from tokenmill.server.state import ServerState

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def event(payload: BaseModel | dict[str, Any]) -> bytes:
    data = payload if isinstance(payload, dict) else payload.model_dump(mode="json")
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


class ChunkRenderer(Protocol):
    """Turns engine updates into an endpoint's chunks."""

    def opening(self) -> Iterable[BaseModel | dict[str, Any]]: ...

    def render(self, update: ChoiceUpdate) -> Iterable[BaseModel | dict[str, Any]]: ...

    def closing(self) -> Iterable[BaseModel | dict[str, Any]]: ...


async def stream_events(run: GenerationRun, renderer: ChunkRenderer, state: ServerState) -> AsyncIterator[bytes]:
    try:
        for chunk in renderer.opening():
            yield event(chunk)
        async for update in run.updates():
            for chunk in renderer.render(update):
                yield event(chunk)
        for chunk in renderer.closing():
            yield event(chunk)
    except Exception as exc:  # cancellation (client gone) is a BaseException and passes through
        state.note_restarts()
        error = api_error_for(exc)
        log.warning("stream %s failed: %s", run.engine_id, error.message)
        yield event(error.body())
    finally:
        run.close()
    yield DONE


class EventStreamResponse(StreamingResponse):
    """A stream that always closes its run, even when the client left before the first byte."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse_response(run: GenerationRun, renderer: ChunkRenderer, state: ServerState,
                 headers: dict[str, str] | None = None) -> EventStreamResponse:
    return EventStreamResponse(stream_events(run, renderer, state), on_close=run.close, headers=headers)
