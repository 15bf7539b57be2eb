"""OpenAI Batch API lines in, engine prompts and sampling params out; result bodies back.

An input line is `{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
"body": {...}}`. Every way a line can be wrong raises `BatchLineError`, which the job writes as
an error line instead of stopping: a million-line job must not die on line 17.
"""

from __future__ import annotations

import enum
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from tokenmill.engine.outputs import CompletionOutput
from tokenmill.engine.request import SamplingParams
from tokenmill.errors import TokenmillError

_DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy completions default; chat runs to the context
MAX_N = 64  # choices per line; each is an engine request
_INT32_MAX = 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class Endpoint(enum.Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


class PromptTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str: ...


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What a prompt is checked against before it reaches the engine."""

    max_model_len: int
    vocab_size: int


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
    """One valid input line, ready for the engine: prompts × n engine requests."""

    custom_id: str
    endpoint: Endpoint
    prompts: list[list[int]]  # token ids; chat always has one
    prompt_texts: list[str | None]
    params: SamplingParams

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n


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


def build_request(custom_id: str, endpoint: Endpoint, body: dict[str, Any], tokenizer: PromptTokenizer,
                  limits: ModelLimits) -> BatchRequest:
    _refuse_unsupported(body)
    texts: list[str | None]
    if endpoint is Endpoint.CHAT:
        prompts, texts = [_chat_prompt(body, tokenizer)], [None]
    else:
        prompts, texts = _completion_prompts(body, tokenizer)
    params = sampling_params(body, endpoint)
    for ids in prompts:
        _check_prompt(ids, params.max_tokens, limits)
    return BatchRequest(custom_id, endpoint, prompts, texts, params)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    # Silently ignoring these would hand back results that look right and are not what was asked.
    if body.get("logprobs") or body.get("top_logprobs") or body.get("echo"):
        raise BatchLineError("logprobs and echo are not supported by tokenmill batch yet: use tokenmill serve",
                             param="logprobs")
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type", "text") != "text":
        raise BatchLineError("response_format other than text is not supported yet", param="response_format")


def _completion_prompts(body: dict[str, Any], tokenizer: PromptTokenizer) -> tuple[list[list[int]],
                                                                                       list[str | None]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)], [prompt]
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [list(prompt)], [None]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [tokenizer.encode(p) for p in prompt], list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and all(_is_int(t) for t in p)
                                                   for p in prompt):
        return [list(p) for p in prompt], [None] * len(prompt)
    raise BatchLineError("prompt must be a string, a list of strings, a list of token ids or a list of lists "
                         "of token ids", param="prompt")


def _chat_prompt(body: dict[str, Any], tokenizer: PromptTokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BatchLineError("messages must be a non-empty list", param="messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BatchLineError("each message must be an object with a string role", param="messages")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except TokenmillError as exc:
        raise BatchLineError(str(exc), param="messages") from exc
    # The template already places BOS where the model wants it.
    return tokenizer.encode(text, add_special_tokens=False)


def _check_prompt(ids: list[int], max_tokens: int | None, limits: ModelLimits) -> None:
    if not ids:
        raise BatchLineError("the prompt is empty: send at least one token", param="prompt")
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise BatchLineError(f"token id {bad[0]} is outside the vocabulary (0..{limits.vocab_size - 1})",
                             param="prompt")
    wanted = len(ids) + (max_tokens or 1)  # at least one token must fit after the prompt
    if wanted > limits.max_model_len:
        raise BatchLineError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you requested "
            f"{wanted} tokens ({len(ids)} in the prompt, {max_tokens or 1} in the completion): reduce the "
            f"prompt or max_tokens by {wanted - limits.max_model_len}", param="max_tokens")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ------------------------------------------------------------------------------- sampling params


def sampling_params(body: dict[str, Any], endpoint: Endpoint) -> SamplingParams:
    default_max = None if endpoint is Endpoint.CHAT else _DEFAULT_COMPLETION_MAX_TOKENS
    max_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    try:
        params = SamplingParams(
            max_tokens=_field(body, max_key, int, default_max),
            temperature=_field(body, "temperature", float, 1.0),
            top_p=_field(body, "top_p", float, 1.0),
            top_k=_field(body, "top_k", int, 0),
            min_p=_field(body, "min_p", float, 0.0),
            repetition_penalty=_field(body, "repetition_penalty", float, 1.0),
            presence_penalty=_field(body, "presence_penalty", float, 0.0),
            frequency_penalty=_field(body, "frequency_penalty", float, 0.0),
            seed=_field(body, "seed", int, None),
            n=_field(body, "n", int, 1),
            stop=_stop(body.get("stop")),
            ignore_eos=_field(body, "ignore_eos", bool, False),
            min_tokens=_field(body, "min_tokens", int, 0),
        )
    except TokenmillError as exc:
        raise BatchLineError(str(exc)) from exc
    _check_bounds(params)
    return params


def _check_bounds(params: SamplingParams) -> None:
    """Limits SamplingParams leaves open but the engine cannot take (the server's protocol has the same)."""
    checks = [
        (params.n <= MAX_N, f"n must be at most {MAX_N}", "n"),
        (params.temperature <= 2.0, "temperature must be at most 2", "temperature"),
        (params.repetition_penalty <= 100.0, "repetition_penalty must be at most 100", "repetition_penalty"),
        (params.top_k <= _INT32_MAX, f"top_k must be at most {_INT32_MAX}", "top_k"),
        # Sample i of n is seeded with seed + i, which must stay a 64-bit integer.
        (params.seed is None or _INT64_MIN <= params.seed <= _INT64_MAX - params.n,
         "seed must be a 64-bit integer", "seed"),
    ]
    for ok, message, param in checks:
        if not ok:
            raise BatchLineError(message, param=param)


def _field(body: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    """body[key] checked against `kind` (ints pass as floats; bools never pass as numbers)."""
    value = body.get(key)
    if value is None:
        return default
    ok = isinstance(value, bool) if kind is bool else (
        _is_int(value) or (kind is float and isinstance(value, float)))
    if not ok:
        raise BatchLineError(f"{key} must be {'a number' if kind is float else f'an {kind.__name__}'}, "
                             f"not {json.dumps(value)}", param=key)
    return kind(value)


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise BatchLineError("stop must be a string or a list of strings", param="stop")


# ------------------------------------------------------------------------------ result lines


def success_line(request: BatchRequest, choices: list[CompletionOutput], model: str) -> dict[str, Any]:
    """The Batch API output line for a request whose choices are in index order."""
    num_prompt = sum(len(ids) for ids in request.prompts)
    num_completion = sum(len(c.token_ids) for c in choices)
    body = {
        "id": f"{'chatcmpl' if request.endpoint is Endpoint.CHAT else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if request.endpoint is Endpoint.CHAT else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_choice(request.endpoint, i, c) for i, c in enumerate(choices)],
        "usage": {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
                  "total_tokens": num_prompt + num_completion},
    }
    return _line(request.custom_id, {"status_code": 200, "request_id": _request_id(), "body": body}, None)


def _choice(endpoint: Endpoint, index: int, c: CompletionOutput) -> dict[str, Any]:
    reason = c.finish_reason.value if c.finish_reason is not None else None
    if endpoint is Endpoint.CHAT:
        return {"index": index, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
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
