"""The FastAPI app: routes, middleware, error bodies, and the lifespan that loads and watches the engine.

`build_app` takes a running engine (tests; the caller owns and shuts it down) or a loader
(`tokenmill serve`: the model loads in the background while /health answers and /ready says
"loading"; the app shuts the engine down on exit).

    /health  liveness: the process answers           /ready  200 only when requests can be served
    /metrics Prometheus                              /v1/models, /tokenize, /detokenize, /tokenizer_info
    /v1/completions, /v1/chat/completions, /v1/responses    (bearer auth on /v1/* when an API key is set)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.service_class import ServiceClass, parse_service_tier
from tokenmill.server import openai_chat, openai_completions, openai_conversations, openai_responses, tokenize_api
from tokenmill.server.errors import install_error_handlers
from tokenmill.server.middleware import ApiKeyMiddleware, RequestIdMiddleware
from tokenmill.server.pipeline import get_state
from tokenmill.server.response_bodies import ModelCard, ModelList
from tokenmill.server.state import ServerState, monitor_engine

log = logging.getLogger(__name__)

EngineLoader = Callable[[], AsyncEngine]

_ops = APIRouter()


@_ops.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@_ops.get("/ready")
async def ready(request: Request) -> JSONResponse:
    reason = get_state(request).not_ready_reason()
    if reason is None:
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": "not ready", "reason": reason}, status_code=503)


@_ops.get("/metrics")
async def metrics(request: Request) -> Response:
    state = get_state(request)
    if state.metrics is None:  # still loading: nothing measured yet
        return Response(b"", media_type="text/plain; version=0.0.4; charset=utf-8")
    state.note_restarts()
    if state.class_metrics is not None:
        state.class_metrics.set_waiting(state.admission.num_waiting_by_class)
    body, content_type = state.metrics.render()
    return Response(body, media_type=content_type)


@_ops.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    state = get_state(request)
    engine = state.engine
    card = ModelCard(id=state.config.served_model_name, created=int(request.app.state.started_at),
                     root=str(engine.loaded.source.path) if engine is not None else None,
                     max_model_len=engine.max_model_len if engine is not None else None)
    return ModelList(data=[card])


def build_app(engine: AsyncEngine | EngineLoader, config: ServerConfig) -> FastAPI:
    loader = None if isinstance(engine, AsyncEngine) else engine
    state = ServerState(config, engine if isinstance(engine, AsyncEngine) else None)
    app = FastAPI(title="tokenmill", summary="OpenAI-compatible LLM server", lifespan=_lifespan(state, loader))
    app.state.tokenmill = state
    app.state.started_at = time.time()
    install_error_handlers(app)
    for router in (_ops, tokenize_api.router, openai_completions.router, openai_chat.router,
                   openai_responses.router, openai_conversations.router):
        app.include_router(router)
    api_keys = accepted_api_keys(config)
    if api_keys:
        app.add_middleware(ApiKeyMiddleware, api_keys=api_keys)
    app.add_middleware(RequestIdMiddleware)  # added last = outermost: even a 401 carries the id
    return app


def accepted_api_keys(config: ServerConfig) -> dict[str, ServiceClass | None]:
    """`--api-key` (no class of its own) plus every `--api-key-class` key with its class."""
    keys: dict[str, ServiceClass | None] = {} if config.api_key is None else {config.api_key: None}
    for key, name in config.api_key_classes:
        keys[key] = parse_service_tier(name)
    return keys


Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def _lifespan(state: ServerState, loader: EngineLoader | None) -> Lifespan:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(monitor_engine(state))]
        if loader is not None:
            tasks.append(asyncio.create_task(_load(state, loader)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            if state.background is not None:  # after the drain: what still runs in the background is cancelled
                state.background.shutdown()
            if loader is not None and state.engine is not None:  # the app loaded it, so the app stops it
                await asyncio.to_thread(state.engine.shutdown)

    return lifespan


async def _load(state: ServerState, loader: EngineLoader) -> None:
    started = time.monotonic()
    try:
        engine = await asyncio.to_thread(loader)
    except Exception as exc:
        state.load_error = f"the model failed to load: {exc}"
        log.error("%s", state.load_error)
        return
    state.attach_engine(engine)
    log.info("model %s ready in %.1f s", state.config.served_model_name, time.monotonic() - started)
