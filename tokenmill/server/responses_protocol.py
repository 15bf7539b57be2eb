"""OpenAI's Responses API (POST /v1/responses) as a chat request: its input items become chat messages,
its function tools and `text.format` the chat's tools and `response_format`, so both endpoints share one
path to the engine (chat template, tool parsing, grammars).

Mapping: `instructions` → a leading system message; an input string → one user message; message
items (roles user, assistant, system, developer → system; content a string or `input_text` /
`output_text` parts) → messages; `function_call` items → the assistant's `tool_calls` (consecutive
calls join one message); `function_call_output` items → `tool` messages. Tools are
`{"type": "function", "name", "description", "parameters"}` (the Responses API's flat form). The
conversation a request continues (`previous_response_id`) comes from the server's response store
(response_store.py) as chat messages that go before the new input. Item and tool types the engine
cannot run (images, files, built-in tools) are 400s naming the field.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenmill.engine.request import MAX_LOGPROBS
from tokenmill.errors import RequestValidationError
from tokenmill.server.openai_inputs import refuse_unhonoured
from tokenmill.server.protocol import ChatRequest, GenerationRequest
from tokenmill.server.validation_errors import describe_validation_errors

# Responses fields that need state or features this server does not have: a 400 naming them when set
_STATEFUL = ("prompt",)
_LOGPROBS_INCLUDE = "message.output_text.logprobs"
# GenerationRequest fields the Responses API has no use for (it has no n, and streams have no options)
_NOT_COPIED = frozenset({"n", "stream_options"})


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(GenerationRequest):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool = False
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=256)
    # A stored conversation (/v1/conversations) to answer from and append to: its id, or {"id": ...}
    conversation: str | dict[str, Any] | None = None
    # "auto": where the conversation does not fit the context, its oldest turns are left out (truncation.py)
    truncation: Literal["auto", "disabled"] = "disabled"

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or _LOGPROBS_INCLUDE in (self.include or [])


def conversation_id(body: ResponsesRequest) -> str | None:
    """The id `conversation` names (a 400 when it names none, or comes with previous_response_id)."""
    given = body.conversation
    if given is None:
        return None
    found = given.get("id") if isinstance(given, dict) else given
    if not isinstance(found, str) or not found:
        raise RequestValidationError('conversation must be a conversation id or {"id": ...}', "conversation")
    if body.previous_response_id is not None:
        raise RequestValidationError("conversation and previous_response_id cannot both be set: a response "
                                     "continues one or the other", "conversation")
    return found


def as_chat_request(body: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatRequest:
    """The chat request that asks the engine what `body` asks, over `conversation` (the stored history it
    continues, then `input_messages(body)`); 400s name the Responses field at fault."""
    extra = body.model_extra or {}
    for name in _STATEFUL:
        if extra.get(name) is not None:
            raise RequestValidationError(f"{name} is not supported: send the conversation as input, continue "
                                         "a stored response with previous_response_id, or name a conversation",
                                         name)
    refuse_unhonoured(body)  # vLLM's fields tokenmill does not honour (best_of, ...), as on chat
    if body.use_beam_search:
        raise RequestValidationError("use_beam_search is not supported on /v1/responses: use /v1/completions or "
                                     "/v1/chat/completions", "use_beam_search")
    if body.n != 1:
        raise RequestValidationError("n is not part of the Responses API: use /v1/chat/completions for n > 1", "n")
    shared = {name: getattr(body, name) for name in GenerationRequest.model_fields
              if name not in _NOT_COPIED and name in body.model_fields_set}
    chat: dict[str, Any] = {
        **shared, "messages": _instructions(body) + conversation,
        "max_completion_tokens": body.max_output_tokens,
        "logprobs": body.wants_logprobs, "top_logprobs": body.top_logprobs if body.wants_logprobs else None,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.tools:
        chat["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(body.tool_choice)
    if body.text is not None and body.text.format.type != "text":
        chat["response_format"] = _response_format(body.text.format)
    try:
        return ChatRequest.model_validate(chat)
    except ValidationError as exc:
        message, param = describe_validation_errors(exc.errors())
        raise RequestValidationError(message, "input" if param == "messages" else param) from exc


def _instructions(body: ResponsesRequest) -> list[dict[str, Any]]:
    return [{"role": "system", "content": body.instructions}] if body.instructions else []


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as chat messages (without its instructions: a continuation does not keep them)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    if not body.input:
        raise RequestValidationError("input must hold at least one item", "input")
    return item_messages(body.input)


def item_messages(items: list[dict[str, Any]], param: str = "input") -> list[dict[str, Any]]:
    """Items (message, function_call, function_call_output) as chat messages; a 400 naming `param` for the
    others (the same rules for a request's input and a stored conversation's items)."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise RequestValidationError(f"{param}.{i} must be an object", param)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(f"{param}.{i}", param, item))
        elif kind == "function_call":
            at = f"{param}.{i}"
            call = {"id": _text(item, "call_id", at, param), "type": "function",
                    "function": {"name": _text(item, "name", at, param),
                                 "arguments": _text(item, "arguments", at, param)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _parts_text(f"{param}.{i}", param, output)
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", f"{param}.{i}", param),
                             "content": output})
        else:
            raise RequestValidationError(f"{param}.{i}: items of type {kind!r} are not supported (message, "
                                         "function_call and function_call_output are)", param)
    return messages


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as the API lists it (GET /v1/responses/{id}/input_items): items with an `id` (the
    client's, else a new one) and a status, a string input one user message. Call after input_messages,
    which validates the items."""
    if isinstance(body.input, str):
        return [_input_message(new_id("msg"), "user", [{"type": "input_text", "text": body.input}])]
    return stored_items(body.input)


def stored_items(given: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validated items (item_messages) as they are kept and listed: each with an id and a status."""
    items = []
    for item in given:
        kind = item.get("type", "message")
        item_id = item["id"] if isinstance(item.get("id"), str) and item["id"] else None
        if kind == "message":
            content = item["content"]
            part = "output_text" if item["role"] == "assistant" else "input_text"
            parts = [{"type": part, "text": content}] if isinstance(content, str) else content
            items.append(_input_message(item_id or new_id("msg"), item["role"], parts))
        else:
            prefix = "fc" if kind == "function_call" else "fco"
            items.append({**item, "type": kind, "id": item_id or new_id(prefix), "status": "completed"})
    return items


def _input_message(item_id: str, role: str, parts: list[Any]) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": role, "status": "completed", "content": parts}


def _message(at: str, param: str, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise RequestValidationError(f"{at}.role must be user, assistant, system or developer", param)
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(at, param, content)
    return {"role": "system" if role == "developer" else role, "content": text}


def _parts_text(at: str, param: str, parts: Any) -> str:
    if not isinstance(parts, list):
        raise RequestValidationError(f"{at}.content must be a string or a list of text parts", param)
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise RequestValidationError(f"{at}.content: parts of type {kind!r} are not supported (this "
                                         "model reads text: input_text and output_text parts)", param)
        texts.append(part["text"])
    return "".join(texts)


def _text(item: dict[str, Any], key: str, at: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestValidationError(f"{at}.{key} must be a string", param)
    return value


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise RequestValidationError(f"tools.{i} must be {{\"type\": \"function\", \"name\": ..., \"parameters\": "
                                     f"...}} (built-in tools are not supported)", "tools")
    fn = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, str):
        return choice
    raise RequestValidationError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                 '"name": ...}', "tool_choice")


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise RequestValidationError("text.format of type json_schema needs a schema", "text")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_,
                                                   "strict": fmt.strict}}


def output_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the assistant's chat message: its text and its calls."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message
