"""Chat answers with tool calls sent back unchanged are rendered as the model wrote them (server/written_calls.py):
the next turn's prompt repeats the generated tokens, so the prefix cache holds the whole previous turn."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, LiveServer
from tokenmill.server.protocol import ChatMessage
from tokenmill.server.written_calls import WrittenCalls

TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
# Pins the free (auto) answer to a call in the template's own form, which the tiny random model would never write
TAGGED = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(utc|cet)"\}\}\n</tool_call>'
# ...and to a bare call object, which is a call too but not in the template's form
BARE = {"type": "json_schema", "json_schema": {"name": "c", "schema": {
    "type": "object", "properties": {"name": {"const": "get_time"}, "arguments": TIME["function"]["parameters"]},
    "required": ["name", "arguments"], "additionalProperties": False}}}
ASK: list[Any] = [{"role": "user", "content": "What time is it in the usual zone? " * 3}]


def _assistant(call_id: str, arguments: str, content: str | None = None) -> ChatMessage:
    return ChatMessage(role="assistant", content=content, tool_calls=[
        {"id": call_id, "type": "function", "function": {"name": "get_time", "arguments": arguments}}])


def test_only_an_unchanged_message_of_the_same_key_is_rendered_as_written() -> None:
    kept = WrittenCalls(capacity=2)
    kept.note("key-a", '{"name": "get_time", "arguments": {"zone": "utc"}}', None,
              [("call_1", "get_time", '{"zone": "utc"}')])
    same = _assistant("call_1", '{"zone": "utc"}')
    (restored,) = kept.restore([same], "key-a")
    assert restored.tool_calls is None and restored.content == '{"name": "get_time", "arguments": {"zone": "utc"}}'
    for changed, owner in ((_assistant("call_1", '{"zone": "cet"}'), "key-a"), (same, "key-b"),
                           (_assistant("call_1", '{"zone": "utc"}', content="hmm"), "key-a"),
                           (_assistant("call_2", '{"zone": "utc"}'), "key-a")):
        assert kept.restore([changed], owner) == [changed]
    for i in (2, 3):
        kept.note(None, "x", None, [(f"call_{i}", "get_time", "{}")])
    assert kept.restore([same], "key-a") == [same]  # forgotten: the least recently used went first


def _ask(stream: bool) -> list[Any]:
    # each case its own conversation: one case's turns must not be the other's cache hits
    return [{"role": "user", "content": f"{'Streaming: ' if stream else ''}{ASK[0]['content']}"}]


def _first_turn(client: openai.OpenAI, stream: bool) -> tuple[dict[str, Any], Any]:
    kwargs: Any = {"model": MODEL, "messages": _ask(stream), "tools": [TIME], "max_tokens": 80, "temperature": 0.0,
                   "extra_body": {"guided_regex": TAGGED}}
    if not stream:
        r = client.chat.completions.create(**kwargs)
        assert r.choices[0].finish_reason == "tool_calls"
        return r.choices[0].message.model_dump(exclude_none=True), r.usage
    calls: dict[int, dict[str, str]] = {}
    usage = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += d.id or ""
            entry["name"] += (d.function.name or "") if d.function else ""
            entry["arguments"] += (d.function.arguments or "") if d.function else ""
    message = {"role": "assistant", "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for _, c in sorted(calls.items())]}
    return message, usage


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_sent_back_unchanged_keeps_the_whole_turn_cached(client: openai.OpenAI, structured_live: LiveServer,
                                                               stream: bool) -> None:
    message, usage = _first_turn(client, stream)
    (call,) = message["tool_calls"]
    written = usage.prompt_tokens + usage.completion_tokens
    result = {"role": "tool", "tool_call_id": call["id"], "content": '{"time": "12:00"}'}
    second = client.chat.completions.create(model=MODEL, messages=[*_ask(stream), message, result], tools=[TIME],
                                            max_tokens=2, temperature=0.0)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    # every token the first turn computed: its full blocks and its partial last block's rows (all but the
    # last token it sampled, which no step computed)
    assert second.usage.prompt_tokens_details.cached_tokens == written - 1
    counted = httpx.post(f"{structured_live.url}/tokenize", json={"messages": [*_ask(stream), message, result],
                                                                  "tools": [TIME]}).json()["count"]
    assert counted == second.usage.prompt_tokens  # /tokenize counts the prompt the request ran
    edited = call["function"]["arguments"] + " "  # the client touched it: rendered from its fields
    changed = {**message, "tool_calls": [{**call, "function": {**call["function"], "arguments": edited}}]}
    third = client.chat.completions.create(model=MODEL, messages=[*_ask(stream), changed, result], tools=[TIME],
                                           max_tokens=2, temperature=0.0)
    assert third.usage is not None and third.usage.prompt_tokens_details is not None
    assert third.usage.prompt_tokens_details.cached_tokens < written - written % 16  # rendered from its fields


@pytest.mark.parametrize("form", ["required", "bare"])
def test_calls_not_written_in_the_templates_form_render_from_their_fields(client: openai.OpenAI, form: str) -> None:
    """A grammar's JSON array (required) or a bare call object: shown back as the model's own turn they taught it
    other call forms (see written_calls.py), so the template renders them."""
    ask = [{"role": "user", "content": f"{form}: " + ASK[0]["content"]}]
    how: Any = {"tool_choice": "required", "parallel_tool_calls": False} if form == "required" else \
        {"response_format": BARE}
    first = client.chat.completions.create(model=MODEL, messages=ask, tools=[TIME], max_tokens=60, temperature=0.0,
                                           **how)
    message = first.choices[0].message.model_dump(exclude_none=True)
    assert first.usage is not None and message["tool_calls"]
    result = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "12:00"}
    second = client.chat.completions.create(model=MODEL, messages=[*ask, message, result], tools=[TIME],
                                            max_tokens=2, temperature=0.0)
    written = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens < written - written % 16
