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

    @property
    def num_input_tokens(self) -> int:
        return self.system_tokens + sum(turn.input_tokens for turn in self.turns)


@dataclass(slots=True)
class Conversation:
    """A session's messages as they grow during the run."""

    session: Session
    messages: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.session.system is not None:
            self.messages.append({"role": "system", "content": self.session.system})

    def ask(self, turn: Turn) -> None:
        self.messages.append({"role": turn.role, "content": turn.content})

    def answer(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})

    def prompt_tokens_estimate(self, turn_index: int) -> int:
        """The bench's own count of the prompt (no chat template, no earlier replies): a fallback
        for servers that send no usage."""
        return self.session.system_tokens + sum(t.input_tokens for t in self.session.turns[:turn_index + 1])

    def payload(self, api: Api) -> dict[str, Any]:
        if api is Api.CHAT:
            return {"messages": list(self.messages)}
        # A completions server sees the conversation as one text, turns separated by blank lines.
        return {"prompt": "\n\n".join(message["content"] for message in self.messages)}
