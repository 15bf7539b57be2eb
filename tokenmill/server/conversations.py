"""Conversations (OpenAI's Conversations API): a list of items kept on the server, which a response given
`conversation` answers from (its items before the new input) and appends to (the input, then the output),
so a client sends only each turn's new items. The Agents SDK's `OpenAIConversationsSession` keeps its
history here too (it lists and adds items itself).

A conversation holds the items as the API lists them (message, function_call and function_call_output,
each with an id; responses_protocol.stored_items), belongs to the API key that created it (another key gets
the 404 an unknown id gets), and is bounded like the response store: past its count or byte budget the
least recently used conversation is forgotten. Nothing survives a restart.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import Any

from tokenmill.bounded_lru import BoundedLru
from tokenmill.server.responses_protocol import new_id

Json = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Conversation:
    conversation_id: str
    owner: str | None
    created_at: int
    metadata: dict[str, str] = field(default_factory=dict)
    items: tuple[Json, ...] = ()

    def as_object(self) -> Json:
        return {"id": self.conversation_id, "object": "conversation", "created_at": self.created_at,
                "metadata": dict(self.metadata)}


class ConversationStore:
    """Conversations are immutable values: every change stores a new one, so the size budget stays exact."""

    def __init__(self, capacity: int, max_bytes: int) -> None:
        self._entries: BoundedLru[str, Conversation] = BoundedLru(capacity, max_bytes, _json_bytes)

    def __len__(self) -> int:
        return len(self._entries)

    def create(self, owner: str | None, items: list[Json], metadata: dict[str, str]) -> Conversation:
        conversation = Conversation(new_id("conv"), owner, int(time.time()), dict(metadata), tuple(items))
        self._entries.put(conversation.conversation_id, conversation)
        return conversation

    def get(self, conversation_id: str, owner: str | None) -> Conversation | None:
        conversation = self._entries.get(conversation_id)
        return conversation if conversation is not None and conversation.owner == owner else None

    def update(self, conversation: Conversation, **changes: Any) -> Conversation:
        """Store a changed copy (items, metadata) of a conversation `get` returned."""
        changed = replace(conversation, **changes)
        self._entries.put(changed.conversation_id, changed)
        return changed

    def append(self, conversation_id: str, owner: str | None, items: list[Json]) -> bool:
        """Add items at the end; False when the conversation is gone (deleted or forgotten meanwhile)."""
        conversation = self.get(conversation_id, owner)
        if conversation is None:
            return False
        self.update(conversation, items=conversation.items + tuple(items))
        return True

    def delete(self, conversation_id: str, owner: str | None) -> bool:
        if self.get(conversation_id, owner) is None:
            return False
        self._entries.pop(conversation_id)
        return True


def _json_bytes(conversation: Conversation) -> int:
    return len(json.dumps(conversation.items, ensure_ascii=False)) + len(json.dumps(conversation.metadata))
