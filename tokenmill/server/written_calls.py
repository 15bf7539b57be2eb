"""Chat answers with tool calls, kept as the model wrote them, so that the next turn's prompt repeats them.

An agent on /v1/chat/completions sends the assistant's message back with its `tool_calls`, and the chat
template renders those calls in its own form: where the model wrote a call differently (spacing, key order),
the prompt's tokens stop matching the generated ones at the start of the assistant turn, so the prefix cache
misses from there and the turn's answer is prefilled again. Here the server remembers each answer with calls
(by its first call's id, bounded in count and characters, least recently used forgotten first) and, when a
request sends that message back unchanged (the same call ids, names, arguments and content, from the same API
key), renders the message as the text the model wrote; a changed message renders from its fields.

Only answers whose calls the model wrote in the template's own form (`<tool_call>` blocks, free decoding:
openai_tools.calls_in_template_form) are kept: there the written text and the rendering differ in spacing
and key order only. A call written otherwise (Qwen2.5-Coder-1.5B's ```json blocks), shown back as written,
taught the model to call the tool again after every result (the OpenAI Agents SDK's run hit its turn limit),
and a grammar's answer (required: a JSON array) to answer the next turn in arrays; both render from their
fields. /v1/responses keeps its own history by the same rule (responses_output.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.bounded_lru import BoundedLru
from tokenmill.server.protocol import ChatMessage
from tokenmill.server.response_bodies import ToolCallOut

Call = tuple[str, str, str]  # (id, name, arguments) as the client received them


@dataclass(frozen=True, slots=True)
class _Written:
    owner: str | None
    text: str  # the answer as the model wrote it
    content: str | None  # the message content the client received
    calls: tuple[Call, ...]


class WrittenCalls:
    def __init__(self, capacity: int = 10_000, max_chars: int = 64 << 20) -> None:
        self._entries: BoundedLru[str, _Written] = BoundedLru(capacity, max_chars, _chars)

    def note(self, owner: str | None, text: str, content: str | None, calls: Sequence[Call]) -> None:
        if calls:
            self._entries.put(calls[0][0], _Written(owner, text, content or None, tuple(calls)))

    def restore(self, messages: list[ChatMessage], owner: str | None) -> list[ChatMessage]:
        """`messages` with each unchanged assistant message that carries calls rendered as written."""
        return [self._as_written(m, owner) for m in messages]

    def _as_written(self, message: ChatMessage, owner: str | None) -> ChatMessage:
        if message.role != "assistant" or not message.tool_calls or not isinstance(message.content, str | None):
            return message
        calls = tuple(_call(c) for c in message.tool_calls)
        written = self._entries.get(calls[0][0])
        if written is None or written.owner != owner or written.calls != calls \
                or written.content != (message.content or None):
            return message
        return ChatMessage(role="assistant", content=written.text)


def _chars(written: _Written) -> int:
    return len(written.text) + len(written.content or "") + sum(len(i) + len(n) + len(a) for i, n, a in written.calls)


def calls_of(tool_calls: Sequence[ToolCallOut]) -> list[Call]:
    return [(c.id, c.function.name, c.function.arguments) for c in tool_calls]


def _call(call: dict[str, object]) -> Call:
    fn = call.get("function")
    if not isinstance(fn, dict):
        return ("", "", "")
    return (str(call.get("id", "")), str(fn.get("name", "")), str(fn.get("arguments", "")))
