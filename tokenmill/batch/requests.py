"""OpenAI Batch API lines in, engine requests out; result bodies back.

An input line is `{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
"body": {...}}`. The body is what the server takes over HTTP: parsed by the server's protocol
models and turned into engine requests by `server/openai_inputs.py`, so a body means the same
in both. Every way a line can be wrong raises `BatchLineError`, which the job writes as an
error line instead of stopping: a million-line job must not die on line 17.
"""

from __future__ import annotations

import enum
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import ValidationError

from tokenmill.engine.inputs import ChildRequest, EncodedPrompt, RequestLimits
from tokenmill.engine.outputs import CompletionOutput
from tokenmill.engine.service_class import ServiceClass
from tokenmill.engine.structured.manager import StructuredOutputs
from tokenmill.errors import RequestValidationError, TokenmillError
from tokenmill.models.loading.tokenizer import Tokenizer
from tokenmill.server.openai_inputs import chat_inputs, completion_inputs, requested_service_class
from tokenmill.server.openai_tools import ToolPlan, parse_tool_calls, tool_calls_out
from tokenmill.server.protocol import ChatRequest, CompletionRequest
from tokenmill.server.responses import ChatMessageOut
from tokenmill.server.validation_errors import describe_validation_errors

_BodyT = TypeVar("_BodyT", CompletionRequest, ChatRequest)


class Endpoint(enum.Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


class BatchLineError(Exception):
    """A line that cannot run; becomes an error line with an OpenAI-style error body."""

    def __init__(self, message: str, *, status_code: int = 400, code: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.code = code
        self.param = param


@dataclass(slots=True)
class BatchRequest:
    """One valid input line, ready for the engine: one child request per choice (prompts × n)."""

    custom_id: str
    endpoint: Endpoint
    prompts: list[EncodedPrompt]  # chat always has one
    children: list[ChildRequest]
    # A batch line runs in the batch class unless its body's `service_tier` says otherwise.
    service_class: ServiceClass = ServiceClass.BATCH
    priority: int = 0  # orders lines within the class
    tools: ToolPlan | None = None  # chat with tools: answers are parsed for tool calls, as the server does

    @property
    def num_choices(self) -> int:
        return len(self.children)


# ------------------------------------------------------------------------------------ parsing


def read_envelope(line: str) -> tuple[str, Endpoint, dict[str, Any]]:
    """custom_id, endpoint and body of a line; errors carry no custom_id if it is unreadable."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BatchLineError(f"the line is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(record, dict):
        raise BatchLineError("the line must be a JSON object", code="invalid_json")
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchLineError("custom_id is missing or not a non-empty string", param="custom_id")
    return custom_id, *_endpoint_and_body(record)


def custom_id_of(line: str) -> str | None:
    """The line's custom_id if it has a readable one (for resume bookkeeping)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    custom_id = record.get("custom_id") if isinstance(record, dict) else None
    return custom_id if isinstance(custom_id, str) and custom_id else None


def _endpoint_and_body(record: dict[str, Any]) -> tuple[Endpoint, dict[str, Any]]:
    method = record.get("method", "POST")
    if method != "POST":
        raise BatchLineError(f"method {method!r} is not supported: use POST", status_code=405, param="method")
    url = record.get("url")
    endpoints = {e.value: e for e in Endpoint}
    if url not in endpoints:
        raise BatchLineError(f"url {url!r} is not supported: use {' or '.join(endpoints)}", status_code=404,
                             code="not_found", param="url")
    body = record.get("body")
    if not isinstance(body, dict):
        raise BatchLineError("body is missing or not a JSON object", param="body")
    return endpoints[url], body


def build_request(custom_id: str, endpoint: Endpoint, body: dict[str, Any], tokenizer: Tokenizer,
                  limits: RequestLimits, grammars: StructuredOutputs | None = None) -> BatchRequest:
    parsed: ChatRequest | CompletionRequest
    try:
        if endpoint is Endpoint.CHAT:
            chat = _parse(ChatRequest, body)
            _refuse_logprobs({"logprobs": chat.logprobs, "top_logprobs": chat.top_logprobs or None,
                              "prompt_logprobs": chat.prompt_logprobs})
            inputs, parsed = chat_inputs(chat, tokenizer, limits, grammars), chat
        else:
            completion = _parse(CompletionRequest, body)
            _refuse_logprobs({"logprobs": completion.logprobs, "echo": completion.echo,
                              "prompt_logprobs": completion.prompt_logprobs})
            inputs, parsed = completion_inputs(completion, tokenizer, limits, grammars), completion
        service_class = requested_service_class(parsed) or ServiceClass.BATCH
        return BatchRequest(custom_id, endpoint, inputs.prompts, inputs.children, service_class, parsed.priority,
                            tools=inputs.tools)
    except RequestValidationError as exc:
        raise BatchLineError(str(exc), param=exc.param) from exc
    except TokenmillError as exc:
        raise BatchLineError(str(exc)) from exc


def _parse(model: type[_BodyT], body: dict[str, Any]) -> _BodyT:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = describe_validation_errors(exc.errors())
        raise BatchLineError(message, param=param) from exc


def _refuse_logprobs(fields: dict[str, object]) -> None:
    # Silently ignoring these would hand back results that look right and are not what was asked.
    # 0 asks for something (the chosen token's logprob), so only None and False ask for nothing
    asked = next((name for name, value in fields.items() if value is not None and value is not False), None)
    if asked is not None:
        raise BatchLineError("logprobs and echo are not supported by tokenmill batch yet: use tokenmill serve",
                             param=asked)


# ------------------------------------------------------------------------------ result lines


def success_line(request: BatchRequest, choices: list[CompletionOutput], model: str,
                 cached_tokens: list[int] | None = None,
                 predicted: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    """The Batch API output line for a request whose choices are in index order; `cached_tokens[i]`:
    choice i's prompt tokens served from the prefix cache; `predicted[i]`: its prediction tokens accepted
    and rejected (usage.completion_tokens_details where the request sent a prediction)."""
    num_prompt = sum(len(p.token_ids) for p in request.prompts)
    num_completion = sum(len(c.token_ids) for c in choices)
    # As the server counts it (fanout.cached_prompt_tokens): once per prompt, the most of its children.
    best: dict[int, int] = {}
    for child, cached in zip(request.children, cached_tokens or [0] * len(choices), strict=True):
        best[child.prompt_index] = max(best.get(child.prompt_index, 0), cached)
    usage: dict[str, Any] = {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
                             "total_tokens": num_prompt + num_completion,
                             "prompt_tokens_details": {"cached_tokens": sum(best.values())}}
    if any(child.params.prediction for child in request.children):
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": sum(a for a, _ in predicted or []),
                                              "rejected_prediction_tokens": sum(r for _, r in predicted or [])}
    body = {
        "id": f"{'chatcmpl' if request.endpoint is Endpoint.CHAT else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if request.endpoint is Endpoint.CHAT else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_choice(request, i, c) for i, c in enumerate(choices)],
        "usage": usage,
    }
    return _line(request.custom_id, {"status_code": 200, "request_id": _request_id(), "body": body}, None)


def _choice(request: BatchRequest, index: int, c: CompletionOutput) -> dict[str, Any]:
    reason = c.finish_reason.value if c.finish_reason is not None else None
    if request.endpoint is Endpoint.CHAT:
        message = ChatMessageOut(content=c.text)
        if request.tools is not None:  # the server's parsing (openai_chat._choice): same calls, same content
            content, calls = parse_tool_calls(request.tools, c.text)
            if calls:
                message = ChatMessageOut(content=content, tool_calls=tool_calls_out(calls))
                reason = "tool_calls" if reason == "stop" else reason
        return {"index": index, "message": message.model_dump(mode="json"), "logprobs": None,
                "finish_reason": reason}
    return {"index": index, "text": c.text, "logprobs": None, "finish_reason": reason,
            "stop_reason": c.stop_reason}


def error_line(custom_id: str | None, error: BatchLineError, line_no: int) -> dict[str, Any]:
    """An HTTP-style failure (response with the error body) plus the top-level `error` field, so
    readers that check either one see it. Lines without a custom_id get an id from their line number."""
    detail = {"message": error.message, "type": error.code, "param": error.param, "code": error.status_code}
    response = {"status_code": error.status_code, "request_id": _request_id(), "body": {"error": detail}}
    line = _line(custom_id, response, {"code": error.code, "message": error.message})
    if custom_id is None:
        line["id"] = line_id(line_no)
    return line


def line_id(line_no: int) -> str:
    return f"batch_req_line_{line_no}"


def _line(custom_id: str | None, response: dict[str, Any], error: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}


def _request_id() -> str:
    return f"batch-{uuid.uuid4().hex}"
