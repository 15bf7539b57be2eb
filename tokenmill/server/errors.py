"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}` for every failure.

FastAPI's own 422 (a body that fails validation) becomes a 400, as the OpenAI API answers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError as BodyValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tokenmill.engine.async_engine import EngineDeadError
from tokenmill.errors import RequestValidationError, TokenmillError
from tokenmill.server.validation_errors import describe_validation_errors

log = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """A failure with its HTTP status; the message is shown to the client as-is."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    error_type = _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def _on_body_invalid(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, BodyValidationError)
    message, param = describe_validation_errors(exc.errors())
    return error_response(bad_request(message, param))


async def _on_tokenmill_error(request: Request, exc: Exception) -> JSONResponse:
    # Engine and tokenizer validation raise TokenmillError: the request is at fault.
    return error_response(bad_request(str(exc), exc.param if isinstance(exc, RequestValidationError) else None))


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return error_response(ApiError(exc.status_code, str(exc.detail), headers=exc.headers))


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(ApiError(500, f"internal server error: {type(exc).__name__}: {exc}"))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(BodyValidationError, _on_body_invalid)
    app.add_exception_handler(TokenmillError, _on_tokenmill_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)


def api_error_for(exc: BaseException) -> ApiError:
    """The HTTP answer for a failure that happened while the engine ran the request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestValidationError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, TokenmillError):
        return bad_request(str(exc))
    if isinstance(exc, EngineDeadError):
        return ApiError(500, f"{exc}: retry the request", code="engine_failed")
    return ApiError(500, f"internal server error: {type(exc).__name__}: {exc}")
