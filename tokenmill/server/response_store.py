"""Stored responses of /v1/responses: what `previous_response_id` continues and GET/DELETE
/v1/responses/{id} read, in memory.

A stored response keeps its conversation as chat messages (every input and output through it, without
its `instructions`, which OpenAI does not carry over to the next response) and the response object as
answered. The store is bounded: past `capacity` the least recently used response is forgotten, and a
continuation of a forgotten (or never stored) response is a 404, as OpenAI answers an unknown id. Behind
API keys each response belongs to the key that created it: another key gets the same 404 (ids are
random, but a leaked id must not hand one tenant another's conversation). Nothing survives a restart.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StoredResponse:
    owner: str | None  # the API key id that created it; None on a server without keys
    history: list[dict[str, Any]]  # chat messages of the conversation, through this response's output
    response: dict[str, Any]  # the response object as answered


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a response store needs room for at least one response")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()  # handlers run on the event loop, tests and tools may not

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._entries[response_id] = stored
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        """The response if it is stored and `owner` may read it; a copy, so callers cannot change it."""
        with self._lock:
            stored = self._entries.get(response_id)
            if stored is None or stored.owner != owner:
                return None
            self._entries.move_to_end(response_id)
        return copy.deepcopy(stored)

    def delete(self, response_id: str, owner: str | None) -> bool:
        with self._lock:
            stored = self._entries.get(response_id)
            if stored is None or stored.owner != owner:
                return False
            del self._entries[response_id]
            return True
