"""POST /v1/completions: text or token-id prompts (one or a batch), streamed or not.

Choice `index` is prompt_index × n + sample, as in the OpenAI API. With `echo`, each choice's
text starts with its prompt, and with `logprobs` its legacy logprobs start with one entry per
prompt token, the first null (nothing precedes it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.engine.inputs import EncodedPrompt
from tokenmill.engine.service_class import ServiceClass
from tokenmill.server.beam_api import check_beam_request, search_or_start
from tokenmill.server.choices import completion_choice
from tokenmill.server.fanout import ChoiceUpdate, cached_prompt_tokens, prediction_counts
from tokenmill.server.openai_inputs import completion_inputs
from tokenmill.server.pipeline import collect, now_s, salted, service_class_for, serving
from tokenmill.server.protocol import CompletionRequest
from tokenmill.server.response_bodies import CompletionChoice, CompletionLogprobs, CompletionResponse, Usage
from tokenmill.server.sse import sse_response
from tokenmill.server.state import TokenTexts
from tokenmill.server.timings import Timings

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state, engine = serving(request, body.model)
    if body.use_beam_search:
        check_beam_request(body)
    inputs = completion_inputs(salted(request, body, state.config.cache_isolation), engine.tokenizer, engine.limits,
                               engine.structured)
    texts = state.require_texts()
    service_class = service_class_for(request, body, ServiceClass.STANDARD)
    run, response_id, last = await search_or_start(state, request, engine, body, inputs, service_class, "cmpl")
    ctx = _Context(body, inputs.prompts, texts, response_id, state.config.served_model_name, now_s(),
                   service_class.value)
    if run is not None:
        if body.stream:
            return sse_response(run, _CompletionChunks(ctx), state)
        last = await collect(run, request)
    choices = [completion_choice(body, texts, last[i], last[i].output.text, last[i].output.token_ids,
                                 last[i].output.logprobs) for i in sorted(last)]
    usage = Usage.of(ctx.num_prompt_tokens, sum(len(u.output.token_ids) for u in last.values()),
                     cached_prompt_tokens(last.values()), prediction_counts(last.values()))
    response = CompletionResponse(id=response_id, created=ctx.created, model=ctx.model, choices=choices, usage=usage,
                                  tokenmill=Timings.of(last.values()).extension(), service_tier=ctx.service_tier)
    return JSONResponse(response.model_dump(mode="json"))


@dataclass(slots=True)
class _Context:
    body: CompletionRequest
    prompts: list[EncodedPrompt]
    texts: TokenTexts
    response_id: str
    model: str
    created: int
    service_tier: str  # the class the request runs in, on the response and on every streamed chunk

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)


@dataclass(slots=True)
class _CompletionChunks:
    """Streaming: one chunk per update that carries text, tokens with logprobs, or the finish."""

    ctx: _Context
    num_sent_tokens: dict[int, int] = field(default_factory=dict)
    text_offsets: dict[int, int] = field(default_factory=dict)
    timings: Timings = field(default_factory=Timings)
    finished: list[ChoiceUpdate] = field(default_factory=list)  # finishing updates: their cached tokens

    def opening(self) -> Iterable[CompletionResponse]:
        return []

    def render(self, update: ChoiceUpdate) -> Iterable[CompletionResponse]:
        self.timings.note(update)
        if update.metrics is not None:
            self.finished.append(update)
        index, out = update.child.index, update.output
        sent = self.num_sent_tokens.get(index, 0)
        new_ids = out.token_ids[sent:]
        self.num_sent_tokens[index] = len(out.token_ids)
        new_lps = out.logprobs[sent:] if out.logprobs is not None else None
        wants_logprobs = self.ctx.body.logprobs is not None and bool(new_ids)
        if not (out.text_delta or update.is_finished or wants_logprobs or (update.is_first and self.ctx.body.echo)):
            return []  # nothing new to say yet (held-back text or an unfinished character)
        choice = completion_choice(self.ctx.body, self.ctx.texts, update, out.text_delta, new_ids, new_lps,
                                   self.text_offsets.get(index, 0), with_prompt=update.is_first)
        self.text_offsets[index] = _next_offset(choice.logprobs, self.text_offsets.get(index, 0))
        usage = None
        if self.ctx.body.continuous_usage:  # vLLM's: the usage so far on every chunk
            usage = Usage.of(self.ctx.num_prompt_tokens, sum(self.num_sent_tokens.values()))
        return [self._chunk([choice], usage)]

    def closing(self) -> Iterable[CompletionResponse]:
        if not self.ctx.body.include_usage:
            return []
        usage = Usage.of(self.ctx.num_prompt_tokens, sum(self.num_sent_tokens.values()),
                         cached_prompt_tokens(self.finished), prediction_counts(self.finished))
        return [self._chunk([], usage).model_copy(update={"tokenmill": self.timings.extension()})]

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.ctx.response_id, created=self.ctx.created, model=self.ctx.model,
                                  choices=choices, usage=usage, service_tier=self.ctx.service_tier)


def _next_offset(logprobs: CompletionLogprobs | None, offset: int) -> int:
    if logprobs is None or not logprobs.tokens:
        return offset
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])
