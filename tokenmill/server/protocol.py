"""Request bodies of the OpenAI-compatible API, with OpenAI's field names (the responses: response_bodies.py).

Requests validate strictly (a string is not a number, 1 is not `true`, NaN is refused) and
pass unknown fields, so clients written for newer API versions still work; vLLM fields tokenmill does
not honour (best_of, use_beam_search, length_penalty, ...) are refused by name (openai_inputs). Limits that keep
the engine safe live here: ids and seeds in range, `n` bounded, temperature within OpenAI's.
vLLM's extensions (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, priority, ...)
are accepted under vLLM's names.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.engine.request import MAX_LOGPROBS

MAX_N = 64
MAX_STOP_STRINGS = 16
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

TokenIds = list[int]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


# ----------------------------------------------------------------------------- requests


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsSpec(_Body):
    """vLLM's `structured_outputs` object: exactly one of the fields."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class ContentPart(_Body):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    type: str
    text: str | None = None


class Prediction(_Body):
    """OpenAI's Predicted Outputs: text the answer is expected to contain (engine/spec/prediction.py)."""

    type: Literal["content"]
    content: str | list[ContentPart]


class GenerationRequest(_Body):
    """Fields both endpoints share: the model, sampling knobs, streaming and scheduling."""

    # Unknown fields are kept (model_extra), so vLLM fields tokenmill does not honour are refused by name
    # (openai_inputs.refuse_unhonoured) instead of silently ignored; other unknown fields pass.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    model: str | None = None  # None: the served model
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, le=_INT32_MAX)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=_INT64_MIN, le=_INT64_MAX - MAX_N)  # children use seed + i
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = Field(default=0, ge=_INT32_MIN, le=_INT32_MAX)  # lower runs first (within a service class)
    # interactive | standard | batch, or OpenAI's priority | default | auto | flex (engine/service_class.py);
    # None: the header, the API key's class, else the endpoint's default (chat interactive, completions standard)
    service_tier: str | None = Field(default=None, max_length=32)
    # vLLM's prefix-cache salt: requests share cached blocks (and --speculative suffix's outputs) only with
    # requests of the same salt; a per-tenant secret keeps one tenant's timing from revealing another's prompts
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # Predicted outputs: the expected answer, verified as speculative guesses (engine/spec/prediction.py)
    prediction: Prediction | None = None
    # vLLM's: keep only the prompt's last N tokens (-1: as many as leave room for one output token)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1)  # vLLM's: only these may be sampled
    bad_words: list[str] | None = Field(default=None, max_length=64)  # vLLM's: words never generated
    # vLLM's: the top-N logprobs (and the prompt token's own) at each prompt position, not streamed
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    logit_bias: dict[str, float] | None = None
    # vLLM's beam search (server/beam_api.py): the n best beams of width best_of (when larger) or n
    use_beam_search: bool = False
    length_penalty: float = Field(default=1.0, ge=-10.0, le=10.0)  # results scored sum / length ** it
    early_stopping: bool | Literal["never"] = False
    # Structured outputs (engine/structured): OpenAI's response_format, or vLLM's extra fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsSpec | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(GenerationRequest):
    # A string, a batch of strings, one prompt of token ids, or a batch of token-id prompts.
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's extension: logprob tokens as "token_id:N"


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result answers this call

    def as_template_input(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "auto" (default with tools), "none", "required", named
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    # vLLM's: the last (assistant) message is left open for the model to continue (a prefilled answer)
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the chat template

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeTextRequest(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # as ChatRequest's: the prompt a chat request would run
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # as ChatRequest's: the template shows them
    add_special_tokens: bool = False  # the template writes BOS itself where the model wants it
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds
