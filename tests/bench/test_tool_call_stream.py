"""The client on a scripted stream of tool-call deltas (split the way vLLM streams them): calls are
reassembled by index as the OpenAI SDK does, and a tool-call delta is output (TTFT, ITL)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from tokenmill.bench.client import Target, send_message
from tokenmill.bench.records import RequestRecord
from tokenmill.bench.sessions import Api, Conversation, Session, Turn


def _delta(index: int, **fields: Any) -> dict[str, Any]:
    fn = {k: fields.pop(k) for k in ("name", "arguments") if k in fields}
    return {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": index, **fields, "function": fn}]},
                         "finish_reason": None}]}


EVENTS: list[tuple[float, Any]] = [
    (0.0, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}),
    (0.1, _delta(0, id="call_a", type="function", name="read_file", arguments="")),
    (0.02, _delta(0, arguments='{"path": ')), (0.02, _delta(0, arguments='"x.py"}')),
    (0.02, _delta(1, id="call_b", name="run_python", arguments='{"code": "1"}')),
    (0.4, {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
    (0.0, {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 12}}), (0.0, "[DONE]"),
]


class _Stream(httpx.AsyncByteStream):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        for delay_s, item in EVENTS:
            await asyncio.sleep(delay_s)
            yield f"data: {item if isinstance(item, str) else json.dumps(item)}\n\n".encode()


def test_tool_call_deltas_reassemble_and_count_as_output() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=_Stream(), headers={"content-type": "text/event-stream"})

    async def go() -> tuple[RequestRecord, str, list[dict[str, Any]]]:
        record = RequestRecord(0, 0)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            text, calls = await send_message(client, Target("http://x", "m"), Api.CHAT, {"messages": []}, record, 0.0)
        return record, text, calls

    record, text, calls = asyncio.run(go())
    assert record.is_success and text == ""
    assert calls == [
        {"id": "call_a", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "x.py"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "run_python", "arguments": '{"code": "1"}'}}]
    assert record.ttft_s is not None and record.e2e_s is not None
    assert 0.1 <= record.ttft_s < record.e2e_s - 0.3  # the first call delta, not the finish 0.4 s later
    assert len(record.itl_s) == 3 and record.output_tokens == 12
    # The conversation goes on from the calls: the tool result answers the first call's id.
    conversation = Conversation(Session((Turn("go", 1, 8), Turn("result", 1, 8, role="tool")), tools=({"x": 1},),
                                        tool_choice="required", parallel_tool_calls=False))
    conversation.ask(conversation.session.turns[0])
    conversation.answer(text, calls)
    conversation.ask(conversation.session.turns[1])
    payload = conversation.payload(Api.CHAT)
    assert payload["messages"][-2] == {"role": "assistant", "content": None, "tool_calls": calls}
    assert payload["messages"][-1] == {"role": "tool", "tool_call_id": "call_a", "content": "result"}
    assert (payload["tools"], payload["tool_choice"], payload["parallel_tool_calls"]) == ([{"x": 1}], "required", False)
    conversation.answer("no call this time")
    conversation.ask(conversation.session.turns[1])
    assert conversation.messages[-1] == {"role": "user", "content": "result"}  # nothing to answer: a user message
