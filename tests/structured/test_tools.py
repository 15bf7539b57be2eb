"""Tool-call plans, parsing and streaming split (exact decisions), and the real Qwen template with tools."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tokenmill.errors import RequestValidationError
from tokenmill.server.openai_tools import ToolStream, parse_tool_calls, template_messages, tool_plan
from tokenmill.server.protocol import ChatRequest

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                     "properties": {"x": {"type": "integer"}}}}}


def _body(**kwargs: Any) -> ChatRequest:
    return ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], **kwargs})


def test_plans() -> None:
    assert tool_plan(_body()).mode == "auto"  # type: ignore[union-attr]
    assert tool_plan(_body(tool_choice="none")) is None
    required = tool_plan(_body(tool_choice="required", parallel_tool_calls=False))
    assert required is not None and required.structured() is not None
    schema = json.loads(required.structured().spec)  # type: ignore[union-attr]
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"] == {"const": "f"}
    named = tool_plan(_body(tool_choice={"type": "function", "function": {"name": "f"}}))
    assert named is not None and json.loads(named.structured().spec)["properties"] == {"x": {"type": "integer"}}  # type: ignore[union-attr]
    with pytest.raises(RequestValidationError, match="not in tools"):
        tool_plan(_body(tool_choice={"type": "function", "function": {"name": "g"}}))
    with pytest.raises(RequestValidationError, match="not supported"):
        tool_plan(_body(tool_choice="sometimes"))


TEXT = ('Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "f", "arguments": {"x": 2}}\n</tool_call>')


def test_auto_parsing_and_streaming_agree() -> None:
    plan = tool_plan(_body())
    assert plan is not None
    content, calls = parse_tool_calls(plan, TEXT)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("f", {"x": 2})]
    for size in (1, 3, 7, len(TEXT)):
        stream = ToolStream(plan)
        streamed, deltas = "", []
        for at in range(0, len(TEXT), size):
            text, more = stream.feed(TEXT[at:at + size])
            streamed += text
            deltas += more
        text, more = stream.finish()
        streamed += text
        deltas += more
        assert streamed == content, size
        assert [(d.index, d.function.name, d.function.arguments) for d in deltas if d.function] == \
            [(i, c.name, c.arguments) for i, c in enumerate(calls)]


def test_plain_text_and_broken_calls_stay_content() -> None:
    plan = tool_plan(_body())
    assert plan is not None
    assert parse_tool_calls(plan, "just text < not a tag") == ("just text < not a tag", [])
    assert parse_tool_calls(plan, "<tool_call>{oops</tool_call>")[1] == []
    stream = ToolStream(plan)
    out = stream.feed("a <tool")[0] + stream.feed("kit> b")[0] + stream.finish()[0]
    assert out == "a <toolkit> b"


def test_arguments_strings_become_objects_for_templates() -> None:
    messages = [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                      "function": {"name": "f", "arguments": '{"x": 1}'}}]}]
    assert template_messages(messages)[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}


def test_qwen_template_renders_tools_and_tool_results() -> None:
    from tokenmill.models.loading.tokenizer import Tokenizer
    from tokenmill.models.resolve import resolve_model

    try:
        path = resolve_model("qwen2.5-coder-0.5b").path
    except Exception:
        pytest.skip("qwen2.5-coder-0.5b is not installed")
    tokenizer = Tokenizer.from_gguf(Path(path))
    messages = template_messages([
        {"role": "user", "content": "x?"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "42"}])
    text = tokenizer.apply_chat_template(messages, tools=[TOOL])
    assert "<tools>" in text and '"name": "f"' in text
    assert '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>' in text
    assert "<tool_response>\n42\n</tool_response>" in text


def test_a_bare_call_object_is_a_call_in_auto_mode() -> None:
    plan = tool_plan(_body())
    assert plan is not None
    bare = '{"name": "f", "arguments": {"x": 3}}'
    assert [(c.name, c.arguments) for c in parse_tool_calls(plan, bare)[1]] == [("f", '{"x": 3}')]
    assert parse_tool_calls(plan, '{"name": "g", "arguments": {}}')[1] == []  # not a tool: content
    stream = ToolStream(plan)
    assert stream.feed(bare[:10]) == ("", []) and stream.feed(bare[10:]) == ("", [])
    content, deltas = stream.finish()
    assert content == "" and [d.function.name for d in deltas if d.function] == ["f"]


def _stream_all(plan: Any, text: str, size: int) -> tuple[str, list[tuple[str | None, str | None]], list[str]]:
    """Everything a stream emits for `text` fed `size` characters at a time, and what each feed emitted."""
    stream, streamed, calls, emitted = ToolStream(plan), "", [], []
    for at in range(0, len(text), size):
        part, deltas = stream.feed(text[at:at + size])
        streamed += part
        emitted.append(part)
        calls += [(d.function.name, d.function.arguments) for d in deltas if d.function]
    part, deltas = stream.finish()
    return streamed + part, calls + [(d.function.name, d.function.arguments) for d in deltas if d.function], emitted


def test_a_fenced_call_block_is_a_call_and_code_blocks_still_stream() -> None:
    """Qwen2.5-Coder-1.5B answers a call as one ```json block; only a block that opens with a declared
    tool's name is held back whole, so ordinary code answers stream as they come."""
    plan = tool_plan(_body())
    assert plan is not None
    fenced = '```json\n{\n  "name": "f",\n  "arguments": {"x": 3}\n}\n```'
    assert [(c.name, json.loads(c.arguments)) for c in parse_tool_calls(plan, fenced)[1]] == [("f", {"x": 3})]
    assert parse_tool_calls(plan, fenced)[0] is None
    other = '```json\n{"name": "g", "arguments": {}}\n```'  # not a tool: content
    code = "```python\ndef f(x):\n    return x + 1\n```\nThat adds one."
    trailing = fenced + "\nThen I will answer."  # a call block followed by prose is not one whole call
    for size in (1, 2, 5, 1000):
        assert _stream_all(plan, fenced, size)[:2] == ("", [("f", parse_tool_calls(plan, fenced)[1][0].arguments)])
        for text in (other, code, trailing):
            streamed, calls, _ = _stream_all(plan, text, size)
            assert (streamed or None, calls) == (parse_tool_calls(plan, text)[0], []), (text, size)
        if size < len(code):  # held no further than "```p": the code flows before its end
            assert "".join(_stream_all(plan, code, size)[2][:-1]).startswith("```python\ndef")


def test_a_named_call_streams_its_arguments_as_they_come() -> None:
    plan = tool_plan(_body(tool_choice={"type": "function", "function": {"name": "f"}}))
    assert plan is not None
    text = '{"x": 12}'
    assert [(c.name, c.arguments) for c in parse_tool_calls(plan, text)[1]] == [("f", text)]
    assert parse_tool_calls(plan, '{"x": 1')[1][0].arguments == '{"x": 1'  # cut short: still the call, as written
    stream = ToolStream(plan)
    deltas = [d for at in range(0, len(text), 2) for d in stream.feed(text[at:at + 2])[1]]
    assert stream.finish() == ("", [])
    assert deltas[0].id is not None and deltas[0].function is not None and deltas[0].function.name == "f"
    assert all(d.id is None and d.function is not None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas if d.function) == text and len(deltas) == 5
    empty = ToolStream(plan)
    (only,) = empty.finish()[1]
    assert only.function is not None and (only.function.name, only.function.arguments) == ("f", "")
