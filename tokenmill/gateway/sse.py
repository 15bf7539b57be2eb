"""Server-sent events at the gateway: whole events out of a byte stream, and when a stream commits.

The gateway relays events whole (never a partial one), so that when a replica dies mid-stream
the terminal error event it appends starts on an event boundary and the client can parse it.

A stream *commits* at its first event that carries output (a token, a finish reason, [DONE]):
before it, nothing the client could act on has been sent (the chat role chunk is held back
too), so a failure there is retried on another replica without the client ever seeing it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

DONE = b"data: [DONE]\n\n"
_SEPARATOR = b"\n\n"


async def split_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Whole events, each with its trailing blank line; a trailing partial event is dropped
    (the stream was cut: the caller notices the missing [DONE])."""
    pending = b""
    async for chunk in chunks:
        pending += chunk.replace(b"\r\n", b"\n")
        while (end := pending.find(_SEPARATOR)) >= 0:
            event, pending = pending[: end + 2], pending[end + 2 :]
            if event.strip():
                yield event


def event_data(event: bytes) -> bytes:
    """The data of an event (its `data:` lines joined), as the SSE spec assembles it."""
    lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines)


def _payload(event: bytes) -> Any:
    try:
        return json.loads(event_data(event))
    except ValueError:
        return None


def is_error_event(event: bytes) -> bool:
    if b'"error"' not in event:  # the cheap test first: this runs on every relayed token
        return False
    payload = _payload(event)
    return isinstance(payload, dict) and "error" in payload


def carries_output(event: bytes) -> bool:
    """Does this event give the client something: text, a tool call, a finish reason, the end?"""
    if event_data(event) == b"[DONE]":
        return True
    payload = _payload(event)
    if not isinstance(payload, dict):
        return True  # not ours to understand: pass it on rather than hold it forever
    return any(_choice_has_output(choice) for choice in payload.get("choices") or () if isinstance(choice, dict))


def _choice_has_output(choice: dict[str, Any]) -> bool:
    if choice.get("text") or choice.get("finish_reason"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and bool(delta.get("content") or delta.get("tool_calls"))


def error_body(message: str, code: str, status: int) -> dict[str, Any]:
    """An OpenAI-style error, as the replicas write theirs."""
    error_type = "service_unavailable" if status == 503 else "server_error"
    return {"error": {"message": message, "type": error_type, "param": None, "code": code}}


def error_event(message: str, code: str, status: int = 502) -> bytes:
    body = error_body(message, code, status)
    return b"data: " + json.dumps(body, separators=(",", ":")).encode("utf-8") + _SEPARATOR
