"""`truncation: "auto"` on /v1/responses: the fewest oldest turns dropped, calls kept with their outputs."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL, LiveServer
from tokenmill.server.protocol import ChatMessage
from tokenmill.server.truncation import fit_conversation, turns_of


def _m(role: str, content: str | None = None, calls: int = 0) -> ChatMessage:
    tool_calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                  for i in range(calls)]
    return ChatMessage(role=role, content=content, tool_calls=tool_calls or None,
                       tool_call_id="c0" if role == "tool" else None)


def test_turns_keep_calls_with_their_outputs_and_the_instructions_stay() -> None:
    messages = [_m("system", "rules"), _m("user", "a"), _m("assistant", None, calls=2), _m("tool", "1"),
                _m("tool", "2"), _m("assistant", "b"), _m("system", "late note"), _m("user", "c")]
    lead, turns = turns_of(messages)
    assert lead == messages[:1]
    assert [len(t) for t in turns] == [1, 3, 1, 1, 1]  # the call and both outputs are one turn
    size = {m.content or "call": len(m.content or "call") for m in messages}

    def fits_in(limit: int) -> Any:
        return lambda ms: sum(size[m.content or "call"] for m in ms) <= limit

    assert fit_conversation(messages, fits_in(100)) is messages  # fits: untouched
    kept = fit_conversation(messages, fits_in(5 + 1 + 9 + 1))  # rules + b + late note + c: the call turn goes whole
    assert [m.content for m in kept] == ["rules", "b", "late note", "c"]
    assert [m.content for m in fit_conversation(messages, fits_in(0))] == ["rules", "c"]  # the newest always stays


def test_a_long_conversation_is_cut_to_the_context_only_when_asked(structured_live: LiveServer) -> None:
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "words " * 6}
             for i in range(11)]
    body: dict[str, Any] = {"model": MODEL, "instructions": "Be brief.", "input": turns, "max_output_tokens": 4,
                            "temperature": 0.0}
    refused = httpx.post(f"{structured_live.url}/v1/responses", json=body)
    assert refused.status_code == 400, refused.text
    answered = httpx.post(f"{structured_live.url}/v1/responses", json={**body, "truncation": "auto"})
    assert answered.status_code == 200, answered.text
    assert answered.json()["truncation"] == "auto"
    system = [{"role": "system", "content": "Be brief."}]
    counts = [httpx.post(f"{structured_live.url}/tokenize", json={"messages": system + turns[k:]}).json()["count"]
              for k in range(len(turns))]
    context = structured_live.engine.max_model_len
    fewest = next(k for k, count in enumerate(counts) if count + 4 <= context)
    assert fewest > 0 and answered.json()["usage"]["input_tokens"] == counts[fewest]


@pytest.mark.parametrize("truncation", ["sometimes", 1])
def test_truncation_takes_auto_or_disabled(structured_live: LiveServer, truncation: object) -> None:
    response = httpx.post(f"{structured_live.url}/v1/responses", json={"model": MODEL, "input": "x",
                                                                       "truncation": truncation})
    assert response.status_code == 400 and response.json()["error"]["param"] == "truncation"
