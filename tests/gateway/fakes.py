"""Fake replicas for gateway tests: tiny FastAPI apps that speak just enough of the tokenmill server
(/ready, /metrics, /v1/models, completions and chat, streaming with [DONE]) and can be told to
fail: refuse, answer 429/503/500, stall, cut a stream before or after its first token.

They run in-process (uvicorn in a thread, `FakeReplica`); fake_serve.py is the subprocess kind.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Behaviour:
    """What the next requests meet; tests change it while the replica runs."""

    is_ready: bool = True  # False: /ready and completions answer 503, as a loading server does
    fail_status: int | None = None  # answer completions with this status...
    num_failures: int | None = None  # ...this many times (None: until told otherwise)
    stall_s: float = 0.0  # wait before answering
    cut_after_events: int | None = None  # streams: drop the connection after this many events
    num_tokens: int = 4
    token_delay_s: float = 0.0
    num_requests: int = 0  # completions received
    num_requests_unready: int = 0  # of those, received while not ready
    num_probes: int = 0  # /ready requests received
    prompts: list[str] = field(default_factory=list)
    responses: set[str] = field(default_factory=set)  # /v1/responses ids this replica stores

    def take_failure(self) -> int | None:
        if self.fail_status is None or self.num_failures == 0:
            return None
        if self.num_failures is not None:
            self.num_failures -= 1
        return self.fail_status


class _Cut(Exception):
    """Raised inside a stream: uvicorn then drops the connection mid-body, like a dying process."""


def build_fake_app(behaviour: Behaviour, name: str = "fake") -> FastAPI:
    app = FastAPI()

    @app.get("/ready")
    async def ready() -> JSONResponse:
        behaviour.num_probes += 1
        return JSONResponse({"status": "ready" if behaviour.is_ready else "loading"},
                            status_code=200 if behaviour.is_ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response("tokenmill:num_requests_running{model_name=\"m\"} 0.0\n"
                        "tokenmill:num_requests_waiting{model_name=\"m\"} 0.0\n")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": name}]}

    @app.post("/v1/conversations")
    async def new_conversation() -> Response:  # stored with the responses: one id space is enough here
        conversation_id = f"conv_{name}_{len(behaviour.responses)}"
        behaviour.responses.add(conversation_id)
        return JSONResponse({"id": conversation_id, "object": "conversation"},
                            headers={"x-tokenmill-response-id": conversation_id})

    @app.get("/v1/conversations/{conversation_id}/items")
    async def conversation_items(conversation_id: str) -> Response:
        if conversation_id not in behaviour.responses:
            return _not_stored(conversation_id)
        return JSONResponse({"object": "list", "data": [], "has_more": False})

    @app.post("/v1/responses")
    async def respond(request: Request) -> Response:
        body = await request.json()
        previous = body.get("previous_response_id") or body.get("conversation")
        if previous is not None and previous not in behaviour.responses:
            return _not_stored(previous)
        response_id = f"resp_{name}_{len(behaviour.responses)}"
        behaviour.responses.add(response_id)
        return JSONResponse({"id": response_id, "object": "response", "previous_response_id": previous},
                            headers={"x-tokenmill-response-id": response_id})

    @app.get("/v1/responses/{response_id}")
    async def stored(response_id: str) -> Response:
        if response_id not in behaviour.responses:
            return _not_stored(response_id)
        return JSONResponse({"id": response_id, "object": "response"})

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> Response:
        body = await request.json()
        behaviour.num_requests += 1
        behaviour.prompts.append(str(body.get("prompt") or body.get("messages")))
        if not behaviour.is_ready:
            behaviour.num_requests_unready += 1
            return JSONResponse({"error": {"message": "the model is still loading", "type": "x", "code": "loading"}},
                                status_code=503, headers={"Retry-After": "1"})
        await asyncio.sleep(behaviour.stall_s)
        status = behaviour.take_failure()
        if status is not None:
            return JSONResponse({"error": {"message": f"fake {status}", "type": "x", "code": None}},
                                status_code=status, headers={"Retry-After": "1"})
        is_chat = "messages" in body
        if body.get("stream"):
            return StreamingResponse(_events(behaviour, is_chat, name), media_type="text/event-stream")
        text = "".join(f"t{i} " for i in range(behaviour.num_tokens))
        return JSONResponse({"object": "text_completion", "model": name,
                             "choices": [{"index": 0, "text": text, "finish_reason": "length"}]})

    return app


def _not_stored(response_id: str) -> JSONResponse:
    return JSONResponse({"error": {"message": f"response {response_id!r} not found", "type": "not_found_error",
                                   "code": None}}, status_code=404)


async def _events(behaviour: Behaviour, is_chat: bool, name: str) -> AsyncIterator[bytes]:
    chunks: list[dict[str, Any]] = [{"role": "assistant"}] if is_chat else []
    chunks += [{"text": f"t{i} "} for i in range(behaviour.num_tokens)]
    chunks.append({"finish_reason": "length"})
    for number, chunk in enumerate(chunks):
        if behaviour.cut_after_events is not None and number >= behaviour.cut_after_events:
            raise _Cut(f"{name} dies mid-stream")
        await asyncio.sleep(behaviour.token_delay_s)
        yield _chunk(chunk, is_chat)
    yield b"data: [DONE]\n\n"


def _chunk(chunk: dict[str, Any], is_chat: bool) -> bytes:
    finish = chunk.get("finish_reason")
    if is_chat:
        delta = {"role": chunk["role"]} if "role" in chunk else {"content": chunk.get("text", "")}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": chunk.get("text", ""), "finish_reason": finish}
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


class FakeReplica:
    """A fake replica on 127.0.0.1 in a thread; `stop()` takes it down, `start()` brings it back."""

    def __init__(self, port: int | None = None, name: str = "fake") -> None:
        self.port = port or free_port()
        self.name = name
        self.behaviour = Behaviour()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeReplica:
        config = uvicorn.Config(build_fake_app(self.behaviour, self.name), host="127.0.0.1", port=self.port,
                                log_level="critical", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        wait_until(lambda: self._server is not None and self._server.started, what=f"{self.name} to start")
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
        self._server = self._thread = None


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
