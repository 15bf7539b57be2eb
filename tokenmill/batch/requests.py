"""OpenAI Batch API lines in, engine requests out; result bodies back.

An input line is `{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions" | "/v1/responses",
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
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.service_class import ServiceClass
from tokenmill.engine.structured.manager import StructuredOutputs
from tokenmill.errors import RequestValidationError, TokenmillError
from tokenmill.models.loading.tokenizer import Tokenizer
from tokenmill.server.beam_api import check_beam_children, check_beam_request
from tokenmill.server.choices import chat_choice, chat_prompt_logprobs, completion_choice
from tokenmill.server.fanout import ChoiceUpdate, cached_prompt_tokens, prediction_counts
from tokenmill.server.openai_inputs import chat_inputs, completion_inputs, requested_service_class
from tokenmill.server.openai_tools import ToolPlan
from tokenmill.server.protocol import ChatRequest, CompletionRequest
from tokenmill.server.response_bodies import ChatResponse, CompletionResponse, Usage
from tokenmill.server.responses_output import ResponseContext, answer_items
from tokenmill.server.responses_protocol import ResponsesRequest, as_chat_request, input_messages, new_id
from tokenmill.server.state import TokenTexts
from tokenmill.server.validation_errors import describe_validation_errors

_BodyT = TypeVar("_BodyT", CompletionRequest, ChatRequest, ResponsesRequest)


class Endpoint(enum.Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    RESPONSES = "/v1/responses"


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
    body: CompletionRequest | ChatRequest | ResponsesRequest | None = None  # what the answer's format asks

    @property
    def num_choices(self) -> int:
        return len(self.children)

    @property
    def use_beam_search(self) -> bool:
        return isinstance(self.body, CompletionRequest | ChatRequest) and self.body.use_beam_search


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
    parsed: ChatRequest | CompletionRequest  # what the engine runs
    answered: ChatRequest | CompletionRequest | ResponsesRequest  # what the answer's format follows
    try:
        if endpoint is Endpoint.CHAT:
            answered = parsed = _parse(ChatRequest, body)
            _check_beams(parsed)
            inputs = chat_inputs(parsed, tokenizer, limits, grammars)
        elif endpoint is Endpoint.RESPONSES:
            answered = _parse(ResponsesRequest, body)
            if answered.previous_response_id is not None:
                raise BatchLineError("previous_response_id is not supported in a batch file (nothing is stored): "
                                     "send the whole conversation as input", param="previous_response_id")
            if answered.conversation is not None:
                raise BatchLineError("conversation is not supported in a batch file (nothing is stored): send the "
                                     "whole conversation as input", param="conversation")
            if answered.background:  # a batch line already runs offline; a batch file keeps no responses
                raise BatchLineError("background is not supported in a batch file: leave it out", param="background")
            parsed = as_chat_request(answered, input_messages(answered))
            inputs = chat_inputs(parsed, tokenizer, limits, grammars)
        else:
            answered = parsed = _parse(CompletionRequest, body)
            _check_beams(parsed)
            inputs = completion_inputs(parsed, tokenizer, limits, grammars)
        if parsed.use_beam_search:
            check_beam_children(inputs.children)
        service_class = requested_service_class(parsed) or ServiceClass.BATCH
        return BatchRequest(custom_id, endpoint, inputs.prompts, inputs.children, service_class, parsed.priority,
                            tools=inputs.tools, body=answered)
    except RequestValidationError as exc:
        raise BatchLineError(str(exc), param=exc.param) from exc
    except TokenmillError as exc:
        raise BatchLineError(str(exc)) from exc


def _check_beams(body: ChatRequest | CompletionRequest) -> None:
    if body.use_beam_search:
        check_beam_request(body)  # the server's 400s, before the prompt is even encoded


def _parse(model: type[_BodyT], body: dict[str, Any]) -> _BodyT:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = describe_validation_errors(exc.errors())
        raise BatchLineError(message, param=param) from exc


# ------------------------------------------------------------------------------ result lines


def success_line(request: BatchRequest, outputs: list[RequestOutput], model: str, texts: TokenTexts) -> dict[str, Any]:
    """The Batch API output line for a request whose finished engine requests (one per choice) are in
    index order: the body the server would answer with, choices built by the same code."""
    updates = [ChoiceUpdate(child, output.outputs[0], True, output.prompt_logprobs, output.metrics)
               for child, output in zip(request.children, outputs, strict=True)]
    if isinstance(request.body, ResponsesRequest):
        body = _response_body(request, request.body, updates[0], model, texts)
    else:
        body = _choices_body(request, updates, model, texts)
    return _line(request.custom_id, {"status_code": 200, "request_id": _request_id(), "body": body}, None)


def _choices_body(request: BatchRequest, updates: list[ChoiceUpdate], model: str, texts: TokenTexts) -> dict[str, Any]:
    """A chat or completions answer, built as the server builds it."""
    usage = Usage.of(sum(len(p.token_ids) for p in request.prompts), sum(len(u.output.token_ids) for u in updates),
                     cached_prompt_tokens(updates), prediction_counts(updates))
    response_id = f"{'chatcmpl' if request.endpoint is Endpoint.CHAT else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    answer: ChatResponse | CompletionResponse
    if isinstance(request.body, ChatRequest):
        answer = ChatResponse(id=response_id, created=created, model=model, usage=usage,
                              choices=[chat_choice(request.body, texts, request.tools, u) for u in updates],
                              prompt_logprobs=chat_prompt_logprobs(request.body, texts, updates[0]))
    else:
        assert isinstance(request.body, CompletionRequest)
        answer = CompletionResponse(id=response_id, created=created, model=model, usage=usage, choices=[
            completion_choice(request.body, texts, u, u.output.text, u.output.token_ids, u.output.logprobs)
            for u in updates])
    return answer.model_dump(mode="json")


def _response_body(request: BatchRequest, body: ResponsesRequest, update: ChoiceUpdate, model: str,
                   texts: TokenTexts) -> dict[str, Any]:
    """The Responses API's answer, as the server builds it (nothing stored: a batch file has no follow-ups)."""
    ctx = ResponseContext(body, texts, new_id("resp"), model, int(time.time()), request.service_class.value,
                          request.tools, len(request.prompts[0].token_ids), None, None, [], [])
    return ctx.finish(answer_items(ctx, update), update)


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
