"""POST /v1/responses (OpenAI's Responses API over the chat path: responses_protocol.py maps the request,
responses_output.py builds the answer and a stream's events), GET and DELETE /v1/responses/{id}, POST
/v1/responses/{id}/cancel and GET /v1/responses/{id}/input_items.

Responses are stored (response_store.py; unless `store: false` or the server keeps none) once answered in
full: `previous_response_id` continues one, GET /v1/responses/{id} reads it, DELETE forgets it.
`background: true` answers at once and runs on (background.py): GET polls it or, with `stream=true`,
streams its events from `starting_after`; cancel stops it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.engine.service_class import ServiceClass
from tokenmill.server.background import BackgroundJob
from tokenmill.server.errors import ApiError
from tokenmill.server.item_pages import Order, item_page
from tokenmill.server.openai_conversations import stored_conversation
from tokenmill.server.openai_inputs import chat_inputs
from tokenmill.server.pipeline import (
    RESPONSE_ID_HEADER,
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
from tokenmill.server.responses_protocol import (
    ResponsesRequest,
    as_chat_request,
    conversation_id,
    input_items,
    input_messages,
    item_messages,
)
from tokenmill.server.sse import DONE, EventStreamResponse, event, sse_response
from tokenmill.server.state import ServerState
from tokenmill.server.truncation import fit_chat_request

router = APIRouter()


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state, engine = serving(request, body.model)
    owner = api_key_id(request)
    if body.background and (body.store is False or state.background is None):
        raise ApiError(400, "a background response must be stored: leave store out (or true) on a server that "
                       "keeps responses (--responses-store-size above 0)", param="background")
    conv_id = conversation_id(body)  # before previous_response_id is looked up: both set is a 400
    history: list[Json] = []
    items: list[Json] = []
    on_answered = None
    if body.previous_response_id is not None:
        previous = _continued(state, body.previous_response_id, owner)
        history, items = previous.history, previous.input_items + previous.response["output"]
    conversation = history + input_messages(body)
    new_items = input_items(body)
    if conv_id is not None:
        stored = stored_conversation(state, conv_id, owner, "conversation")
        items = list(stored.items)
        conversation = item_messages(items, "conversation") + conversation
        on_answered = _appender(state, conv_id, owner, new_items)
    items += new_items
    chat = salted(request, as_chat_request(body, conversation), state.config.cache_isolation)
    if body.truncation == "auto":
        chat = fit_chat_request(chat, engine.tokenizer, engine.limits.max_model_len)
    inputs = chat_inputs(chat, engine.tokenizer, engine.limits, engine.structured)
    (prompt,) = inputs.prompts
    # Nobody waits on a background response's tokens: it leaves the interactive class its latency targets
    default_class = ServiceClass.STANDARD if body.background else ServiceClass.INTERACTIVE
    service_class = service_class_for(request, chat, default_class)
    run, response_id = start_run(state, request, inputs.children, "resp", chat.priority, service_class)
    store = state.responses if body.store is not False else None
    ctx = ResponseContext(body, state.require_texts(), response_id, state.config.served_model_name, now_s(),
                          service_class.value, inputs.tools, len(prompt.token_ids), store, owner, conversation,
                          items, on_answered)
    headers = {RESPONSE_ID_HEADER: response_id}
    if body.background:
        assert state.background is not None
        job = BackgroundJob(ResponseEvents(ctx), run)
        state.background.start(job)
        return _follow(job, -1, headers) if body.stream else JSONResponse(job.snapshot(), headers=headers)
    if body.stream:
        return sse_response(run, ResponseEvents(ctx), state, headers)
    (update,) = (await collect(run, request)).values()
    return JSONResponse(ctx.finish(answer_items(ctx, update), update), headers=headers)


@router.get("/v1/responses/{response_id}", response_model=None)
async def get_response(response_id: str, request: Request, stream: bool = False,
                       starting_after: int = Query(default=-1, ge=-1)) -> Response:
    """The response; a background one as it stands, or with `stream=true` its events after `starting_after`."""
    state, owner = get_state(request), api_key_id(request)
    job = _job(state, response_id, owner)
    if stream:
        if job is None:
            _stored(state, response_id, owner, None)  # unknown: 404
            raise ApiError(400, f"response {response_id!r} has no events to stream: only background responses "
                           "stream from GET, while the server keeps their events", param="stream")
        return _follow(job, starting_after, {})
    if job is not None:  # running, or ended: its final response is the one the store got
        return JSONResponse(job.snapshot())
    return JSONResponse(_stored(state, response_id, owner, None).response)


@router.post("/v1/responses/{response_id}/cancel", response_model=None)
async def cancel_response(response_id: str, request: Request) -> Response:
    """Cancels a background response that is queued or running; an ended one is answered unchanged."""
    state, owner = get_state(request), api_key_id(request)
    job = _job(state, response_id, owner)
    if job is not None:
        return JSONResponse(job.cancel())
    stored = _stored(state, response_id, owner, None)
    if not stored.response.get("background"):
        raise ApiError(400, "only responses created with background: true can be cancelled")
    return JSONResponse(stored.response)


@router.delete("/v1/responses/{response_id}", response_model=None)
async def delete_response(response_id: str, request: Request) -> Response:
    state, owner = get_state(request), api_key_id(request)
    job = _job(state, response_id, owner)
    if job is not None:  # a running one stops first: nothing may store it again after the delete
        job.cancel()
        assert state.background is not None
        state.background.forget(response_id)
    deleted = state.responses is not None and state.responses.delete(response_id, owner)
    if not deleted and job is None:
        raise _not_found(response_id, None)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items", response_model=None)
async def list_input_items(response_id: str, request: Request, limit: int = Query(default=20, ge=1, le=100),
                           order: Order = "desc", after: str | None = None,
                           before: str | None = None) -> Response:
    """The items the response was answered from (the conversation it continues, then its own input)."""
    state, owner = get_state(request), api_key_id(request)
    job = _job(state, response_id, owner)
    if job is not None and not job.is_done:
        items = job.input_items
    else:  # an ended job's items are in the store, with its response
        items = _stored(state, response_id, owner, None).input_items
    return JSONResponse(item_page(items, limit, order, after, before, f"response {response_id!r}"))


def _appender(state: ServerState, conv_id: str, owner: str | None,
              new_items: list[Json]) -> Callable[[list[Json]], None]:
    """What a finished answer does to its conversation: appends this turn's input and output items."""
    def append(output: list[Json]) -> None:
        assert state.conversations is not None
        state.conversations.append(conv_id, owner, [*new_items, *output])  # gone meanwhile: nothing to add to

    return append


def _job(state: ServerState, response_id: str, owner: str | None) -> BackgroundJob | None:
    return state.background.get(response_id, owner) if state.background is not None else None


def _follow(job: BackgroundJob, after: int, headers: dict[str, str]) -> EventStreamResponse:
    """A stream of the job's events: the client's leaving ends the stream, not the job."""
    async def events() -> AsyncIterator[bytes]:
        async for item in job.follow(after):
            yield event(item)
        yield DONE

    return EventStreamResponse(events(), on_close=lambda: None, headers=headers)


def _continued(state: ServerState, response_id: str, owner: str | None) -> StoredResponse:
    job = _job(state, response_id, owner)
    if job is not None and not job.is_done:
        raise ApiError(400, f"response {response_id!r} is still {job.status}: continue it once it has ended",
                       param="previous_response_id")
    return _stored(state, response_id, owner, "previous_response_id")


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


