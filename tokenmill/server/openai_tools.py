"""Tool calling in chat completions: what the request asks (`ToolPlan`), the grammar that enforces
`required` and named functions, and the parsers that turn the model's text back into `tool_calls`.

Modes, as vLLM implements them for OpenAI's `tool_choice`:
- `auto`: the tools go into the chat template (Qwen/Hermes: a `<tools>` block in the system
  prompt); the model answers in text or with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, which are parsed out of the text (free decoding: the model decides).
- `required`: the output is constrained to a JSON array of `{"name", "arguments"}` objects, one
  schema per tool (`maxItems: 1` without parallel calls), so arguments always match their schema.
- named function: the output is constrained to that function's parameters schema; it is the call's
  arguments.
- `none` (or no tools): plain chat; the tools are still shown to the template only if given.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenmill.engine.structured import StructuredOutputParams
from tokenmill.errors import RequestValidationError
from tokenmill.server.protocol import ChatRequest
from tokenmill.server.response_bodies import FunctionCallDelta, FunctionCallOut, ToolCallDelta, ToolCallOut

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
# A whole answer that is one fenced JSON block (Qwen2.5-Coder-1.5B answers a call so, without the tags)
_FENCED = re.compile(r"\A\s*```(?:json)?\s*(.*?)\s*```\s*\Z", re.DOTALL)
_FENCE, _CALL_OPENING = "```json", '{"name":"'


@dataclass(frozen=True, slots=True)
class ToolPlan:
    mode: Literal["auto", "required", "named"]
    functions: dict[str, dict[str, Any]]  # name → the tool's `function` object
    named: str | None = None
    parallel: bool = True

    def structured(self) -> StructuredOutputParams | None:
        if self.mode == "named":
            assert self.named is not None
            return StructuredOutputParams.json(_parameters(self.functions[self.named]))
        if self.mode == "required":
            items = [{"type": "object", "properties": {"name": {"const": name}, "arguments": _parameters(fn)},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for name, fn in self.functions.items()]
            schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                      "items": items[0] if len(items) == 1 else {"anyOf": items}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputParams.json(schema)
        return None


def tool_plan(body: ChatRequest) -> ToolPlan | None:
    """The request's tools checked (400 naming the field), or None when no tool may be called."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise RequestValidationError("tool_choice needs tools: send the tools it may call", "tool_choice")
        return None
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(body.tools):
        fn = tool.get("function")
        if (tool.get("type", "function") != "function" or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str)):
            raise RequestValidationError(
                f"tools.{i} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": ...}}}}",
                "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise RequestValidationError(f"tools.{i}.function.parameters must be a JSON schema object", "tools")
        functions[fn["name"]] = fn
    if choice is None or choice == "auto":
        return ToolPlan("auto", functions, parallel=body.parallel_tool_calls)
    if choice == "none":
        return None
    if choice == "required":
        return ToolPlan("required", functions, parallel=body.parallel_tool_calls)
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise RequestValidationError(
                'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                "tool_choice")
        if name not in functions:
            raise RequestValidationError(
                f"tool_choice names function {name!r}, which is not in tools ({', '.join(functions)})", "tool_choice")
        return ToolPlan("named", functions, named=name, parallel=False)
    raise RequestValidationError(
        f'tool_choice {choice!r} is not supported: use "none", "auto", "required" or a named function', "tool_choice")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: a call's arguments as an object, not JSON text
    (Qwen's and Hermes' templates write `arguments | tojson`)."""
    result = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = dict(message)
            message["tool_calls"] = [_template_call(c) for c in calls]
        result.append(message)
    return result


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            return call
        return {**call, "function": {**fn, "arguments": args}}
    return call


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_of(obj: Any) -> FunctionCallOut | None:
    """{"name", "arguments"} (or "parameters") → a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return FunctionCallOut(name=obj["name"], arguments=args if isinstance(args, str)
                           else json.dumps(args, ensure_ascii=False))


def calls_in_template_form(plan: ToolPlan, text: str) -> bool:
    """Whether an answer's calls were written as the chat template writes calls (`<tool_call>` blocks, free
    decoding): only such an answer can be shown back as written without teaching the model another form.
    Measured with Qwen2.5-Coder-1.5B through the OpenAI Agents SDK: shown its ```json call back as written,
    it called the tool again after every result until the run's turn limit; shown the template's form, it
    answered."""
    return plan.mode == "auto" and _OPEN in text and _bare_call(plan, text) is None


def parse_tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[FunctionCallOut]]:
    """The message's content and its calls. Text that does not parse stays content."""
    if plan.mode == "named":
        # The grammar made the text that function's arguments: they are the call as written (a stream sends
        # them as they come), cut short too where max_tokens cut the answer (as OpenAI's forced calls are)
        assert plan.named is not None
        return None, [FunctionCallOut(name=plan.named, arguments=text)]
    if plan.mode == "required":
        try:
            value = json.loads(text)
        except ValueError:
            return text, []
        found = [c for c in (_call_of(v) for v in (value if isinstance(value, list) else [value])) if c is not None]
        return (None, found) if found else (text, [])
    bare = _bare_call(plan, text)
    if bare is not None:
        return None, [bare]
    calls: list[FunctionCallOut] = []
    kept: list[str] = []
    at = 0
    for match in _BLOCK.finditer(text):
        try:
            call = _call_of(json.loads(match.group(1)))
        except ValueError:
            call = None
        if call is None:
            continue
        kept.append(text[at:match.start()])
        at = match.end()
        calls.append(call)
    kept.append(text[at:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def _bare_call(plan: ToolPlan, text: str) -> FunctionCallOut | None:
    """A whole answer that is one `{"name": <a tool>, "arguments": ...}` object without the tags, bare or
    in one fenced code block (small Qwen2.5-Coder models answer so)."""
    fenced = _FENCED.match(text)
    body = fenced.group(1) if fenced is not None else text
    if not body.lstrip().startswith("{"):
        return None
    try:
        call = _call_of(json.loads(body))
    except ValueError:
        return None
    return call if call is not None and call.name in plan.functions else None


def tool_calls_out(calls: list[FunctionCallOut]) -> list[ToolCallOut]:
    return [ToolCallOut(id=new_call_id(), function=c) for c in calls]


@dataclass(slots=True)
class ToolStream:
    """Splits one choice's streamed text into content deltas and whole tool-call deltas.

    `auto`: content flows until `<tool_call>` (a partial tag and trailing whitespace are held
    back); each block becomes one `delta.tool_calls` entry (id, name and all arguments) when it
    closes, or at the end. `required`: everything is held and parsed at the end (the text is one JSON
    value). Named: the text is the call's arguments, sent as they come (the first delta with the id and
    name). Streamed and non-streamed answers carry the same calls and the same content.
    """

    plan: ToolPlan
    text: str = ""
    emitted: int = 0  # characters of `text` already sent as content or consumed by calls
    in_call: bool = False
    num_calls: int = 0
    _seen_content: bool = field(default=False)

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self.text += delta
        if self.plan.mode == "named":
            return "", [self._named_delta(delta)] if delta else []
        if self._whole():
            return "", []  # the whole text is parsed at the end (one JSON value, maybe a bare call)
        content, calls = "", []
        while True:
            rest = self.text[self.emitted:]
            if self.in_call:
                end = rest.find(_CLOSE)
                if end < 0:
                    break
                call = self._parse(rest[:end])
                self.emitted += end + len(_CLOSE)
                self.in_call = False
                if call is not None:
                    calls.append(call)
                continue
            start = rest.find(_OPEN)
            if start >= 0:
                content += rest[:start].rstrip()
                self.emitted += start + len(_OPEN)
                self.in_call = True
                continue
            hold = _partial_suffix(rest, _OPEN)
            safe = rest[:len(rest) - hold].rstrip()  # trailing whitespace waits: it may end the content
            content += safe
            self.emitted += len(safe)
            break
        return self._content(content), calls

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self.plan.mode == "named":
            return "", [] if self.num_calls else [self._named_delta("")]
        if self._whole():
            content, calls = parse_tool_calls(self.plan, self.text[self.emitted:])
            return self._content(content or ""), [self._delta(c) for c in calls]
        rest = self.text[self.emitted:]
        if self.in_call:
            call = self._parse(rest)
            if call is not None:
                return "", [call]
            return self._content(_OPEN + rest), []
        return self._content(rest.strip() if self.num_calls else rest.rstrip()), []

    def _named_delta(self, arguments: str) -> ToolCallDelta:
        """A named call's arguments as they come: the first delta opens the call (id, name), as OpenAI's do."""
        if self.num_calls:
            return ToolCallDelta(index=0, function=FunctionCallDelta(arguments=arguments))
        assert self.plan.named is not None
        return self._delta(FunctionCallOut(name=self.plan.named, arguments=arguments))

    def _whole(self) -> bool:
        """Whether the text must wait for its end: a required answer (one JSON value), or an auto
        answer that so far is, or may still become, a bare or fenced call (`_bare_call`); a fence that turns
        out to open anything else (code) is released as soon as that shows."""
        if self.plan.mode != "auto":
            return True
        if self._seen_content:
            return False
        text = self.text.lstrip()
        if text.startswith("{") or (text and _FENCE.startswith(text)):
            return True
        if not text.startswith("```"):
            return False
        rest = re.sub(r"\s+", "", text[3:].removeprefix("json"))  # whitespace outside the name is JSON's
        if len(rest) <= len(_CALL_OPENING):
            return _CALL_OPENING.startswith(rest)
        if not rest.startswith(_CALL_OPENING):
            return False
        name = rest[len(_CALL_OPENING):]
        if '"' in name:
            return name[:name.index('"')] in self.plan.functions  # a call: wait for the fence to close
        return any(tool.startswith(name) for tool in self.plan.functions)

    def _content(self, text: str) -> str:
        if not self._seen_content:
            text = text.lstrip()
        if text:
            self._seen_content = True
        return text

    def _parse(self, block: str) -> ToolCallDelta | None:
        try:
            call = _call_of(json.loads(block))
        except ValueError:
            return None
        return None if call is None else self._delta(call)

    def _delta(self, call: FunctionCallOut) -> ToolCallDelta:
        delta = ToolCallDelta(index=self.num_calls, id=new_call_id(), type="function",
                              function=FunctionCallDelta(name=call.name, arguments=call.arguments))
        self.num_calls += 1
        return delta


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
