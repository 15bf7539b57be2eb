"""POST /v1/responses (OpenAI's Responses API) through the official `openai` client against a live server
on the tiny random model: text, streaming events, function calls, structured text, logprobs, refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL, LiveServer, start_server, tiny_engine_config
from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server.response_store import ResponseStore, StoredResponse

GREEDY: dict[str, Any] = {"temperature": 0.0}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                           "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                       "required": ["zone"], "additionalProperties": False}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


def _respond(client: openai.OpenAI, **kwargs: Any) -> Any:
    extra = {**GREEDY, **kwargs.pop("extra_body", {})}
    return client.responses.create(model=MODEL, extra_body=extra, **kwargs)


def _events(client: openai.OpenAI, **kwargs: Any) -> list[Any]:
    return list(_respond(client, stream=True, **kwargs))


def test_text_answer_equals_the_chat_answer(client: openai.OpenAI) -> None:
    r = _respond(client, input="Hello there", instructions="Be brief.", max_output_tokens=6,
                 extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True},
                                          messages=[{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Hello there"}])
    assert r.id.startswith("resp") and r.object == "response" and r.model == MODEL
    assert r.output_text == chat.choices[0].message.content
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 6
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.total_tokens == r.usage.input_tokens + 6


def test_a_stream_sends_the_typed_events_in_order_and_the_same_text(client: openai.OpenAI) -> None:
    whole = _respond(client, input="Tell me more", max_output_tokens=8, extra_body={"ignore_eos": True})
    events = _events(client, input="Tell me more", max_output_tokens=8, extra_body={"ignore_eos": True})
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output[0].content[0].text
    assert events[-1].response.usage.output_tokens == 8


def test_the_sdk_stream_helper_accumulates_a_completed_response(client: openai.OpenAI) -> None:
    full = _respond(client, input="abc", max_output_tokens=12, extra_body={"ignore_eos": True}).output_text
    stop = full[4:7]
    assert stop, "the model's output is too short for this test"
    with client.responses.stream(model=MODEL, input="abc", max_output_tokens=12,
                                 extra_body={**GREEDY, "ignore_eos": True, "stop": [stop]}) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == full[: full.index(stop)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called_with_arguments_that_match_its_schema(client: openai.OpenAI,
                                                                        stream: bool) -> None:
    kwargs: dict[str, Any] = {"input": "weather in Paris?", "tools": [WEATHER, TIME], "max_output_tokens": 80,
                              "tool_choice": {"type": "function", "name": "get_weather"}}
    if stream:
        events = _events(client, **kwargs)
        assert events[-1].type == "response.completed"
        output = events[-1].response.output
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert [e.arguments for e in done] == [output[0].arguments]
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert len(deltas) > 1 and "".join(deltas) == output[0].arguments  # the arguments as they come
    else:
        output = _respond(client, **kwargs).output
    assert [item.type for item in output] == ["function_call"]
    call = output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_required_calls_come_back_as_items_and_a_round_trip_is_accepted(client: openai.OpenAI) -> None:
    r = _respond(client, input="time and weather?", tools=[WEATHER, TIME], tool_choice="required",
                 max_output_tokens=120)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and all(c.name in ("get_weather", "get_time") for c in calls)
    history: list[Any] = [{"role": "user", "content": "time and weather?"}]
    for c in calls:
        history.append({"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments})
        history.append({"type": "function_call_output", "call_id": c.call_id, "output": '{"result": 1}'})
    answer = _respond(client, input=history, tools=[WEATHER, TIME], tool_choice="none", max_output_tokens=4,
                      extra_body={"ignore_eos": True})
    assert [item.type for item in answer.output] == ["message"]
    assert answer.usage is not None and answer.usage.input_tokens > r.usage.input_tokens


def test_json_schema_text_format_and_logprobs(client: openai.OpenAI) -> None:
    text = {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}}
    r = _respond(client, input="json please", text=text, max_output_tokens=60, top_logprobs=2,
                 include=["message.output_text.logprobs"])
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    logprobs = r.output[0].content[0].logprobs
    assert r.usage is not None and len(logprobs) == r.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0.0 for lp in logprobs)
    assert "".join(lp.token for lp in logprobs).startswith(r.output_text)  # and the end-of-turn token, as in chat


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "x", "use_beam_search": True}, "use_beam_search"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "n": 2}, "n"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": 7}, "input"),
])
def test_what_the_server_cannot_do_is_a_400_naming_the_field(structured_live: LiveServer, body: dict[str, Any],
                                                            param: str) -> None:
    response = httpx.post(f"{structured_live.url}/v1/responses", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_previous_response_id_continues_the_stored_conversation(client: openai.OpenAI) -> None:
    first = _respond(client, input="My name is Ann.", instructions="Be brief.", max_output_tokens=5,
                     extra_body={"ignore_eos": True})
    assert first.store is True
    events = _events(client, previous_response_id=first.id, input="And yours?", max_output_tokens=5,
                     extra_body={"ignore_eos": True})
    second = events[-1].response
    assert second.previous_response_id == first.id
    # the engine saw the conversation: the first turn's input and answer, then the new input (the first
    # turn's instructions are not carried over, as OpenAI's are not)
    chat = client.chat.completions.create(model=MODEL, max_tokens=5, temperature=0.0, extra_body={"ignore_eos": True},
                                          messages=[{"role": "user", "content": "My name is Ann."},
                                                    {"role": "assistant", "content": first.output_text},
                                                    {"role": "user", "content": "And yours?"}])
    assert second.output[0].content[0].text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    third = _respond(client, previous_response_id=second.id, input="Thanks.", max_output_tokens=2)
    assert third.usage is not None and third.usage.input_tokens > second.usage.input_tokens  # a streamed one is stored
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as caught:
        _respond(client, previous_response_id=first.id, input="x", max_output_tokens=2)
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    r = _respond(client, input="secret", store=False, max_output_tokens=2)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def _own_engine(live: LiveServer) -> AsyncEngine:
    # another server gets an engine of its own (over the same weights): one engine's metrics have one home
    return AsyncEngine.from_config(tiny_engine_config(Path(live.engine.loaded.source.path)))


def test_a_stored_response_belongs_to_its_api_key(structured_live: LiveServer) -> None:
    engine = _own_engine(structured_live)
    server = start_server(engine, ServerConfig(served_model_name=MODEL,
                                               api_key_classes=(("key-a", "interactive"), ("key-b", "interactive"))))
    try:
        a, b = server.client(api_key="key-a"), server.client(api_key="key-b")
        r = a.responses.create(model=MODEL, input="mine", max_output_tokens=2)
        assert a.responses.retrieve(r.id).id == r.id
        for attempt in (lambda: b.responses.retrieve(r.id), lambda: b.responses.delete(r.id),
                        lambda: b.responses.create(model=MODEL, previous_response_id=r.id, input="x",
                                                   max_output_tokens=2)):
            with pytest.raises(openai.NotFoundError):
                attempt()
        assert a.responses.retrieve(r.id).id == r.id  # b's delete did not remove it
    finally:
        server.stop()
        engine.shutdown()


def test_a_server_without_a_store_says_so(structured_live: LiveServer) -> None:
    engine = _own_engine(structured_live)
    server = start_server(engine, ServerConfig(served_model_name=MODEL, responses_store_size=0))
    try:
        r = server.client().responses.create(model=MODEL, input="x", max_output_tokens=2)
        assert r.store is False
        with pytest.raises(openai.BadRequestError, match="keeps no responses"):
            server.client().responses.create(model=MODEL, input="x", previous_response_id=r.id, max_output_tokens=2)
    finally:
        server.stop()
        engine.shutdown()


def test_the_store_forgets_the_least_recently_used_first() -> None:
    store = ResponseStore(2)
    for name in ("r1", "r2"):
        store.put(name, StoredResponse(None, [], {"id": name}))
    assert store.get("r1", None) is not None  # r1 is now the most recently used
    store.put("r3", StoredResponse(None, [], {"id": "r3"}))
    assert [store.get(n, None) is not None for n in ("r1", "r2", "r3")] == [True, False, True]
    assert store.get("r1", "someone-else") is None and not store.delete("r1", "someone-else")
    got = store.get("r1", None)
    assert got is not None
    got.history.append({"role": "user"})
    assert store.get("r1", None).history == []  # type: ignore[union-attr]  # readers get copies


def test_every_answer_names_its_response_in_a_header_for_the_gateway(structured_live: LiveServer) -> None:
    for stream in (False, True):
        with httpx.stream("POST", f"{structured_live.url}/v1/responses",
                          json={"model": MODEL, "input": "x", "max_output_tokens": 2, "stream": stream}) as answer:
            text = "".join(answer.iter_text())
            assert answer.status_code == 200
            response_id = answer.headers["x-tokenmill-response-id"]
        assert response_id.startswith("resp") and f'"id":"{response_id}"' in text.replace(" ", "")


@pytest.mark.parametrize("form", ["tagged", "bare"])
def test_a_continuation_repeats_the_tokens_of_a_call_in_the_templates_form(client: openai.OpenAI, form: str) -> None:
    """A call the model wrote in the template's own form (pinned by a regex) is kept as its text: the next
    turn's prompt starts with every token of the first, so all its full blocks are cache hits. A bare call
    object is kept as a structured call, which the template renders in its form (see written_calls.py)."""
    call_schema = {"type": "object", "properties": {"name": {"const": "get_time"},
                                                    "arguments": {"type": "object", "properties": {
                                                        "zone": {"enum": ["utc"]}}, "required": ["zone"],
                                                                  "additionalProperties": False}},
                   "required": ["name", "arguments"], "additionalProperties": False}
    pin: dict[str, Any] = {"extra_body": {"guided_regex": r'<tool_call>\n\{"name": "get_time", "arguments": '
                                                          r'\{"zone": "utc"\}\}\n</tool_call>'}} \
        if form == "tagged" else {"text": {"format": {"type": "json_schema", "name": "c", "schema": call_schema}}}
    first = _respond(client, input=f"{form}: what time is it? " * 3, tools=[WEATHER, TIME], max_output_tokens=100,
                     **pin)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_time"
    second = _respond(client, previous_response_id=first.id, tools=[WEATHER, TIME], max_output_tokens=2,
                      input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}])
    written = first.usage.input_tokens + first.usage.output_tokens
    cached = second.usage.input_tokens_details.cached_tokens
    # tagged: every token the first turn computed (all but its last, sampled one: full blocks, then the
    # rows of its partial last block, copied); bare: the prompt differs from the first call's tokens on
    assert cached == written - 1 if form == "tagged" else cached < written - written % 16
