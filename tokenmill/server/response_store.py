"""Stored responses of /v1/responses: what `previous_response_id` continues and GET/DELETE
/v1/responses/{id} read, in memory.

A stored response keeps its conversation as chat messages (every input and output through it, without
its `instructions`, which OpenAI does not carry over to the next response), the same conversation's items
as the API lists them, and the response object as answered. The store is bounded: past `capacity`
responses or its size budget (the JSON of what it holds, 256 MiB by default) the least recently used
response is forgotten, and a continuation of a forgotten (or never stored) response is a 404, as OpenAI
answers an unknown id. Behind API keys each response belongs to the key that created it: another key gets
the same 404 (ids are random, but a leaked id must not hand one tenant another's conversation). Nothing
survives a restart.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from tokenmill.bounded_lru import BoundedLru


@dataclass(frozen=True, slots=True)
class StoredResponse:
    owner: str | None  # the API key id that created it; None on a server without keys
    history: list[dict[str, Any]]  # chat messages of the conversation, through this response's output
    response: dict[str, Any]  # the response object as answered
    # The items it was answered from, as GET /v1/responses/{id}/input_items lists them: the conversation it
    # continues (each earlier response's inputs and outputs) and its own input
    input_items: list[dict[str, Any]] = field(default_factory=list)


class ResponseStore:
    def __init__(self, capacity: int, max_bytes: int = 256 << 20) -> None:
        """`capacity` responses, holding at most about `max_bytes` of text (their JSON), whichever binds first."""
        self.capacity = capacity
        self._entries: BoundedLru[str, StoredResponse] = BoundedLru(capacity, max_bytes, _json_bytes)

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._entries.put(response_id, stored)

    def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        """The response if it is stored and `owner` may read it; a copy, so callers cannot change it."""
        stored = self._entries.get(response_id)
        if stored is None or stored.owner != owner:
            return None
        return copy.deepcopy(stored)

    def delete(self, response_id: str, owner: str | None) -> bool:
        stored = self._entries.get(response_id)
        if stored is None or stored.owner != owner:
            return False
        self._entries.pop(response_id)
        return True


def _json_bytes(stored: StoredResponse) -> int:
    return sum(len(json.dumps(part, ensure_ascii=False)) for part in (stored.history, stored.response,
                                                                       stored.input_items))
