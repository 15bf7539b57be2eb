"""Tool calling and JSON schema with Qwen2.5-Coder-0.5B through the `openai` client (slow, real weights)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from tests.server.conftest import LiveServer, serve_real_model

MODEL = "qwen2.5-coder-0.5b"
pytestmark = pytest.mark.slow
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris, in celsius? Use the tool."}]


@pytest.fixture(scope="module")
def qwen() -> Iterator[LiveServer]:
    yield from serve_real_model(MODEL, num_blocks=512)


def test_auto_and_required_tool_calls_then_a_final_answer(qwen: LiveServer) -> None:
    client = qwen.client()
    for choice in ("auto", "required"):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                           max_tokens=80, temperature=0.0)
        (call,) = r.choices[0].message.tool_calls or []
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, WEATHER["function"]["parameters"])
        assert "paris" in args["city"].lower()
    messages = [*ASK, r.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=40,
                                           temperature=0.0)
    assert "21" in (final.choices[0].message.content or "")


def test_json_schema_answers_validate(qwen: LiveServer) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    for seed in range(3):
        r = qwen.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Invent a person as JSON."}], max_tokens=60, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)


def test_streamed_tool_call_deltas_reassemble_to_the_non_streamed_calls(qwen: LiveServer) -> None:
    client = qwen.client()
    for choice in ("auto", "required"):
        kwargs: Any = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": choice, "max_tokens": 80,
                       "temperature": 0.0}
        whole = client.chat.completions.create(**kwargs).choices[0]
        calls: dict[int, dict[str, str]] = {}
        content, finish = "", None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = chunk.choices[0].finish_reason or finish
        expected = [{"name": c.function.name, "arguments": c.function.arguments}
                    for c in whole.message.tool_calls or []]
        assert expected and [calls[i] for i in sorted(calls)] == expected, choice
        assert (content or None) == whole.message.content and finish == whole.finish_reason == "tool_calls"


def test_the_responses_api_calls_the_tool_then_answers_from_its_output(qwen: LiveServer) -> None:
    """An agent's loop over /v1/responses with free (auto) decoding: the model's `<tool_call>` block is a
    function_call item, streamed or not; its output sent back as a function_call_output item is read."""
    client = qwen.client()
    fn = WEATHER["function"]
    tools: Any = [{"type": "function", "name": fn["name"], "description": fn["description"],
                   "parameters": fn["parameters"]}]
    ask: Any = [{"role": "user", "content": ASK[0]["content"]}]
    r = client.responses.create(model=MODEL, input=ask, tools=tools, max_output_tokens=80, temperature=0.0)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and call.name == "get_weather"
    assert "paris" in json.loads(call.arguments)["city"].lower()
    with client.responses.stream(model=MODEL, input=ask, tools=tools, max_output_tokens=80,
                                 temperature=0.0) as stream:
        streamed = stream.get_final_response()
    assert [(i.type, getattr(i, "arguments", None)) for i in streamed.output] == \
        [(i.type, getattr(i, "arguments", None)) for i in r.output]
    turn = [*ask, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21, "sky": "sunny"}'}]
    final = client.responses.create(model=MODEL, input=turn, tools=tools, max_output_tokens=40, temperature=0.0)
    assert "21" in final.output_text
