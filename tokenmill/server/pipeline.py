"""Steps both endpoints take around the engine: admit, run, collect, and map failures to HTTP.

The body → engine request steps (tokenize, check against the model's limits, fan out) live in
`openai_inputs.py`, shared with `tokenmill batch`.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from typing import TypeVar

from fastapi import Request

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.inputs import ChildRequest
from tokenmill.engine.service_class import ServiceClass, parse_service_tier
from tokenmill.errors import RequestValidationError
from tokenmill.server.errors import ApiError, api_error_for, bad_request
from tokenmill.server.fanout import ChoiceUpdate, GenerationRun
from tokenmill.server.middleware import API_KEY_CLASS_STATE, API_KEY_ID_STATE
from tokenmill.server.openai_inputs import requested_service_class
from tokenmill.server.protocol import GenerationRequest
from tokenmill.server.state import ServerState

BodyT = TypeVar("BodyT", bound=GenerationRequest)
T = TypeVar("T")

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps to the same value
_DISCONNECT_POLL_S = 0.1
SERVICE_TIER_HEADER = "x-tokenmill-service-tier"
# Names the stored response (or conversation) on every answer that creates one: the gateway learns from it
# which replica stores it (gateway/response_homes.py, which spells the same name: the gateway imports nothing
# from the server)
RESPONSE_ID_HEADER = "x-tokenmill-response-id"


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.tokenmill
    return state


def serving(request: Request, model: str | None) -> tuple[ServerState, AsyncEngine]:
    """The state and engine a request for `model` runs on: a 404 if it names another model, a 503 while loading."""
    state = get_state(request)
    state.check_model(model)
    return state, state.require_engine()


def request_id_of(request: Request) -> str:
    return str(getattr(request.state, "request_id", "")) or uuid.uuid4().hex


def received_s_of(request: Request) -> float | None:
    received = getattr(request.state, "received_s", None)
    return received if isinstance(received, float) else None


def new_response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def finite_logprob(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


# ----------------------------------------------------------------------------- running


def service_class_for(request: Request, body: GenerationRequest, default: ServiceClass) -> ServiceClass:
    """The request's class: the body's `service_tier`, else the `x-tokenmill-service-tier` header, else
    the API key's class (`--api-key-class`), else the endpoint's default. A bad value is a 400."""
    asked = requested_service_class(body)
    if asked is not None:
        return asked
    header = request.headers.get(SERVICE_TIER_HEADER)
    if header is not None:
        try:
            return parse_service_tier(header)
        except RequestValidationError as exc:
            raise bad_request(f"header {SERVICE_TIER_HEADER}: {exc}") from exc
    key_class = getattr(request.state, API_KEY_CLASS_STATE, None)
    return key_class if isinstance(key_class, ServiceClass) else default


def api_key_id(request: Request) -> str | None:
    """Which accepted API key the request came with ("api-key-<i>", never the key); None without keys."""
    key_id = getattr(request.state, API_KEY_ID_STATE, None)
    return key_id if isinstance(key_id, str) else None


def salted(request: Request, body: BodyT, isolation: str) -> BodyT:
    """The body with the salt its request's cached state is shared under: its own `cache_salt`, led by the
    API key's id when the server isolates caches by key (ServerConfig.cache_isolation)."""
    if isolation != "api-key":
        return body
    key_id = api_key_id(request)
    assert key_id is not None, "cache isolation by API key runs only behind ApiKeyMiddleware"
    salt = key_id if body.cache_salt is None else f"{key_id}/{body.cache_salt}"
    return body.model_copy(update={"cache_salt": salt})


def start_run(state: ServerState, request: Request, children: list[ChildRequest], prefix: str,
              priority: int, service_class: ServiceClass = ServiceClass.STANDARD) -> tuple[GenerationRun, str]:
    """Admit the request (429/503 when it cannot be) and prepare its run; returns the response id."""
    num_tokens = sum(len(child.prompt.token_ids) for child in children)
    try:
        ticket = state.admission.admit(len(children), num_tokens, service_class)
    except ApiError as error:
        if error.status == 429:
            state.on_rejected(service_class)
        raise
    response_id = new_response_id(prefix)
    run = GenerationRun(state, children, response_id, request_id_of(request), priority, ticket,
                        received_s_of(request), service_class)
    return run, response_id


async def collect(run: GenerationRun, request: Request) -> dict[int, ChoiceUpdate]:
    """Run to the end; the last update of each choice. Aborts the run if the client disconnects."""
    run.final_only = True
    try:
        return await until_done(asyncio.create_task(_last_updates(run)), request)
    finally:
        run.close()


async def until_done(task: asyncio.Task[T], request: Request) -> T:
    """The task's result, failures as HTTP errors; the task is cancelled (a 499) if the client disconnects."""
    # Nobody cancels a plain handler when its client leaves, so poll for the disconnect.
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                raise ApiError(499, "the client closed the connection")
        return task.result()
    except ApiError:
        raise
    except Exception as exc:
        get_state(request).note_restarts()  # an engine failure turns /ready false at once
        raise api_error_for(exc) from exc
    finally:
        task.cancel()


async def _last_updates(run: GenerationRun) -> dict[int, ChoiceUpdate]:
    last: dict[int, ChoiceUpdate] = {}
    async for update in run.updates():
        last[update.child.index] = update
    return last
