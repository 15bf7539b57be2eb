"""Where each stored Responses API response lives, so its continuation finds it.

A replica keeps the responses it answered (server/response_store.py) and the conversations it created
(server/conversations.py) in its own memory. A follow-up (`previous_response_id`, `conversation`) or a read
of `/v1/responses/{id}` or `/v1/conversations/{id}` only works on that replica, and its
body (just the new input) shares no prompt prefix with the first request to route by. Replicas name
the response id in a header on every /v1/responses answer; the gateway remembers id → replica (bounded,
least recently used forgotten first) and sends a request that refers to the id there while that replica
is routable. If it is gone, the request goes wherever the policy says and gets the replica's 404: the
conversation died with the replica's memory, and the client must resend it whole.
"""

from __future__ import annotations

from typing import Any

from tokenmill.bounded_lru import BoundedLru

RESPONSE_ID_HEADER = "x-tokenmill-response-id"  # the replica's header (server/openai_responses.py sets it)
_RESPONSES_PATH = "/v1/responses"
_CONVERSATIONS_PATH = "/v1/conversations"  # replicas name a new conversation in the same header


class ResponseHomes:
    def __init__(self, capacity: int = 100_000) -> None:
        self._homes: BoundedLru[str, str] = BoundedLru(capacity)

    def note(self, response_id: str, replica: str) -> None:
        self._homes.put(response_id, replica)

    def home_of(self, response_id: str | None) -> str | None:
        return None if response_id is None else self._homes.get(response_id)


def referenced_response(method: str, path: str, payload: Any) -> str | None:
    """The stored object a request needs: a continuation's previous_response_id or conversation, or the id in
    /v1/responses/{id}... or /v1/conversations/{id}... (reads, cancels, items, deletes)."""
    for prefix in (_RESPONSES_PATH, _CONVERSATIONS_PATH):
        if path.startswith(prefix + "/"):
            return path[len(prefix) + 1:].split("/", 1)[0].split("?", 1)[0] or None
    if method == "POST" and path.split("?", 1)[0] == _RESPONSES_PATH and isinstance(payload, dict):
        previous = payload.get("previous_response_id")
        if isinstance(previous, str) and previous:
            return previous
        conversation = payload.get("conversation")
        if isinstance(conversation, dict):
            conversation = conversation.get("id")
        return conversation if isinstance(conversation, str) and conversation else None
    return None
