"""One streamed request against an OpenAI-compatible endpoint, timed as vLLM's benchmark times it.

TTFT is the first chunk with non-empty `choices` that carries output. Unlike vLLM we skip a
role-only opener (`delta: {"role": "assistant", "content": ""}`): servers that send it before
the prefill (OpenAI's API does) would otherwise show a TTFT of a few milliseconds. ITL gaps are
between chunks with text. E2E ends when the stream does. Output tokens come from `usage`
(we ask for it with `stream_options.include_usage`), else one per content chunk. A tokenmill
server adds the request's exact phase times to that usage chunk (`tokenmill.timings`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenmill.bench.records import RequestRecord, TokenSource
from tokenmill.bench.sessions import Api

ERROR_TEXT_CHARS = 300
SERVER_PHASES = ("queue_s", "prefill_s", "decode_s", "ttft_s", "e2e_s")


@dataclass(slots=True, frozen=True)
class Target:
    base_url: str  # the server root, without /v1
    model: str
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def server_root(url: str) -> str:
    root = url.rstrip("/")
    return root.removesuffix("/v1")


@dataclass(slots=True)
class _StreamState:
    """What the chunks have said so far; times are perf_counter seconds."""

    sent_at: float
    first_output_at: float | None = None
    last_content_at: float | None = None
    itl_s: list[float] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    server_s: dict[str, float | None] | None = None
    error: str | None = None
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # chat: delta.tool_calls by index

    def on_chunk(self, data: dict[str, Any], api: Api, now: float) -> None:
        if isinstance(data.get("usage"), dict):
            self.usage = data["usage"]
        if isinstance(data.get("tokenmill"), dict):
            self.server_s = server_timing(data["tokenmill"])
        if "error" in data:
            self.error = json.dumps(data["error"])[:ERROR_TEXT_CHARS]
        choices = data.get("choices") or []
        if not choices:
            return
        choice = choices[0]
        text = choice.get("text") if api is Api.COMPLETIONS else (choice.get("delta") or {}).get("content")
        calls = None if api is Api.COMPLETIONS else (choice.get("delta") or {}).get("tool_calls")
        if isinstance(calls, list) and calls:
            self._add_calls(calls)
            text = text or ""  # a tool-call delta is output: it sets TTFT and the ITL gaps like text
            if self.first_output_at is None:
                self.first_output_at = now
            if self.last_content_at is not None:
                self.itl_s.append(now - self.last_content_at)
            self.last_content_at = now
        if not text and not choice.get("finish_reason"):
            return  # a role-only opener, or a keep-alive with nothing in it
        if self.first_output_at is None:
            self.first_output_at = now
        if text:
            if self.last_content_at is not None:
                self.itl_s.append(now - self.last_content_at)
            self.last_content_at = now
            self.pieces.append(text)

    def _add_calls(self, deltas: list[Any]) -> None:
        """Accumulate streamed tool calls as the OpenAI SDK does: by index, id/name/arguments appended."""
        for delta in deltas:
            if not isinstance(delta, dict) or not isinstance(delta.get("index"), int):
                continue
            call = self.tool_calls.setdefault(delta["index"], {"id": "", "type": "function",
                                                               "function": {"name": "", "arguments": ""}})
            call["id"] += delta.get("id") or ""
            fn = delta.get("function") or {}
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""

    def calls(self) -> list[dict[str, Any]]:
        return [self.tool_calls[i] for i in sorted(self.tool_calls)]


async def send(client: httpx.AsyncClient, target: Target, api: Api, payload: dict[str, Any],
               record: RequestRecord, run_start: float) -> str:
    """Sends one request, fills `record` in place and returns the generated text."""
    text, _ = await send_message(client, target, api, payload, record, run_start)
    return text


async def send_message(client: httpx.AsyncClient, target: Target, api: Api, payload: dict[str, Any],
                       record: RequestRecord, run_start: float) -> tuple[str, list[dict[str, Any]]]:
    """`send`, and the reply's tool calls (chat: `delta.tool_calls` reassembled; [] for none)."""
    body = {"model": target.model, **payload, "stream": True, "stream_options": {"include_usage": True}}
    state = _StreamState(sent_at=time.perf_counter())
    record.start_s = state.sent_at - run_start
    try:
        async with client.stream("POST", target.base_url + api.path, json=body, headers=target.headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                _fail(record, f"http_{response.status_code}", text)
                return "", []
            await _read_events(response, api, state)
    except httpx.TimeoutException as exc:
        _fail(record, "timeout", repr(exc))
        return "", []
    except httpx.ConnectError as exc:
        _fail(record, "connect_error", repr(exc))
        return "", []
    except (httpx.TransportError, httpx.StreamError) as exc:  # the server went away mid-stream
        _fail(record, "connection_lost", repr(exc))
        return "", []
    except ValueError as exc:  # a chunk that is not JSON
        _fail(record, "bad_chunk", repr(exc))
        return "", []
    _finish(record, state, time.perf_counter())
    return "".join(state.pieces), state.calls()


async def _read_events(response: httpx.Response, api: Api, state: _StreamState) -> None:
    async for line in response.aiter_lines():
        now = time.perf_counter()
        if not line.startswith("data:"):
            continue  # blank separators, comments, `event:` lines
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        state.on_chunk(json.loads(data), api, now)


def _finish(record: RequestRecord, state: _StreamState, ended_at: float) -> None:
    if state.error is not None:
        _fail(record, "stream_error", state.error)
    elif state.first_output_at is None:
        _fail(record, "no_output", "the stream ended without a chunk carrying output")
    else:
        record.ttft_s = state.first_output_at - state.sent_at
        record.e2e_s = ended_at - state.sent_at
        record.itl_s = state.itl_s
        record.server_s = state.server_s
        _count_tokens(record, state)


def server_timing(extension: dict[str, Any]) -> dict[str, float | None] | None:
    """Choice 0's phase times from a `tokenmill` extension object; None if it has none."""
    timings = extension.get("timings")
    if not isinstance(timings, list):
        return None
    first = next((t for t in timings if isinstance(t, dict) and t.get("index") == 0), None)
    if first is None:
        return None
    return {phase: _seconds(first.get(phase)) for phase in SERVER_PHASES}


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _count_tokens(record: RequestRecord, state: _StreamState) -> None:
    usage = state.usage or {}
    if isinstance(usage.get("completion_tokens"), int):
        record.output_tokens = usage["completion_tokens"]
        record.output_tokens_source = TokenSource.USAGE
    else:
        record.output_tokens = len(state.pieces)
        record.output_tokens_source = TokenSource.CHUNKS
    if isinstance(usage.get("prompt_tokens"), int):
        record.prompt_tokens = usage["prompt_tokens"]


def _fail(record: RequestRecord, kind: str, message: str) -> None:
    record.error_kind, record.error = kind, message[:ERROR_TEXT_CHARS]
    record.ttft_s = record.e2e_s = record.server_s = None
    record.itl_s, record.output_tokens = [], 0
