"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: the `n` best beams of a search of
width `best_of` (when larger) or `n` (engine/beam_search.py: transformers' algorithm), with vLLM's
`length_penalty` and `early_stopping`.

Each step scores every live beam of every prompt as its own engine request (one token, top-K logprobs), all
at once, so they batch; the API request holds one admission ticket throughout (a drain waits for it, the
queue counts it) and a client that leaves aborts the search within a step. Beam search ranks by the model's
own log-probabilities, so fields that would reshape them (temperature other than 0 or 1, top-p/k, min-p,
penalties, logit bias, allowed tokens, bad words, min_tokens), stop strings, grammars and tools, predictions,
prompt logprobs and streaming are 400s naming the field rather than silently ignored.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.beam_search import BeamSearch, BeamSearchParams, beam_output
from tokenmill.engine.inputs import ChildRequest, EncodedPrompt
from tokenmill.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.engine.request import SamplingParams, TokenLogprob
from tokenmill.engine.service_class import ServiceClass
from tokenmill.errors import RequestValidationError
from tokenmill.models.loading.tokenizer import Tokenizer
from tokenmill.server.errors import ApiError
from tokenmill.server.fanout import ChoiceUpdate, GenerationRun
from tokenmill.server.openai_inputs import EngineInputs
from tokenmill.server.pipeline import new_response_id, received_s_of, request_id_of, start_run, until_done
from tokenmill.server.protocol import ChatRequest, CompletionRequest, GenerationRequest
from tokenmill.server.state import ServerState

# Body fields beam search cannot honour, with the values that ask for nothing
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_p": (1.0,), "top_k": (-1, 0), "min_p": (0.0,), "repetition_penalty": (1.0,), "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,), "logit_bias": (None, {}), "allowed_token_ids": (None,), "bad_words": (None, []),
    "min_tokens": (0,), "prediction": (None,), "prompt_logprobs": (None,), "stream": (False,), "stop": (None, [], ""),
}

_GRAMMARS = ("tools", "tool_choice", "response_format", "structured_outputs", "guided_json", "guided_regex",
             "guided_choice", "guided_grammar")


def beam_width(body: GenerationRequest) -> int:
    best_of = (body.model_extra or {}).get("best_of")
    return max(body.n, best_of) if isinstance(best_of, int) and not isinstance(best_of, bool) else body.n


def check_beam_request(body: GenerationRequest) -> None:
    """A 400 naming the first field set that beam search cannot honour (before anything is admitted)."""
    best_of = (body.model_extra or {}).get("best_of")
    if best_of is not None and (not isinstance(best_of, int) or isinstance(best_of, bool) or best_of < 1):
        raise RequestValidationError("best_of must be a positive integer (the beam width)", "best_of")
    if best_of is not None and best_of < body.n:
        raise RequestValidationError(f"best_of ({best_of}) must be at least n ({body.n}): the n best of best_of "
                                     "beams are returned", "best_of")
    for name, neutral in _NEUTRAL.items():
        if getattr(body, name) not in neutral:
            raise RequestValidationError(f"{name} does not combine with use_beam_search: leave it out", name)
    for name in _GRAMMARS:
        if getattr(body, name, None) is not None:
            raise RequestValidationError(f"{name} does not combine with use_beam_search: leave it out", name)
    if body.temperature not in (0.0, 1.0):
        raise RequestValidationError("use_beam_search ranks beams by the model's own log-probabilities: "
                                     "leave temperature out (or 0 or 1)", "temperature")


async def search_or_start(state: ServerState, request: Request, engine: AsyncEngine, body: GenerationRequest,
                          inputs: EngineInputs, service_class: ServiceClass,
                          prefix: str) -> tuple[GenerationRun | None, str, dict[int, ChoiceUpdate]]:
    """A completions or chat request's start: a beam search runs to its end here (its own admission, no
    stream): (None, response id, each choice's final update); else its run is admitted and prepared:
    (run, response id, {})."""
    if body.use_beam_search:
        response_id, last = await beam_updates(state, request, engine, body, inputs, service_class, prefix,
                                               beam_logprobs(body))
        return None, response_id, last
    # Nothing may fail after admission: start_run takes a ticket that only the run gives back.
    run, response_id = start_run(state, request, inputs.children, prefix, body.priority, service_class)
    return run, response_id, {}


def check_beam_children(children: list[ChildRequest]) -> None:
    """A 400 when a grammar (response_format, guided decoding, tools) reached the engine requests."""
    if any(child.params.structured is not None for child in children):
        raise RequestValidationError("use_beam_search does not combine with response_format, guided decoding "
                                     "or tools", "use_beam_search")


async def beam_updates(state: ServerState, request: Request, engine: AsyncEngine, body: GenerationRequest,
                       inputs: EngineInputs, service_class: ServiceClass, prefix: str,
                       num_logprobs: int | None) -> tuple[str, dict[int, ChoiceUpdate]]:
    """Run one search per prompt; the response id and each choice's final update (choice i of prompt p is
    that prompt's i-th best beam)."""
    check_beam_children(inputs.children)
    searches = prompt_searches(body, inputs.children, engine.limits.max_model_len, engine.engine.eos_token_ids,
                               num_logprobs)
    num_tokens = sum(len(p.token_ids) for p in inputs.prompts)
    try:  # every beam is an engine request a step: the queue counts the width, not n
        ticket = state.admission.admit(len(searches) * searches[0].search.params.beam_width, num_tokens,
                                       service_class)
    except ApiError as error:
        if error.status == 429:
            state.on_rejected(service_class)
        raise
    response_id = new_response_id(prefix)
    try:
        steps = asyncio.create_task(_run(engine, searches, response_id, body.priority, service_class,
                                         lambda: state.admission.mark_started(ticket)))
        await until_done(steps, request)
    finally:
        state.admission.release(ticket)
    updates: dict[int, ChoiceUpdate] = {}
    for child in inputs.children:
        run = searches[child.prompt_index]
        output = beam_choice(child, run.search, body.n, engine.tokenizer, num_logprobs)
        if output is not None:
            updates[child.index] = ChoiceUpdate(child, output, True, run.prompt_logprobs)
    for run in searches:  # one finished request each in the metrics and the request log
        outputs = [u.output for u in updates.values() if u.child.prompt_index == run.child.prompt_index]
        prompt = run.child.prompt
        state.on_finished(RequestOutput(f"{response_id}-{run.child.prompt_index}", prompt.text, prompt.token_ids,
                                        outputs, True, run.metrics()), request_id_of(request),
                          received_s_of(request), service_class)
    return response_id, updates


@dataclass(slots=True)
class PromptSearch:
    """One prompt's search (shared with `tokenmill batch`)."""

    child: ChildRequest  # the prompt's first choice: its prompt and parameters
    search: BeamSearch
    prompt_logprobs: list[TokenLogprob | None] | None = None  # echo with logprobs: from the first step
    first: RequestMetrics | None = None  # the first step's timeline

    def step_params(self, step: int) -> SamplingParams:
        """What each beam's scoring request of step `step` asks; the first also asks for the prompt's logprobs
        when the choice echoes them."""
        params = self.search.step_params()
        if step == 0 and self.child.params.prompt_logprobs is not None:
            params = replace(params, prompt_logprobs=self.child.params.prompt_logprobs)
        return params

    def note_first(self, output: RequestOutput) -> None:
        """The first step's first scoring request: its timeline and the prompt's logprobs."""
        self.first, self.prompt_logprobs = output.metrics, output.prompt_logprobs

    def metrics(self) -> RequestMetrics | None:
        if self.first is None:
            return None
        return RequestMetrics(self.first.arrival, self.first.first_scheduled, self.first.first_token,
                              time.monotonic(), self.first.num_cached_tokens)


def beam_logprobs(body: GenerationRequest) -> int | None:
    """The top logprobs each returned token carries: completions' `logprobs`, chat's `top_logprobs` when
    `logprobs` is on; None: no logprobs."""
    if isinstance(body, ChatRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    assert isinstance(body, CompletionRequest)
    return body.logprobs


def prompt_searches(body: GenerationRequest, children: list[ChildRequest], max_model_len: int,
                    eos_token_ids: Iterable[int], num_logprobs: int | None) -> list[PromptSearch]:
    """One search per prompt, in prompt order, from each prompt's first choice."""
    first: dict[int, ChildRequest] = {}
    for child in children:
        first.setdefault(child.prompt_index, child)
    return [PromptSearch(child, new_search(body, child, max_model_len, eos_token_ids, num_logprobs))
            for child in first.values()]


def new_search(body: GenerationRequest, child: ChildRequest, max_model_len: int, eos_token_ids: Iterable[int],
               num_logprobs: int | None) -> BeamSearch:
    """The search a prompt's first choice asks for."""
    max_tokens = child.params.max_tokens
    if max_tokens is None:  # up to the context limit
        max_tokens = max_model_len - len(child.prompt.token_ids)
    stop_ids = tuple(body.stop_token_ids or ())
    params = BeamSearchParams(beam_width(body), max_tokens, body.length_penalty, body.early_stopping,
                              body.ignore_eos, stop_ids)
    width_field = "best_of" if params.beam_width > body.n else "n"  # the field that set the width
    return BeamSearch(params, eos_token_ids, num_logprobs, width_field)


def beam_choice(child: ChildRequest, search: BeamSearch, n: int, tokenizer: Tokenizer,
                num_logprobs: int | None) -> CompletionOutput | None:
    """Choice `child` of a finished search: its prompt's rank-th best beam (None past the results)."""
    beams = search.best(n)
    rank = child.index - child.prompt_index * n
    if rank >= len(beams):
        return None
    return beam_output(child.index, beams[rank], tokenizer, num_logprobs, child.params.skip_special_tokens)


async def _run(engine: AsyncEngine, searches: list[PromptSearch], response_id: str, priority: int,
               service_class: ServiceClass, on_first: Callable[[], None]) -> None:
    step = 0
    while live := [run for run in searches if not run.search.is_done]:
        tasks = []
        for run in live:
            params = run.step_params(step)
            tasks += [asyncio.ensure_future(_score(engine, run.child.prompt, beam.token_ids, params,
                                                   f"{response_id}-{run.child.prompt_index}-{step}-{i}", priority,
                                                   service_class))
                      for i, beam in enumerate(run.search.beams)]
        try:
            outputs = await asyncio.gather(*tasks)
        finally:  # one failed (or the client left): the step's other requests stop too
            for task in tasks:
                task.cancel()
        if step == 0:
            on_first()
        for run in live:
            mine, outputs = outputs[:len(run.search.beams)], outputs[len(run.search.beams):]
            if step == 0:
                run.note_first(mine[0])
            run.search.advance([out.outputs[0].logprobs[0] for out in mine])  # type: ignore[index]
        step += 1


async def _score(engine: AsyncEngine, prompt: EncodedPrompt, beam: tuple[int, ...], params: SamplingParams,
                 request_id: str, priority: int, service_class: ServiceClass) -> RequestOutput:
    last, prompt_logprobs = None, None
    async for output in engine.generate([*prompt.token_ids, *beam], params, request_id, priority, service_class,
                                        every_output=False, cache_salt=prompt.cache_salt):
        last = output
        prompt_logprobs = output.prompt_logprobs or prompt_logprobs  # they come with the first output
    assert last is not None and last.outputs[0].logprobs, "a scoring request ended without its logprobs"
    last.prompt_logprobs = prompt_logprobs
    return last
