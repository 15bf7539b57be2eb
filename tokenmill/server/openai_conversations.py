"""/v1/conversations (OpenAI's Conversations API over server/conversations.py): create, read, update
metadata and delete a conversation; list, add, read and delete its items. A response given `conversation`
answers from it and appends to it (openai_responses.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenmill.errors import RequestValidationError
from tokenmill.server.conversations import Conversation, ConversationStore
from tokenmill.server.errors import ApiError
from tokenmill.server.item_pages import Order, item_page
from tokenmill.server.pipeline import RESPONSE_ID_HEADER, api_key_id, get_state
from tokenmill.server.responses_protocol import item_messages, stored_items
from tokenmill.server.state import ServerState

router = APIRouter()
MAX_ITEMS_PER_REQUEST = 20  # OpenAI's limit on items given at once (create, add)


class _Metadata(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    metadata: dict[str, str] | None = None

    @field_validator("metadata")
    @classmethod
    def _bounded(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        # OpenAI's bounds: 16 pairs, keys up to 64 characters, values up to 512
        if value is not None and (len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())):
            raise ValueError("at most 16 pairs, keys up to 64 characters and values up to 512")
        return value


class CreateConversation(_Metadata):
    items: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_ITEMS_PER_REQUEST)


class UpdateConversation(_Metadata):
    metadata: dict[str, str]  # required here


class AddItems(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    items: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_ITEMS_PER_REQUEST)


@router.post("/v1/conversations", response_model=None)
async def create_conversation(body: CreateConversation, request: Request) -> Response:
    store = _store(request)
    conversation = store.create(api_key_id(request), _validated(body.items or []), body.metadata or {})
    # named like a response: the gateway learns the conversation's replica from it (gateway/response_homes.py)
    return JSONResponse(conversation.as_object(), headers={RESPONSE_ID_HEADER: conversation.conversation_id})


@router.get("/v1/conversations/{conversation_id}", response_model=None)
async def get_conversation(conversation_id: str, request: Request) -> Response:
    return JSONResponse(_conversation(request, conversation_id).as_object())


@router.post("/v1/conversations/{conversation_id}", response_model=None)
async def update_conversation(conversation_id: str, body: UpdateConversation, request: Request) -> Response:
    changed = _store(request).update(_conversation(request, conversation_id), metadata=dict(body.metadata))
    return JSONResponse(changed.as_object())


@router.delete("/v1/conversations/{conversation_id}", response_model=None)
async def delete_conversation(conversation_id: str, request: Request) -> Response:
    if not _store(request).delete(conversation_id, api_key_id(request)):
        raise _not_found(conversation_id, None)
    return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


@router.get("/v1/conversations/{conversation_id}/items", response_model=None)
async def list_items(conversation_id: str, request: Request, limit: int = Query(default=20, ge=1, le=100),
                     order: Order = "desc", after: str | None = None, before: str | None = None) -> Response:
    conversation = _conversation(request, conversation_id)
    return JSONResponse(item_page(conversation.items, limit, order, after, before,
                                  f"conversation {conversation_id!r}"))


@router.post("/v1/conversations/{conversation_id}/items", response_model=None)
async def add_items(conversation_id: str, body: AddItems, request: Request) -> Response:
    conversation = _conversation(request, conversation_id)
    added = _validated(body.items)
    _store(request).update(conversation, items=conversation.items + tuple(added))
    return JSONResponse({"object": "list", "data": added, "first_id": added[0]["id"], "last_id": added[-1]["id"],
                         "has_more": False})


@router.get("/v1/conversations/{conversation_id}/items/{item_id}", response_model=None)
async def get_item(conversation_id: str, item_id: str, request: Request) -> Response:
    conversation = _conversation(request, conversation_id)
    item = next((item for item in conversation.items if item["id"] == item_id), None)
    if item is None:
        raise ApiError(404, f"item {item_id!r} not found in conversation {conversation_id!r}")
    return JSONResponse(item)


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}", response_model=None)
async def delete_item(conversation_id: str, item_id: str, request: Request) -> Response:
    conversation = _conversation(request, conversation_id)
    kept = tuple(item for item in conversation.items if item["id"] != item_id)
    if len(kept) == len(conversation.items):
        raise ApiError(404, f"item {item_id!r} not found in conversation {conversation_id!r}")
    return JSONResponse(_store(request).update(conversation, items=kept).as_object())


def _validated(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items this server can answer from (a 400 naming `items` for others), with ids."""
    try:
        item_messages(items, "items")
    except RequestValidationError as exc:
        raise ApiError(400, str(exc), param="items") from exc
    return stored_items(items)


def _store(request: Request) -> ConversationStore:
    return _store_of(get_state(request), None)


def _store_of(state: ServerState, param: str | None) -> ConversationStore:
    if state.conversations is None:
        raise ApiError(400, "this server keeps no conversations (--responses-store-size 0): send the whole "
                       "conversation as input", param=param)
    return state.conversations


def _conversation(request: Request, conversation_id: str) -> Conversation:
    return stored_conversation(get_state(request), conversation_id, api_key_id(request), None)


def stored_conversation(state: ServerState, conversation_id: str, owner: str | None,
                        param: str | None) -> Conversation:
    """The conversation `owner` may read (these routes, and a response naming it: `param` "conversation"); a
    400 on a server that keeps none, a 404 for an unknown, forgotten or another API key's one."""
    conversation = _store_of(state, param).get(conversation_id, owner)
    if conversation is None:
        raise _not_found(conversation_id, param)
    return conversation


def _not_found(conversation_id: str, param: str | None) -> ApiError:
    # Unknown, forgotten (the store is bounded) or another API key's: the same answer
    return ApiError(404, f"conversation {conversation_id!r} not found", param=param)
