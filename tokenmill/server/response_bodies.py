"""Response bodies of the OpenAI-compatible API, with OpenAI's field names (vLLM's where OpenAI has none).

Fields that are not in OpenAI's schema are left out of the JSON when empty (`exclude_if`), so strict
clients see the bodies they know; the official SDKs keep unknown fields (`model_extra`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from tokenmill.server.protocol import TokenIds


def _omit_none(value: Any) -> bool:
    return value is None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class CompletionTokensDetails(BaseModel):
    """Predicted outputs' counts: prediction tokens the answer took, and those verification refused."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    # only for requests with a prediction (left out of the JSON otherwise)
    completion_tokens_details: CompletionTokensDetails | None = Field(default=None, exclude_if=_omit_none)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
           prediction: tuple[int, int] | None = None) -> Usage:
        details = None if prediction is None else CompletionTokensDetails(
            accepted_prediction_tokens=prediction[0], rejected_prediction_tokens=prediction[1])
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
                   completion_tokens_details=details)


class PhaseTimes(BaseModel):
    """One choice's engine request, in seconds, measured as the server's histograms measure it:
    queue (arrival → first scheduled), prefill (→ first token), decode (→ finish), ttft, e2e."""

    index: int
    queue_s: float | None
    prefill_s: float | None
    decode_s: float | None
    ttft_s: float | None
    e2e_s: float | None


class TokenmillExtension(BaseModel):
    """`"tokenmill": {"timings": [...]}`: on non-streamed bodies and on a stream's final usage chunk.
    Not in the OpenAI API; its clients keep unknown fields (`response.model_extra["tokenmill"]`)."""

    timings: list[PhaseTimes]


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob: a token's logprob at one prompt position, its rank in the vocabulary (1: the most
    likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, null for the first (nothing precedes it), else the prompt
# token's own entry followed by the top-N, keyed by token id (a JSON key, so a string)
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=_omit_none)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    service_tier: str | None = Field(default=None, exclude_if=_omit_none)  # the class the request ran in
    tokenmill: TokenmillExtension | None = Field(default=None, exclude_if=_omit_none)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = Field(default=None, exclude_if=_omit_none)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=_omit_none)  # vLLM's, at this level
    service_tier: str | None = Field(default=None, exclude_if=_omit_none)  # the class the request ran in
    tokenmill: TokenmillExtension | None = Field(default=None, exclude_if=_omit_none)


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # OpenAI sends {"content": "x"}, not {"role": null, "content": "x"}; strict clients notice.
        data: dict[str, Any] = handler(self)
        return {key: value for key, value in data.items() if value is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    service_tier: str | None = Field(default=None, exclude_if=_omit_none)  # the class the request runs in
    tokenmill: TokenmillExtension | None = Field(default=None, exclude_if=_omit_none)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenmill"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: TokenIds
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
