"""Plain ASGI middleware (not BaseHTTPMiddleware, which breaks streaming cancellation).

- RequestIdMiddleware: honours `X-Request-Id` (or makes one), stores it and the arrival time
  in the request state for logs, and echoes it on every response, errors included.
- ApiKeyMiddleware: bearer-token auth on /v1/*; health, readiness and metrics stay open for
  load balancers and Prometheus. A key may carry a default service class (`--api-key-class`),
  stored in the request state for the endpoints.
"""

from __future__ import annotations

import hmac
import re
import time
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.engine.service_class import ServiceClass
from tokenmill.server.errors import error_body

_REQUEST_ID_HEADER = "x-request-id"
API_KEY_CLASS_STATE = "api_key_service_class"  # request.state attribute: the matched key's default class
API_KEY_ID_STATE = "api_key_id"  # request.state attribute: which accepted key matched ("api-key-<i>"), never the key
# Ids go into logs and response headers: printable ASCII only, bounded, so nothing can be injected.
_SAFE_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")


def _request_id(scope: Scope) -> str:
    given = Headers(scope=scope).get(_REQUEST_ID_HEADER, "")
    return given if _SAFE_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(scope)
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["received_s"] = time.monotonic()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


class ApiKeyMiddleware:
    """`api_keys`: every accepted key → the service class its requests default to (None: no default)."""

    def __init__(self, app: ASGIApp, api_keys: dict[str, ServiceClass | None]) -> None:
        self.app = app
        self._expected = [(f"Bearer {key}".encode(), service_class, f"api-key-{i}")
                          for i, (key, service_class) in enumerate(api_keys.items())]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        key_id, service_class = self._match(scope)
        if key_id is not None:
            state = scope.setdefault("state", {})
            state[API_KEY_ID_STATE] = key_id
            if service_class is not None:
                state[API_KEY_CLASS_STATE] = service_class
            await self.app(scope, receive, send)
            return
        body = error_body(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                          code="invalid_api_key")
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _match(self, scope: Scope) -> tuple[str | None, ServiceClass | None]:
        """(the matched key's id, its class); (None, None) when no key matched."""
        given = Headers(scope=scope).get("authorization", "").encode()
        found: tuple[str | None, ServiceClass | None] = (None, None)
        for expected, service_class, key_id in self._expected:
            # Constant time per key, and every key compared: no timing oracle on which key matched.
            if hmac.compare_digest(given, expected) and found[0] is None:
                found = (key_id, service_class)
        return found
