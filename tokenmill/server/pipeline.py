"""Steps both endpoints take before and after the engine: validate, tokenize, admit, collect.

Everything that could make the engine fail is refused here with a 400 (token ids outside the
vocabulary, a prompt that leaves no room to generate, strings the tokenizer cannot take), so
a bad request never reaches the engine loop, where it would fail every in-flight request.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Sequence

from fastapi import Request

from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError
from tokenmill.engine.request import SamplingParams
from tokenmill.errors import TokenmillError
from tokenmill.server.errors import ApiError, bad_request
from tokenmill.server.fanout import Child, ChoiceUpdate, GenerationRun
from tokenmill.server.protocol import GenerationRequest
from tokenmill.server.state import ServerState

_GREEDY_BELOW = 1e-5  # vLLM's threshold: smaller temperatures overflow the logits, so run greedy
_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps to the same value
_DISCONNECT_POLL_S = 0.1


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.tokenmill
    return state


def request_id_of(request: Request) -> str:
    return str(getattr(request.state, "request_id", "")) or uuid.uuid4().hex


def received_s_of(request: Request) -> float | None:
    received = getattr(request.state, "received_s", None)
    return received if isinstance(received, float) else None


def new_response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def finite_logprob(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


# ------------------------------------------------------------------------- validation


def encode_text(engine: AsyncEngine, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # lone surrogates: the tokenizer cannot take them
        raise bad_request(f"{param} is not valid UTF-8 text: {exc.reason} at position {exc.start}", param) from exc
    return engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def check_token_ids(engine: AsyncEngine, token_ids: Sequence[int], param: str) -> None:
    vocab_size = engine.core.arch.vocab_size
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"{param} holds token id {bad}, outside the vocabulary [0, {vocab_size})", param)


def resolve_max_tokens(num_prompt_tokens: int, requested: int | None, max_model_len: int) -> int:
    """The output budget: as asked if prompt + it fits the context, all that is left if not asked."""
    if num_prompt_tokens == 0:
        raise bad_request("the prompt is empty: send at least one token", "prompt")
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise bad_request(f"the prompt has {num_prompt_tokens} tokens but the model's context is {max_model_len} "
                          f"and at least one token must be generated: shorten the prompt by {1 - room} tokens",
                          "prompt")
    if requested is None:
        return room
    if requested > room:
        total = num_prompt_tokens + requested
        raise bad_request(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({requested}) = {total} exceeds the "
                          f"model's context of {max_model_len} tokens by {total - max_model_len}: shorten the "
                          f"prompt or lower max_tokens", "max_tokens")
    return requested


def sampling_params(engine: AsyncEngine, body: GenerationRequest, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None) -> SamplingParams:
    if body.logit_bias:
        raise bad_request("logit_bias is not supported yet: drop it from the request", "logit_bias")
    stop_token_ids = body.stop_token_ids or []
    check_token_ids(engine, stop_token_ids, "stop_token_ids")
    if any(not s for s in body.stop_strings):
        raise bad_request("stop strings must be non-empty", "stop")
    temperature = 0.0 if body.temperature < _GREEDY_BELOW else body.temperature
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, seed=body.seed, n=1, stop=body.stop_strings,
        stop_token_ids=list(stop_token_ids), include_stop_str_in_output=body.include_stop_str_in_output,
        ignore_eos=body.ignore_eos, min_tokens=body.min_tokens, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, skip_special_tokens=body.skip_special_tokens)


# ----------------------------------------------------------------------------- running


def start_run(state: ServerState, request: Request, children: list[Child], prefix: str,
              priority: int) -> tuple[GenerationRun, str]:
    """Admit the request (429/503 when it cannot be) and prepare its run; returns the response id."""
    num_tokens = sum(len(child.prompt.token_ids) for child in children)
    try:
        ticket = state.admission.admit(len(children), num_tokens)
    except ApiError as error:
        if error.status == 429:
            state.on_rejected()
        raise
    response_id = new_response_id(prefix)
    run = GenerationRun(state, children, response_id, request_id_of(request), priority, ticket,
                        received_s_of(request))
    return run, response_id


def api_error_for(exc: BaseException) -> ApiError:
    """The HTTP answer for a failure that happened while the engine ran the request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, TokenmillError):
        return bad_request(str(exc))
    if isinstance(exc, EngineDeadError):
        return ApiError(500, f"{exc}: retry the request", code="engine_failed")
    return ApiError(500, f"internal server error: {type(exc).__name__}: {exc}")


async def collect(run: GenerationRun, request: Request) -> dict[int, ChoiceUpdate]:
    """Run to the end; the last update of each choice. Aborts the run if the client disconnects."""
    # Nobody cancels a plain handler when its client leaves, so poll for the disconnect.
    task = asyncio.create_task(_last_updates(run))
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                raise ApiError(499, "the client closed the connection")
        return task.result()
    except ApiError:
        raise
    except Exception as exc:
        get_state(request).note_restarts()  # an engine failure turns /ready false at once
        raise api_error_for(exc) from exc
    finally:
        task.cancel()
        run.close()


async def _last_updates(run: GenerationRun) -> dict[int, ChoiceUpdate]:
    last: dict[int, ChoiceUpdate] = {}
    async for update in run.updates():
        last[update.child.index] = update
    return last
