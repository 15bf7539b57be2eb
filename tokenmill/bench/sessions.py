"""What a workload sends: sessions of turns. A single request is a session of one turn; in a
multi-turn session each turn appends a message to the conversation so far (the model's own
replies included), so the context grows turn by turn."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Api(StrEnum):
    CHAT = "chat"  # /v1/chat/completions with messages
    COMPLETIONS = "completions"  # /v1/completions with one prompt string

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self is Api.CHAT else "/v1/completions"


@dataclass(slots=True, frozen=True)
class Turn:
    content: str  # the message this turn appends (a user question, a tool's output)
    input_tokens: int  # tokens of `content` by the bench's tokenizer
    max_tokens: int
    role: str = "user"


@dataclass(slots=True, frozen=True)
class Session:
    turns: tuple[Turn, ...]
    system: str | None = None
    system_tokens: int = 0
    # Chat with tools (bench/tool_agent.py): sent with every request; the server's chat template
    # puts them in the system prompt, so they are part of the shared prefix.
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str | None = None
    parallel_tool_calls: bool = True

    @property
    def num_input_tokens(self) -> int:
        return self.system_tokens + sum(turn.input_tokens for turn in self.turns)


@dataclass(slots=True)
class Conversation:
    """A session's messages as they grow during the run."""

    session: Session
    messages: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.session.system is not None:
            self.messages.append({"role": "system", "content": self.session.system})

    def ask(self, turn: Turn) -> None:
        if turn.role == "tool":
            call_id = self._pending_call_id()
            if call_id is not None:  # a tool result answers the call the model just made
                self.messages.append({"role": "tool", "tool_call_id": call_id, "content": turn.content})
                return
            self.messages.append({"role": "user", "content": turn.content})  # it answered in text instead
            return
        self.messages.append({"role": turn.role, "content": turn.content})

    def answer(self, text: str, tool_calls: list[dict[str, Any]] | None = None) -> None:
        if tool_calls:
            self.messages.append({"role": "assistant", "content": text or None, "tool_calls": list(tool_calls)})
            return
        self.messages.append({"role": "assistant", "content": text})

    def _pending_call_id(self) -> str | None:
        last = self.messages[-1] if self.messages else {}
        calls = last.get("tool_calls") if last.get("role") == "assistant" else None
        return str(calls[0].get("id") or "call_0") if calls else None

    def prompt_tokens_estimate(self, turn_index: int) -> int:
        """The bench's own count of the prompt (no chat template, no earlier replies): a fallback
        for servers that send no usage."""
        return self.session.system_tokens + sum(t.input_tokens for t in self.session.turns[:turn_index + 1])

    def payload(self, api: Api) -> dict[str, Any]:
        if api is Api.CHAT:
            tools: dict[str, Any] = {"tools": list(self.session.tools)} if self.session.tools else {}
            if self.session.tools and self.session.tool_choice is not None:
                tools["tool_choice"] = self.session.tool_choice
            if self.session.tools and not self.session.parallel_tool_calls:
                tools["parallel_tool_calls"] = False
            return {"messages": list(self.messages), **tools}
        # A completions server sees the conversation as one text, turns separated by blank lines.
        return {"prompt": "\n\n".join(message["content"] or "" for message in self.messages)}
