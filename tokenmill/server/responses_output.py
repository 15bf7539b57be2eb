"""The Responses API's answers (FastAPI-free, shared by /v1/responses and `tokenmill batch`): output items
from an engine output, the response object, and a stream's typed events.

The answer is a list of output items: one `message` with an `output_text` part (its logprobs when asked)
and one `function_call` item per tool call parsed out of the text. A stream sends OpenAI's typed events,
each with a `sequence_number`: `response.created`, `response.in_progress`, then per item
`output_item.added` → (`content_part.added`, `output_text.delta`..., `output_text.done`,
`content_part.done` | `function_call_arguments.delta`, `function_call_arguments.done`) →
`output_item.done`, and last `response.completed` (or `response.incomplete` when `max_output_tokens`
cut the answer) with the whole response. Streamed and non-streamed answers have the same items.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.request import TokenLogprob
from tokenmill.server.fanout import ChoiceUpdate, cached_prompt_tokens
from tokenmill.server.logprob_format import chat_logprobs
from tokenmill.server.openai_tools import ToolPlan, ToolStream, calls_in_template_form, parse_tool_calls
from tokenmill.server.response_bodies import ToolCallDelta
from tokenmill.server.response_store import ResponseStore, StoredResponse
from tokenmill.server.responses_protocol import ResponsesRequest, conversation_id, new_id, output_message
from tokenmill.server.state import TokenTexts

Json = dict[str, Any]


def answer_items(ctx: ResponseContext, update: ChoiceUpdate) -> list[Json]:
    """A whole answer's output items: its message (unless it is only calls), then its calls."""
    out = update.output
    items: list[Json] = []
    content, calls = out.text, []
    if ctx.tools is not None:
        parsed, found = parse_tool_calls(ctx.tools, out.text)
        content, calls = parsed or "", [(new_id("call"), c.name, c.arguments) for c in found]
    if content or not calls:
        items.append(_message(new_id("msg"), content, ctx.logprobs(out.token_ids, out.logprobs), _status(update)))
    items.extend(_function_call(new_id("fc"), *call) for call in calls)
    return items


def _function_call(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> Json:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


@dataclass(slots=True)
class ResponseContext:
    body: ResponsesRequest
    texts: TokenTexts
    response_id: str
    model: str
    created: int
    service_tier: str
    tools: ToolPlan | None
    num_prompt_tokens: int
    store: ResponseStore | None  # where the finished response goes (None: not stored)
    owner: str | None
    conversation: list[Json]  # the chat messages it answered (history and input, no instructions)
    input_items: list[Json]  # the same conversation's items, as input_items lists them
    # Called with the output of a finished answer (a stored conversation appends the input and it)
    on_answered: Callable[[list[Json]], None] | None = None

    def finish(self, output: list[Json], update: ChoiceUpdate) -> Json:
        """The finished response object, stored with the conversation through it.

        An answer without calls, or with calls written in the template's own form (`<tool_call>` blocks),
        goes into the history as the text the model wrote: a continuation's prompt then repeats the tokens it
        generated, so the prefix cache holds them. Calls written otherwise (a ```json block, a bare object) or
        made by a grammar (required, named) go in as structured calls, which the template shows in its form:
        shown back as written they taught the model to call again after every result (calls_in_template_form)."""
        response = self.response(output, update)
        if self.on_answered is not None:
            self.on_answered(output)
        if self.store is not None:
            text, called = update.output.text, any(item["type"] == "function_call" for item in output)
            as_written = not called or (self.tools is not None and calls_in_template_form(self.tools, text))
            answer = {"role": "assistant", "content": text} if as_written else output_message(output)
            self._store(answer, response)
        return response

    def stopped(self, output: list[Json], status: str, error: Json | None) -> Json:
        """The response of a run that ended early ("cancelled", "failed"), stored with what it had written
        (an item it was still writing ends "incomplete")."""
        output = [{**item, "status": "incomplete"} if item.get("status") == "in_progress" else item
                  for item in output]
        response = self.response(output, None, status, error)
        if self.store is not None:
            self._store(output_message(output) if output else None, response)
        return response

    def _store(self, answer: Json | None, response: Json) -> None:
        assert self.store is not None
        history = self.conversation if answer is None else [*self.conversation, answer]
        self.store.put(self.response_id, StoredResponse(self.owner, history, response, self.input_items))

    def logprobs(self, token_ids: list[int], logprobs: list[TokenLogprob] | None) -> list[Json] | None:
        if not self.body.wants_logprobs:
            return None
        entries = chat_logprobs(self.texts, token_ids, logprobs or [], self.body.top_logprobs or 0).content or []
        return [e.model_dump(mode="json") for e in entries]

    def response(self, output: list[Json], update: ChoiceUpdate | None, status: str = "in_progress",
                 error: Json | None = None) -> Json:
        """The response object: finished when `update` is the last; else `status` (no usage yet)."""
        body, usage, incomplete = self.body, None, None
        if update is not None:
            status = _status(update)
            incomplete = {"reason": "max_output_tokens"} if _cut(update) else None
            num_output = len(update.output.token_ids)
            usage = {"input_tokens": self.num_prompt_tokens,
                     "input_tokens_details": {"cached_tokens": cached_prompt_tokens([update])},
                     "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": self.num_prompt_tokens + num_output}
        text = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text else {"type": "text"}
        return {"id": self.response_id, "object": "response", "created_at": self.created, "status": status,
                "error": error, "incomplete_details": incomplete, "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens, "model": self.model, "output": output,
                "parallel_tool_calls": body.parallel_tool_calls, "temperature": body.temperature,
                "top_p": body.top_p, "top_logprobs": body.top_logprobs,
                "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
                "tools": body.tools or [], "text": {"format": text}, "truncation": body.truncation, "usage": usage,
                "store": self.store is not None, "previous_response_id": body.previous_response_id,
                "background": body.background, "metadata": body.metadata or {}, "user": body.user,
                "conversation": {"id": cid} if (cid := conversation_id(body)) is not None else None,
                "service_tier": self.service_tier, "reasoning": None}


def _cut(update: ChoiceUpdate) -> bool:
    return update.finish_reason == "length"


def _status(update: ChoiceUpdate) -> str:
    return "incomplete" if _cut(update) else "completed"


def _message(item_id: str, text: str, logprobs: list[Json] | None, status: str) -> Json:
    """A message item; "in_progress": a stream's opening of it, before its one text part exists."""
    parts = [] if status == "in_progress" else [_text_part(text, logprobs)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": parts}


def _text_part(text: str, logprobs: list[Json] | None) -> Json:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


@dataclass(slots=True)
class ResponseEvents:
    """The stream's events, from one choice's updates. A message item opens at the first text and closes
    before a function call or at the end; an answer with neither gets one empty message, as unstreamed."""

    ctx: ResponseContext
    sequence: int = 0
    items: list[Json] = field(default_factory=list)  # finished output items, in output order
    message_id: str | None = None  # the open message item
    text: str = ""  # the open message's text so far
    message_lps: list[Json] = field(default_factory=list)  # its logprobs so far
    num_sent_tokens: int = 0
    tool_stream: ToolStream | None = None
    call: Json | None = None  # the function_call item being written (its arguments so far)
    last: ChoiceUpdate | None = None

    def opening(self) -> list[Json]:
        """A foreground response is in progress from the start; a background one is queued until it starts."""
        if self.ctx.body.background:
            snapshot = self.ctx.response([], None, "queued")
            return [self._event("response.created", response=snapshot),
                    self._event("response.queued", response=snapshot)]
        snapshot = self.ctx.response([], None)
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def started(self) -> Json:
        """A background response's `response.in_progress`, at its first output."""
        return self._event("response.in_progress", response=self.ctx.response([], None))

    def partial_output(self) -> list[Json]:
        """The output so far: the finished items, then the open message or call as written so far."""
        items = list(self.items)
        if self.message_id is not None:
            items.append({**_message(self.message_id, self.text, self.message_lps, "completed"),
                          "status": "in_progress"})
        if self.call is not None:
            items.append(dict(self.call))
        return items

    def render(self, update: ChoiceUpdate) -> Iterable[Json]:
        out = update.output
        new_lps = self.ctx.logprobs(out.token_ids[self.num_sent_tokens:],
                                    out.logprobs[self.num_sent_tokens:] if out.logprobs is not None else None)
        self.num_sent_tokens = len(out.token_ids)
        content, deltas = out.text_delta, list[ToolCallDelta]()
        if self.ctx.tools is not None:
            self.tool_stream = self.tool_stream or ToolStream(self.ctx.tools)
            content, deltas = self.tool_stream.feed(out.text_delta)
            if update.is_finished:
                more, last_deltas = self.tool_stream.finish()
                content, deltas = content + more, deltas + last_deltas
        events: list[Json] = []
        self.message_lps.extend(new_lps or [])
        if content:
            events.extend(self._close_call())
            events.extend(self._open_message())
            self.text += content
            events.append(self._event("response.output_text.delta", item_id=self.message_id,
                                      output_index=len(self.items), content_index=0, delta=content,
                                      logprobs=new_lps or []))
        for delta in deltas:  # a delta with an id opens a call; one without adds to the open call's arguments
            if delta.function is None:
                continue
            if delta.id is not None:
                events.extend(self._close_call())
                events.extend(self._close_message(update))
                events.extend(self._open_call(delta.id, delta.function.name or ""))
            assert self.call is not None, "arguments before their call opened"
            if delta.function.arguments:
                self.call["arguments"] += delta.function.arguments
                events.append(self._event("response.function_call_arguments.delta", item_id=self.call["id"],
                                          output_index=len(self.items), delta=delta.function.arguments))
        if update.is_finished:
            self.last = update
            events.extend(self._close_call())
            if not self.items and self.message_id is None:
                events.extend(self._open_message())  # an empty answer is one empty message
            events.extend(self._close_message(update))
        return events

    def closing(self) -> list[Json]:
        if self.last is None:
            return []
        return [self._event(f"response.{_status(self.last)}", response=self.ctx.finish(self.items, self.last))]

    def failed(self, response: Json) -> Json:
        return self._event("response.failed", response=response)

    def _open_message(self) -> list[Json]:
        if self.message_id is not None:
            return []
        self.message_id, self.text = new_id("msg"), ""
        index = len(self.items)
        return [self._event("response.output_item.added", output_index=index,
                            item=_message(self.message_id, "", None, "in_progress")),
                self._event("response.content_part.added", item_id=self.message_id, output_index=index,
                            content_index=0, part=_text_part("", None))]

    def _close_message(self, update: ChoiceUpdate) -> list[Json]:
        if self.message_id is None:
            return []
        item_id, index = self.message_id, len(self.items)
        # A message closed before a function call is complete; one closed at the end shares the answer's fate
        item = _message(item_id, self.text, self.message_lps, _status(update) if update.is_finished else "completed")
        self.items.append(item)
        self.message_id, self.message_lps = None, []
        return [self._event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                            text=self.text, logprobs=item["content"][0]["logprobs"]),
                self._event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                            part=item["content"][0]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _open_call(self, call_id: str, name: str) -> list[Json]:
        self.call = _function_call(new_id("fc"), call_id, name, "", "in_progress")
        return [self._event("response.output_item.added", output_index=len(self.items), item=dict(self.call))]

    def _close_call(self) -> list[Json]:
        if self.call is None:
            return []
        item, index = {**self.call, "status": "completed"}, len(self.items)
        self.items.append(item)
        self.call = None
        return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _event(self, kind: str, **fields: Any) -> Json:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event
