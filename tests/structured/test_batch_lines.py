"""`tokenmill batch` lines take the same structured-output fields as HTTP bodies (shared parsing)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from tests.fixtures.tiny_models import _write_tokenizer
from tests.server.conftest import flattened_copy
from tokenmill.batch.requests import BatchLineError, Endpoint, build_request
from tokenmill.batch.runner import run_batch
from tokenmill.engine.inputs import RequestLimits
from tokenmill.engine.structured.manager import StructuredOutputs
from tokenmill.llm import LLM
from tokenmill.models.loading.tokenizer import Tokenizer


def test_batch_lines_carry_grammars_and_refuse_bad_ones(tmp_path: Path) -> None:
    _write_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    grammars = StructuredOutputs(tokenizer, tokenizer.vocab_size, (0,))
    limits = RequestLimits(512, tokenizer.vocab_size)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    request = build_request("a", Endpoint.CHAT, body, tokenizer, limits, grammars)
    structured = request.children[0].params.structured
    assert structured is not None and structured.kind == "json" and grammars.num_cached == 1
    completion = build_request("b", Endpoint.COMPLETIONS, {"prompt": "x", "guided_choice": ["a", "b"]}, tokenizer,
                               limits, grammars)
    assert completion.children[0].params.structured is not None
    with pytest.raises(BatchLineError, match="regex cannot be compiled") as info:
        build_request("c", Endpoint.COMPLETIONS, {"prompt": "x", "guided_regex": "(("}, tokenizer, limits, grammars)
    assert info.value.param == "guided_regex"


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                                          "unit": {"enum": ["c", "f"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}}


def _line(custom_id: str, url: str, **body: object) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "tiny", **body}})


def test_batch_output_lines_carry_tool_calls_and_cached_tokens(tiny_hf_dir: Callable[[str], Path],
                                                               tmp_path: Path) -> None:
    """What the server answers, a batch line answers: `message.tool_calls` (finish_reason tool_calls,
    arguments valid for the tool's schema) and usage.prompt_tokens_details.cached_tokens, in bodies
    the OpenAI SDK's types accept."""
    model_dir = flattened_copy(tiny_hf_dir("llama"), tmp_path / "tiny")  # flattened logits: seeds sample apart
    llm = LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=256)
    ask = [{"role": "user", "content": "weather in Paris?"}]
    long_prompt = "the same long prompt " * 12  # several 16-token blocks
    lines = [
        _line("required", "/v1/chat/completions", messages=ask, tools=[WEATHER], tool_choice="required",
              parallel_tool_calls=False, max_tokens=80, seed=1),
        _line("named", "/v1/chat/completions", messages=ask, tools=[WEATHER], max_tokens=80, seed=2,
              tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        _line("auto", "/v1/chat/completions", messages=ask, tools=[WEATHER], max_tokens=6, seed=3),
        _line("first", "/v1/completions", prompt=long_prompt, max_tokens=2),
        _line("again", "/v1/completions", prompt=long_prompt, max_tokens=2, n=2, seed=4),
        _line("salted", "/v1/completions", prompt=long_prompt, max_tokens=2, cache_salt="tenant-a"),
        _line("salted-again", "/v1/completions", prompt=long_prompt, max_tokens=2, cache_salt="tenant-a"),
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(line + "\n" for line in lines))
    target = tmp_path / "out.jsonl"
    run_batch(llm, source, target, model_name="tiny", max_in_flight=1, progress=False)  # one line at a time
    bodies = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, target.read_text().splitlines())}
    for name in ("required", "named"):
        completion = ChatCompletion.model_validate(bodies[name])
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls or []
        assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        assert choice.message.content is None
    auto = ChatCompletion.model_validate(bodies["auto"]).choices[0]
    assert auto.message.tool_calls is None and auto.finish_reason == "length"  # random text: no call parsed
    first, again = (Completion.model_validate(bodies[k]).usage for k in ("first", "again"))
    assert first is not None and first.prompt_tokens_details is not None
    assert again is not None and again.prompt_tokens_details is not None
    assert first.prompt_tokens_details.cached_tokens == 0
    cached = again.prompt_tokens_details.cached_tokens or 0
    assert 16 <= cached < again.prompt_tokens  # counted once for the prompt its two choices share
    salted, salted_again = (Completion.model_validate(bodies[k]).usage for k in ("salted", "salted-again"))
    assert salted is not None and salted.prompt_tokens_details is not None
    assert salted_again is not None and salted_again.prompt_tokens_details is not None
    assert salted.prompt_tokens_details.cached_tokens == 0  # the unsalted lines' blocks are not its
    assert (salted_again.prompt_tokens_details.cached_tokens or 0) >= 16
