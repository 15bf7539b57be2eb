"""The streaming client on scripted SSE streams: what counts as the first token, ITL, usage, errors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest

from tokenmill.bench.client import Target, send, server_root
from tokenmill.bench.records import RequestRecord, TokenSource
from tokenmill.bench.sessions import Api

Event = tuple[float, dict[str, Any] | str]  # (seconds to wait before it, chunk or raw line)


def chat(content: str | None = None, role: str | None = None, finish: str | None = None) -> dict[str, Any]:
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}


class _Stream(httpx.AsyncByteStream):
    def __init__(self, events: Sequence[Event]) -> None:
        self.events = events

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for delay_s, item in self.events:
            await asyncio.sleep(delay_s)
            line = item if isinstance(item, str) else json.dumps(item)
            yield f"data: {line}\n\n".encode()


def run(events: Sequence[Event], status: int = 200, api: Api = Api.CHAT) -> tuple[RequestRecord, str, dict[str, Any]]:
    seen: dict[str, Any] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content), path=request.url.path)
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "queue full"}})
        return httpx.Response(200, stream=_Stream(events), headers={"content-type": "text/event-stream"})

    async def go() -> tuple[RequestRecord, str]:
        record = RequestRecord(0, 0, prompt_tokens=5)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            text = await send(client, Target("http://x", "m"), api, {"messages": []}, record, 0.0)
        return record, text

    record, text = asyncio.run(go())
    return record, text, seen


def test_role_opener_is_not_the_first_token_and_itl_is_between_content_chunks() -> None:
    record, text, body = run([(0.0, chat(role="assistant", content="")), (0.15, chat("Hel")), (0.05, chat("lo")),
                              (0.05, chat(finish="stop")), (0.0, usage(7, 3)), (0.0, "[DONE]")])
    assert record.is_success and text == "Hello"
    assert record.ttft_s is not None and record.ttft_s >= 0.15
    assert len(record.itl_s) == 1 and record.itl_s[0] >= 0.05  # the finish-only chunk adds no gap
    assert record.e2e_s is not None and record.e2e_s >= record.ttft_s + 0.1
    assert (record.output_tokens, record.prompt_tokens, record.output_tokens_source) == (3, 7, TokenSource.USAGE)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["path"] == "/v1/chat/completions" and body["model"] == "m"


def test_completions_text_and_chunk_count_without_usage() -> None:
    events: list[Event] = [(0.0, {"choices": [{"text": t, "finish_reason": None}]}) for t in ("a", "b", "c")]
    record, text, body = run([*events, (0.0, "[DONE]")], api=Api.COMPLETIONS)
    assert text == "abc" and body["path"] == "/v1/completions"
    assert (record.output_tokens, record.output_tokens_source) == (3, TokenSource.CHUNKS)
    assert record.prompt_tokens == 5  # the dataset's count stays when the server sends no usage
    assert len(record.itl_s) == 2


def test_a_finish_chunk_without_text_still_ends_the_wait() -> None:
    record, text, _ = run([(0.0, chat(role="assistant", content="")), (0.1, chat(finish="length")),
                           (0.0, usage(3, 1)), (0.0, "[DONE]")])
    assert record.is_success and text == "" and record.itl_s == []
    assert record.ttft_s is not None and record.ttft_s >= 0.1 and record.tpot_s is None


@pytest.mark.parametrize(("events", "status", "kind"), [
    ([], 429, "http_429"),
    ([(0.0, chat("x")), (0.0, {"error": {"message": "engine died"}}), (0.0, "[DONE]")], 200, "stream_error"),
    ([(0.0, chat(role="assistant", content="")), (0.0, "[DONE]")], 200, "no_output"),
    ([(0.0, "{not json")], 200, "bad_chunk"),
])
def test_failures_by_kind(events: list[Event], status: int, kind: str) -> None:
    record, _, _ = run(events, status)
    assert record.error_kind == kind and not record.is_success
    assert record.ttft_s is None and record.output_tokens == 0 and record.start_s is not None


def test_connection_refused() -> None:
    async def go() -> RequestRecord:
        record = RequestRecord(0, 0)
        async with httpx.AsyncClient() as client:
            await send(client, Target("http://127.0.0.1:9", "m"), Api.CHAT, {"messages": []}, record, 0.0)
        return record

    assert asyncio.run(go()).error_kind == "connect_error"


def test_server_root_strips_v1() -> None:
    assert server_root("http://h:1/v1/") == server_root("http://h:1") == "http://h:1"


def test_the_servers_phase_times_are_read_from_the_usage_chunk() -> None:
    timing = {"index": 0, "queue_s": 0.0001, "prefill_s": 0.02, "decode_s": 0.3, "ttft_s": 0.0201, "e2e_s": 0.3201}
    other = {**timing, "index": 1, "queue_s": 9.0}
    final = {**usage(5, 2), "tokenmill": {"timings": [other, timing]}}
    record, _, _ = run([(0.0, chat("a")), (0.0, chat("b", finish="length")), (0.0, final), (0.0, "[DONE]")])
    assert record.server_s == {k: v for k, v in timing.items() if k != "index"}
    assert RequestRecord.from_json(record.to_json()).server_s == record.server_s
    plain, _, _ = run([(0.0, chat("a", finish="length")), (0.0, usage(5, 1)), (0.0, "[DONE]")])
    assert plain.server_s is None  # llama-server, vLLM: no extension
    broken, _, _ = run([(0.0, chat("a", finish="length")), (0.0, {**usage(5, 1), "tokenmill": {"timings": 3}}),
                        (0.0, "[DONE]")])
    assert broken.server_s is None
