"""POST /v1/responses (OpenAI's Responses API over the chat path: responses_protocol.py maps the request,
responses_output.py builds the answer and a stream's events), GET and DELETE /v1/responses/{id}.

Responses are stored (response_store.py; unless `store: false` or the server keeps none) once answered in
full: `previous_response_id` continues one, GET /v1/responses/{id} reads it, DELETE forgets it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.engine.service_class import ServiceClass
from tokenmill.server.errors import ApiError
from tokenmill.server.openai_inputs import chat_inputs
from tokenmill.server.pipeline import (
    api_key_id,
    collect,
    get_state,
    now_s,
    salted,
    service_class_for,
    serving,
    start_run,
)
from tokenmill.server.response_store import StoredResponse
from tokenmill.server.responses_output import Json, ResponseContext, ResponseEvents, answer_items
from tokenmill.server.responses_protocol import ResponsesRequest, as_chat_request, input_messages
from tokenmill.server.sse import sse_response
from tokenmill.server.state import ServerState
from tokenmill.server.truncation import fit_chat_request

router = APIRouter()
# Names the response on every /v1/responses answer: the gateway learns from it which replica stores it
# (gateway/response_homes.py, which spells the same name: the gateway imports nothing from the server)
RESPONSE_ID_HEADER = "x-tokenmill-response-id"


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state, engine = serving(request, body.model)
    owner = api_key_id(request)
    history: list[Json] = []
    if body.previous_response_id is not None:
        history = _stored(state, body.previous_response_id, owner, "previous_response_id").history
    conversation = history + input_messages(body)
    chat = salted(request, as_chat_request(body, conversation), state.config.cache_isolation)
    if body.truncation == "auto":
        chat = fit_chat_request(chat, engine.tokenizer, engine.limits.max_model_len)
    inputs = chat_inputs(chat, engine.tokenizer, engine.limits, engine.structured)
    (prompt,) = inputs.prompts
    service_class = service_class_for(request, chat, ServiceClass.INTERACTIVE)
    run, response_id = start_run(state, request, inputs.children, "resp", chat.priority, service_class)
    store = state.responses if body.store is not False else None
    ctx = ResponseContext(body, state.require_texts(), response_id, state.config.served_model_name, now_s(),
                          service_class.value, inputs.tools, len(prompt.token_ids), store, owner, conversation)
    headers = {RESPONSE_ID_HEADER: response_id}
    if body.stream:
        return sse_response(run, ResponseEvents(ctx), state, headers)
    (update,) = (await collect(run, request)).values()
    return JSONResponse(ctx.finish(answer_items(ctx, update), update), headers=headers)


@router.get("/v1/responses/{response_id}", response_model=None)
async def get_response(response_id: str, request: Request) -> Response:
    return JSONResponse(_stored(get_state(request), response_id, api_key_id(request), None).response)


@router.delete("/v1/responses/{response_id}", response_model=None)
async def delete_response(response_id: str, request: Request) -> Response:
    state = get_state(request)
    if state.responses is None or not state.responses.delete(response_id, api_key_id(request)):
        raise _not_found(response_id, None)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _stored(state: ServerState, response_id: str, owner: str | None, param: str | None) -> StoredResponse:
    if state.responses is None:
        raise ApiError(400, "this server keeps no responses (--responses-store-size 0): send the whole "
                       "conversation as input", param=param)
    stored = state.responses.get(response_id, owner)
    if stored is None:
        raise _not_found(response_id, param)
    return stored


def _not_found(response_id: str, param: str | None) -> ApiError:
    # Unknown, forgotten (the store is bounded) or another API key's: the same answer, as OpenAI's
    return ApiError(404, f"response {response_id!r} not found", param=param)


