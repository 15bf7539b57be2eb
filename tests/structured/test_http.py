"""Structured outputs, tool calls and cached-token usage through the official `openai` client
against a live server on the tiny random model (whose free samples are never valid JSON)."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL, LiveServer

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "rain": {"type": "boolean"},
                   "level": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["city", "rain", "level"], "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
MESSAGES: list[Any] = [{"role": "user", "content": "weather in Paris?"}]


def _format() -> Any:
    return {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}


def test_json_schema_outputs_validate_streamed_and_not(client: openai.OpenAI) -> None:
    for seed in range(8):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=1.0, seed=seed,
                                           response_format=_format())
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), SCHEMA)
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, seed=seed,
                                                response_format=_format(), stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == r.choices[0].message.content  # same seed, same grammar, same tokens


def test_n_children_each_follow_the_grammar(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, n=4, seed=1,
                                       response_format=_format())
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_json_object_and_guided_fields_on_completions(client: openai.OpenAI) -> None:
    choices = ["red", "green", "blue"]
    for seed in range(6):
        c = client.completions.create(model=MODEL, prompt="colour:", max_tokens=10, seed=seed,
                                      extra_body={"guided_choice": choices})
        assert c.choices[0].text in choices
        r = client.completions.create(model=MODEL, prompt="code:", max_tokens=20, seed=seed,
                                      extra_body={"guided_regex": r"[A-Z]{3}-\d{2}"})
        assert re.fullmatch(r"[A-Z]{3}-\d{2}", r.choices[0].text)
        s = client.completions.create(model=MODEL, prompt="x", max_tokens=80, seed=seed,
                                      extra_body={"structured_outputs": {"json": SCHEMA}})
        jsonschema.validate(json.loads(s.choices[0].text), SCHEMA)
    g = client.completions.create(model=MODEL, prompt="x", max_tokens=20, seed=3,
                                  extra_body={"guided_grammar": 'root ::= "a" ("b" | "c")* "."'})
    assert re.fullmatch(r"a[bc]*\.", g.choices[0].text) or g.choices[0].finish_reason == "length"


@pytest.mark.parametrize(("extra", "param", "needle"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format",
     "JSON schema cannot be compiled: Invalid type: nonsense"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "regex cannot be compiled"),
    ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar",
     "grammar cannot be compiled: Rule 'missing_rule' not found"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one output format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
])
def test_bad_grammars_and_tool_choices_are_400_naming_the_problem(structured_live: LiveServer, extra: dict[str, Any],
                                                                 param: str, needle: str) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra}
    response = httpx.post(f"{structured_live.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert needle in error["message"], error["message"]


def _arguments_valid(call: Any) -> dict[str, Any]:
    fn = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]
    args: dict[str, Any] = json.loads(call.function.arguments)
    jsonschema.validate(args, fn["parameters"])
    return args


def test_tool_choice_required_returns_parsed_tool_calls(client: openai.OpenAI) -> None:
    for seed in range(6):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME],
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                                           seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls or []
        assert len(calls) == 1 and calls[0].id.startswith("call_") and calls[0].type == "function"
        _arguments_valid(calls[0])


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=80, seed=2,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls or []
    assert call.function.name == "get_time" and _arguments_valid(call)["zone"] in ("utc", "cet")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_deltas_reassemble_to_the_same_call(client: openai.OpenAI, tool_choice: Any) -> None:
    """required: the calls whole in the last chunk; named: its arguments as they come (OpenAI's way)."""
    kwargs: Any = {"model": MODEL, "messages": MESSAGES, "tools": [WEATHER, TIME], "tool_choice": tool_choice,
                   "max_tokens": 160, "seed": 5}
    whole = client.chat.completions.create(**kwargs)
    calls: dict[int, dict[str, str]] = {}
    finish, num_chunks = None, 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        num_chunks += bool(chunk.choices[0].delta.tool_calls)
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": ""})
            entry["id"] += d.id or ""
            entry["name"] += (d.function.name or "") if d.function else ""
            entry["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected and expected
    assert all(calls[i]["id"].startswith("call_") for i in calls)
    assert finish == "tool_calls"
    assert num_chunks > 1 if isinstance(tool_choice, dict) else num_chunks == 1  # required: parsed at the end


def test_tool_results_round_trip(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="required",
                                           max_tokens=120, seed=0)
    (call,) = first.choices[0].message.tool_calls or []
    messages: list[Any] = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8, seed=0)
    assert final.choices[0].message.role == "assistant"
    assert final.choices[0].finish_reason in ("stop", "length")


def test_cached_tokens_show_a_repeated_prompt(client: openai.OpenAI) -> None:
    prompt = "the same long prompt " * 12  # several 16-token blocks
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens or 0
    assert 16 <= cached < again.usage.prompt_tokens
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2,
                                            stream=True, stream_options={"include_usage": True})
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2)
    usages = [c.usage for c in stream if c.usage is not None]
    assert usages and usages[-1].prompt_tokens_details is not None
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2,
                                            stream=True, stream_options={"include_usage": True})
    (usage,) = [c.usage for c in stream if c.usage is not None]
    assert usage.prompt_tokens_details is not None and (usage.prompt_tokens_details.cached_tokens or 0) >= 16
