"""POST /v1/chat/completions: messages rendered with the model's chat template, streamed or not.

A stream opens with one `{"role": "assistant", "content": ""}` delta per choice, as OpenAI's
does, then content deltas, a finish chunk per choice, and (with `include_usage`) one last
chunk with `choices: []` and the usage.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.engine.inputs import EncodedPrompt
from tokenmill.engine.request import TokenLogprob
from tokenmill.engine.service_class import ServiceClass
from tokenmill.server.beam_api import check_beam_request, search_or_start
from tokenmill.server.choices import chat_choice, chat_choice_logprobs, chat_prompt_logprobs, tool_finish
from tokenmill.server.fanout import ChoiceUpdate, cached_prompt_tokens, prediction_counts
from tokenmill.server.openai_inputs import chat_inputs
from tokenmill.server.openai_tools import ToolPlan, ToolStream, calls_in_template_form
from tokenmill.server.pipeline import (
    api_key_id,
    collect,
    now_s,
    salted,
    service_class_for,
    serving,
)
from tokenmill.server.protocol import ChatRequest
from tokenmill.server.response_bodies import (
    ChatChunk,
    ChatDelta,
    ChatLogprobs,
    ChatResponse,
    ChatStreamChoice,
    ToolCallDelta,
    Usage,
)
from tokenmill.server.sse import sse_response
from tokenmill.server.state import TokenTexts
from tokenmill.server.timings import Timings
from tokenmill.server.written_calls import WrittenCalls, calls_of

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatRequest, request: Request) -> Response:
    state, engine = serving(request, body.model)
    owner = api_key_id(request)
    if body.use_beam_search:
        check_beam_request(body)
    if any(m.tool_calls for m in body.messages if m.role == "assistant"):
        body = body.model_copy(update={"messages": state.written_calls.restore(body.messages, owner)})
    inputs = chat_inputs(salted(request, body, state.config.cache_isolation), engine.tokenizer, engine.limits,
                         engine.structured)
    (prompt,) = inputs.prompts
    texts = state.require_texts()
    service_class = service_class_for(request, body, ServiceClass.INTERACTIVE)
    run, response_id, last = await search_or_start(state, request, engine, body, inputs, service_class, "chatcmpl")
    ctx = _Context(body, prompt, texts, response_id, state.config.served_model_name, now_s(), service_class.value,
                   state.written_calls, owner, inputs.tools)
    if run is not None:
        if body.stream:
            return sse_response(run, _ChatChunks(ctx), state)
        last = await collect(run, request)
    choices = [chat_choice(body, texts, inputs.tools, last[i]) for i in sorted(last)]
    for choice in choices:  # only calls written in the template's own form: see written_calls.py
        if choice.message.tool_calls and inputs.tools is not None \
                and calls_in_template_form(inputs.tools, last[choice.index].output.text):
            state.written_calls.note(owner, last[choice.index].output.text, choice.message.content,
                                     calls_of(choice.message.tool_calls))
    usage = Usage.of(len(prompt.token_ids), sum(len(u.output.token_ids) for u in last.values()),
                     cached_prompt_tokens(last.values()), prediction_counts(last.values()))
    response = ChatResponse(id=response_id, created=ctx.created, model=ctx.model, choices=choices, usage=usage,
                            tokenmill=Timings.of(last.values()).extension(), service_tier=ctx.service_tier,
                            prompt_logprobs=chat_prompt_logprobs(body, texts, last[min(last)]))
    return JSONResponse(response.model_dump(mode="json"))


@dataclass(slots=True)
class _Context:
    body: ChatRequest
    prompt: EncodedPrompt
    texts: TokenTexts
    response_id: str
    model: str
    created: int
    service_tier: str  # the class the request runs in, on the response and on every streamed chunk
    written: WrittenCalls  # where answers with calls are kept as written
    owner: str | None  # the API key id they belong to
    tools: ToolPlan | None = None  # the answer may hold tool calls: parse them out

    def logprobs(self, token_ids: list[int], logprobs: list[TokenLogprob] | None) -> ChatLogprobs | None:
        return chat_choice_logprobs(self.body, self.texts, token_ids, logprobs)


@dataclass(slots=True)
class _ChatChunks:
    ctx: _Context
    num_sent_tokens: dict[int, int] = field(default_factory=dict)
    timings: Timings = field(default_factory=Timings)
    finished: list[ChoiceUpdate] = field(default_factory=list)  # finishing updates: their cached tokens
    tool_streams: dict[int, ToolStream] = field(default_factory=dict)
    sent_content: dict[int, str] = field(default_factory=dict)  # with tools: each choice's content so far...
    sent_calls: dict[int, dict[int, list[str]]] = field(default_factory=dict)  # ...and calls (id, name, arguments)

    def opening(self) -> Iterable[ChatChunk]:
        return [self._chunk([ChatStreamChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                for i in range(self.ctx.body.n)]

    def render(self, update: ChoiceUpdate) -> Iterable[ChatChunk]:
        self.timings.note(update)
        if update.metrics is not None:
            self.finished.append(update)
        index, out = update.child.index, update.output
        sent = self.num_sent_tokens.get(index, 0)
        self.num_sent_tokens[index] = len(out.token_ids)
        new_ids = out.token_ids[sent:]
        content, finish_reason = out.text_delta, update.finish_reason
        calls: list[ToolCallDelta] = []
        if self.ctx.tools is not None:
            stream = self.tool_streams.setdefault(index, ToolStream(self.ctx.tools))
            content, calls = stream.feed(out.text_delta)
            if update.is_finished:
                more, last_calls = stream.finish()
                content, calls = content + more, calls + last_calls
                if stream.num_calls:
                    finish_reason = tool_finish(finish_reason)
        if not (content or calls or update.is_finished or (self.ctx.body.logprobs and new_ids)):
            return []  # nothing new to say yet (held-back text or an unfinished character)
        if self.ctx.tools is not None and self.ctx.tools.mode == "auto":
            self._keep_written(update, content, calls)
        new_lps = out.logprobs[sent:] if out.logprobs is not None else None
        choice = ChatStreamChoice(index=index, delta=ChatDelta(content=content or None, tool_calls=calls or None),
                                  logprobs=self.ctx.logprobs(new_ids, new_lps), finish_reason=finish_reason,
                                  stop_reason=out.stop_reason)
        usage = None
        if self.ctx.body.continuous_usage:  # vLLM's: the usage so far on every chunk
            usage = Usage.of(len(self.ctx.prompt.token_ids), sum(self.num_sent_tokens.values()))
        return [self._chunk([choice], usage)]

    def _keep_written(self, update: ChoiceUpdate, content: str, calls: list[ToolCallDelta]) -> None:
        """What the client got of an answer with calls, so the written text replaces it when sent back."""
        index = update.child.index
        self.sent_content[index] = self.sent_content.get(index, "") + content
        for d in calls:
            entry = self.sent_calls.setdefault(index, {}).setdefault(d.index, ["", "", ""])
            entry[0] += d.id or ""
            entry[1] += (d.function.name or "") if d.function else ""
            entry[2] += (d.function.arguments or "") if d.function else ""
        if update.is_finished and index in self.sent_calls and self.ctx.tools is not None \
                and calls_in_template_form(self.ctx.tools, update.output.text):
            written = [(i, n, a) for _, (i, n, a) in sorted(self.sent_calls[index].items())]
            self.ctx.written.note(self.ctx.owner, update.output.text, self.sent_content[index] or None, written)

    def closing(self) -> Iterable[ChatChunk]:
        if not self.ctx.body.include_usage:
            return []
        usage = Usage.of(len(self.ctx.prompt.token_ids), sum(self.num_sent_tokens.values()),
                         cached_prompt_tokens(self.finished), prediction_counts(self.finished))
        return [self._chunk([], usage).model_copy(update={"tokenmill": self.timings.extension()})]

    def _chunk(self, choices: list[ChatStreamChoice], usage: Usage | None = None) -> ChatChunk:
        return ChatChunk(id=self.ctx.response_id, created=self.ctx.created, model=self.ctx.model, choices=choices,
                         usage=usage, service_tier=self.ctx.service_tier)
