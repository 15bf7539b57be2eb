"""OpenAI request bodies (already parsed by `protocol.py`) → engine inputs: encoded prompts, and
one child request per choice with its SamplingParams. FastAPI-free: the server's endpoints and
`tokenmill batch` both build their engine requests here, so a body means the same in both.

Every way a body can still be wrong after pydantic (token ids outside the vocabulary, a prompt
that leaves no room to generate, text the tokenizer cannot take, unsupported options) raises
`RequestValidationError` with the field at fault; the server answers it with a 400, the batch
job with an error line. Nothing that could fail inside the engine loop gets past here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tokenmill.engine.inputs import ChildRequest, EncodedPrompt, RequestLimits, fan_out
from tokenmill.engine.request import SamplingParams
from tokenmill.engine.service_class import ServiceClass, parse_service_tier
from tokenmill.engine.structured import StructuredOutputParams
from tokenmill.engine.structured.manager import StructuredOutputs
from tokenmill.errors import RequestValidationError, TokenmillError
from tokenmill.models.loading.fim import FimTokens, fim_tokens
from tokenmill.models.loading.tokenizer import Tokenizer
from tokenmill.server.openai_tools import ToolPlan, template_messages, tool_plan
from tokenmill.server.protocol import ChatMessage, ChatRequest, CompletionRequest, GenerationRequest

_GREEDY_BELOW = 1e-5  # vLLM's threshold: smaller temperatures overflow the logits, so run greedy
# vLLM request fields tokenmill does not honour, with the value that asks for nothing: any other value is a
# 400 naming the field (a client relying on it must not get an answer that silently ignored it)
_UNHONOURED: dict[str, object] = {"best_of": None, "guided_whitespace_pattern": None}
# What the chat template is rendered with already: chat_template_kwargs may not replace it
_TEMPLATE_RESERVED = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools",
                                "raise_exception", "strftime_now"})


@dataclass(frozen=True, slots=True)
class EngineInputs:
    """One API request as the engine runs it: its prompts, and one child request per choice."""

    prompts: list[EncodedPrompt]  # chat: exactly one
    children: list[ChildRequest]  # prompt-major: choice index = prompt_index × n + sample
    tools: ToolPlan | None = None  # chat: the tools the model may call (the answer is parsed for calls)


def completion_inputs(body: CompletionRequest, tokenizer: Tokenizer, limits: RequestLimits,
                      grammars: StructuredOutputs | None = None) -> EngineInputs:
    """`grammars`: where a requested grammar is compiled now (a 400 before queueing); without it the
    engine compiles it when the request is added."""
    refuse_unhonoured(body)
    structured = _compiled(structured_params(body), grammars)
    fim = _fim_tokens(body, tokenizer)
    prompts = completion_prompts(tokenizer, limits, body.prompt, add_special_tokens=fim is None)
    stops: list[int] = []
    if fim is not None and body.suffix is not None:
        suffix = encode_text(tokenizer, body.suffix, "suffix", add_special_tokens=False)
        bos = [tokenizer.bos_token_id] if tokenizer.add_bos_token and tokenizer.bos_token_id is not None else []
        prompts = [EncodedPrompt(p.text, [*bos, *fim.frame(p.token_ids, suffix)]) for p in prompts]
        stops = list(fim.stops)
    if fim is not None and body.truncate_prompt_tokens is not None:
        raise RequestValidationError("truncate_prompt_tokens cannot be combined with suffix (a fill-in-the-middle "
                                     "prompt would lose its frame)", "truncate_prompt_tokens")
    prompts = [_as_sent(p, body, limits) for p in prompts]
    token_fields = _token_fields(body, tokenizer, limits)
    children: list[ChildRequest] = []
    echo_logprobs = body.logprobs if body.echo else None
    for i, prompt in enumerate(prompts):
        max_tokens = limits.resolve_max_tokens(len(prompt.token_ids), body.max_tokens)
        params = sampling_params(body, limits, max_tokens, body.logprobs, echo_logprobs)
        params = replace(params, structured=structured, stop_token_ids=[*params.stop_token_ids, *stops],
                         **token_fields)
        children.extend(fan_out(i, prompt, params))
    return EngineInputs(prompts, children)


def _fim_tokens(body: CompletionRequest, tokenizer: Tokenizer) -> FimTokens | None:
    """The model's fill-in-the-middle markers where the body has a `suffix` (a 400 where it has none)."""
    if body.suffix is None:
        return None
    if body.echo:
        raise RequestValidationError("echo cannot be combined with suffix (a fill-in-the-middle prompt)", "suffix")
    fim = fim_tokens(tokenizer)
    if fim is None:
        raise RequestValidationError(f"suffix needs a model trained to fill in the middle; {tokenizer.name} has no "
                                     "FIM tokens: put the whole text in the prompt", "suffix")
    return fim


def chat_inputs(body: ChatRequest, tokenizer: Tokenizer, limits: RequestLimits,
                grammars: StructuredOutputs | None = None) -> EngineInputs:
    _refuse_unsupported_chat(body)
    refuse_unhonoured(body)
    plan = tool_plan(body)
    structured = structured_params(body)
    forced = plan.structured() if plan is not None else None
    if forced is not None:
        if structured is not None:
            raise RequestValidationError("tool_choice required or a named function already fixes the output's "
                                         "format: drop response_format (or the guided_* field)", "tool_choice")
        structured = forced
    structured = _compiled(structured, grammars)
    prompt = chat_prompt(tokenizer, body.messages, body.add_generation_prompt, body.tools,
                         continue_final=body.continue_final_message, template_kwargs=body.chat_template_kwargs)
    prompt = _as_sent(prompt, body, limits)
    max_tokens = limits.resolve_max_tokens(len(prompt.token_ids), body.max_output_tokens)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = replace(sampling_params(body, limits, max_tokens, logprobs), structured=structured,
                     **_token_fields(body, tokenizer, limits))
    return EngineInputs([prompt], fan_out(0, prompt, params), plan)


def requested_service_class(body: GenerationRequest) -> ServiceClass | None:
    """The class the body's `service_tier` asks for; None when it names none."""
    if body.service_tier is None:
        return None
    try:
        return parse_service_tier(body.service_tier)
    except RequestValidationError as exc:
        raise RequestValidationError(str(exc), "service_tier") from exc


def structured_params(body: GenerationRequest) -> StructuredOutputParams | None:
    """The one grammar a body asks for: response_format, structured_outputs or a guided_* field."""
    found: list[tuple[str, StructuredOutputParams]] = []
    fmt = body.response_format
    if fmt is not None:
        if fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise RequestValidationError("response_format json_schema needs json_schema.schema", "response_format")
            found.append(("response_format", _guard(StructuredOutputParams.json, fmt.json_schema.schema_,
                                                    "response_format")))
        elif fmt.type == "json_object":
            found.append(("response_format", StructuredOutputParams.json_object()))
        elif fmt.type != "text":
            raise RequestValidationError(
                f"response_format type {fmt.type!r} is not supported: use 'text', 'json_object' or 'json_schema'",
                "response_format")
    so = body.structured_outputs
    guided: list[tuple[str, Any, Any]] = [
        ("guided_json", body.guided_json, StructuredOutputParams.json),
        ("guided_regex", body.guided_regex, StructuredOutputParams.regex),
        ("guided_choice", body.guided_choice, StructuredOutputParams.choice),
        ("guided_grammar", body.guided_grammar, StructuredOutputParams.grammar)]
    if so is not None:
        guided += [("structured_outputs", so.json_, StructuredOutputParams.json),
                   ("structured_outputs", so.regex, StructuredOutputParams.regex),
                   ("structured_outputs", so.choice, StructuredOutputParams.choice),
                   ("structured_outputs", so.grammar, StructuredOutputParams.grammar)]
        if so.json_object:
            found.append(("structured_outputs", StructuredOutputParams.json_object()))
    for param, value, make in guided:
        if value is not None:
            found.append((param, _guard(make, value, param)))
    if len(found) > 1:
        raise RequestValidationError(
            f"ask for one output format, not several ({', '.join(dict.fromkeys(p for p, _ in found))})", found[1][0])
    return found[0][1] if found else None


def _guard(make: Any, value: Any, param: str) -> StructuredOutputParams:
    try:
        result: StructuredOutputParams = make(value)
    except RequestValidationError as exc:
        raise RequestValidationError(str(exc), param) from exc
    return result


def _compiled(structured: StructuredOutputParams | None,
              grammars: StructuredOutputs | None) -> StructuredOutputParams | None:
    if structured is not None and grammars is not None:
        try:
            grammars.compile(structured)
        except RequestValidationError as exc:
            param = {"json": "response_format", "json_object": "response_format", "regex": "guided_regex",
                     "choice": "guided_choice", "grammar": "guided_grammar"}[structured.kind]
            raise RequestValidationError(str(exc), exc.param or param) from exc
    return structured


def encode_text(tokenizer: Tokenizer, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # lone surrogates: the tokenizer cannot take them
        raise RequestValidationError(f"{param} is not valid UTF-8 text: {exc.reason} at position {exc.start}",
                                     param) from exc
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _as_sent(prompt: EncodedPrompt, body: GenerationRequest, limits: RequestLimits) -> EncodedPrompt:
    """The prompt as the engine runs it: cut to `truncate_prompt_tokens`, under the body's cache salt."""
    return replace(prompt, token_ids=truncated(prompt.token_ids, body, limits), cache_salt=body.cache_salt)


def _token_fields(body: GenerationRequest, tokenizer: Tokenizer, limits: RequestLimits) -> dict[str, Any]:
    """The SamplingParams fields both endpoints tokenize from the body, once for all its prompts."""
    return {"prediction": prediction_tokens(body, tokenizer, limits),
            "bad_words_token_ids": bad_words_tokens(body, tokenizer)}


def refuse_unhonoured(body: GenerationRequest) -> None:
    """A 400 naming the first vLLM field the body sets that tokenmill does not honour (best_of equal to n
    asks for nothing more than n; with use_beam_search it is the beam width)."""
    extra = body.model_extra or {}
    for field, neutral in _UNHONOURED.items():
        value = extra.get(field, neutral)
        if value in (neutral, [], {}) or (field == "best_of" and (value == body.n or body.use_beam_search)):
            continue
        raise RequestValidationError(f"{field} is not supported by tokenmill: leave it out", field)
    if not body.use_beam_search:
        for name, neutral in (("length_penalty", 1.0), ("early_stopping", False)):
            if getattr(body, name) != neutral:
                raise RequestValidationError(f"{name} applies to beam search only: set use_beam_search or leave "
                                             "it out", name)


def bad_words_tokens(body: GenerationRequest, tokenizer: Tokenizer) -> list[list[int]] | None:
    """Each bad word as the model would write it, alone and after a space (as vLLM bans it)."""
    if not body.bad_words:
        return None
    out: list[list[int]] = []
    for word in body.bad_words:
        if not word.strip():
            raise RequestValidationError("bad_words must be non-empty words", "bad_words")
        for text in (word, " " + word.lstrip()):
            tokens = encode_text(tokenizer, text, "bad_words", add_special_tokens=False)
            if tokens and tokens not in out:
                out.append(tokens)
    return out


def truncated(token_ids: list[int], body: GenerationRequest, limits: RequestLimits) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` tokens (vLLM's left truncation); as it is without it."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return token_ids
    if keep == 0:
        raise RequestValidationError("truncate_prompt_tokens must be -1 or at least 1", "truncate_prompt_tokens")
    keep = limits.max_model_len - 1 if keep == -1 else keep
    return token_ids[-keep:] if len(token_ids) > keep else token_ids


def prediction_tokens(body: GenerationRequest, tokenizer: Tokenizer, limits: RequestLimits) -> list[int] | None:
    """The body's `prediction` (Predicted Outputs) as the model's tokens, cut to what a context can hold."""
    if body.prediction is None:
        return None
    content = body.prediction.content
    if not isinstance(content, str):
        if any(part.type != "text" or part.text is None for part in content):
            raise RequestValidationError("prediction content parts must be text parts", "prediction")
        content = "".join(part.text or "" for part in content)
    tokens = encode_text(tokenizer, content, "prediction", add_special_tokens=False)[:limits.max_model_len]
    return tokens or None


def completion_prompts(tokenizer: Tokenizer, limits: RequestLimits, prompt: str | list[Any],
                       add_special_tokens: bool = True) -> list[EncodedPrompt]:
    """A string, a batch of strings, one prompt of token ids, or a batch of token-id prompts."""
    if isinstance(prompt, str):
        return [EncodedPrompt(prompt, encode_text(tokenizer, prompt, "prompt", add_special_tokens))]
    if not prompt:
        raise RequestValidationError("prompt must not be an empty list", "prompt")
    # A flat list of ids is one prompt; otherwise every item is a prompt of its own.
    batch: list[Any] = [prompt] if isinstance(prompt[0], int) else prompt
    encoded = []
    for i, item in enumerate(batch):
        if isinstance(item, str):
            encoded.append(EncodedPrompt(item, encode_text(tokenizer, item, f"prompt.{i}", add_special_tokens)))
        else:
            limits.check_token_ids(item, "prompt")
            encoded.append(EncodedPrompt(None, list(item)))
    return encoded


def chat_prompt(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None, *, continue_final: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> EncodedPrompt:
    """The prompt the model's chat template makes of `messages`. `continue_final`: cut right after the last
    (assistant) message's text, so the model continues it (as vLLM's continue_final_message)."""
    plain = template_messages([message.as_template_input() for message in messages])
    extra: dict[str, Any] = {"tools": tools} if tools else {}  # templates test `tools` for being defined
    reserved = sorted(_TEMPLATE_RESERVED.intersection(template_kwargs or {}))
    if reserved:
        raise RequestValidationError(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    extra.update(template_kwargs or {})
    final = _final_text(messages) if continue_final else None
    if final is not None and add_generation_prompt:
        raise RequestValidationError("continue_final_message needs add_generation_prompt: false (the model "
                                     "continues the last message instead of starting a new one)",
                                     "continue_final_message")
    try:
        text = tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt, **extra)
    except TokenmillError:
        raise
    except Exception as exc:  # templates are code from the model: any error there is about these messages
        raise RequestValidationError(f"the chat template failed on these messages: {type(exc).__name__}: {exc}",
                                     "messages") from exc
    if final is not None:
        end = text.rfind(final)
        if end < 0:
            raise RequestValidationError("continue_final_message: the chat template does not write the last "
                                         "message's text as it is", "continue_final_message")
        text = text[:end + len(final)]
    # The template writes BOS itself where the model wants it.
    return EncodedPrompt(text, encode_text(tokenizer, text, "messages", add_special_tokens=False))


def _final_text(messages: list[ChatMessage]) -> str:
    """The text of the last message, which continue_final_message leaves open: an assistant's, non-empty."""
    last = messages[-1]
    content = last.content if isinstance(last.content, str) else "".join(
        part.text or "" for part in last.content or [] if part.type == "text")
    if last.role != "assistant" or not content:
        raise RequestValidationError("continue_final_message needs the last message to be an assistant's, with "
                                     "text", "continue_final_message")
    return content


def _refuse_unsupported_chat(body: ChatRequest) -> None:
    if body.top_logprobs and not body.logprobs:
        raise RequestValidationError("top_logprobs needs logprobs: true", "top_logprobs")


def sampling_params(body: GenerationRequest, limits: RequestLimits, max_tokens: int, logprobs: int | None,
                    echo_logprobs: int | None = None) -> SamplingParams:
    """`echo_logprobs`: the top-n a completion's echoed prompt shows; the engine computes the larger of it
    and the body's `prompt_logprobs` once, and each format keeps its own top-n."""
    if body.prompt_logprobs is not None and body.stream:
        # vLLM's rule too: a prompt's logprobs come whole with the first token, not as stream deltas
        raise RequestValidationError("prompt_logprobs is not available with stream=true", "prompt_logprobs")
    asked = [n for n in (echo_logprobs, body.prompt_logprobs) if n is not None]
    logit_bias = _logit_bias(body.logit_bias)
    limits.check_token_ids(list(logit_bias or ()), "logit_bias")
    limits.check_token_ids(body.allowed_token_ids or [], "allowed_token_ids")
    stop_token_ids = body.stop_token_ids or []
    limits.check_token_ids(stop_token_ids, "stop_token_ids")
    if any(not s for s in body.stop_strings):
        raise RequestValidationError("stop strings must be non-empty", "stop")
    temperature = 0.0 if body.temperature < _GREEDY_BELOW else body.temperature
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, seed=body.seed, n=body.n, stop=body.stop_strings,
        stop_token_ids=list(stop_token_ids), include_stop_str_in_output=body.include_stop_str_in_output,
        ignore_eos=body.ignore_eos, min_tokens=body.min_tokens, logprobs=logprobs,
        prompt_logprobs=max(asked) if asked else None, skip_special_tokens=body.skip_special_tokens,
        logit_bias=logit_bias, allowed_token_ids=body.allowed_token_ids)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's map of token id (a JSON key, so a string) to a bias in [-100, 100]."""
    if not bias:
        return None
    result: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise RequestValidationError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not -100.0 <= value <= 100.0:
            raise RequestValidationError(f"logit_bias of token {token} is {value}: values must be in [-100, 100]",
                                         "logit_bias")
        result[token] = float(value)
    return result
