"""`use_beam_search` lines in `tokenmill batch`: the server's search and answer, stepped by the batch job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.unit.test_batch import _by_custom_id, _chat, _completion, _read_output, _write_input, llm, model_dir
from tokenmill.batch.runner import run_batch
from tokenmill.engine.beam_search import BeamSearchParams
from tokenmill.engine.request import SamplingParams
from tokenmill.llm import LLM

__all__ = ["llm", "model_dir"]  # the module's fixtures, shared


def _run(llm: LLM, tmp_path: Path, lines: list[str], max_in_flight: int = 256) -> dict[str, Any]:
    output = tmp_path / "out.jsonl"
    run_batch(llm, _write_input(tmp_path / "in.jsonl", lines), output, model_name="tiny", progress=False,
              max_in_flight=max_in_flight)
    return _by_custom_id(_read_output(output))


def test_a_beam_line_answers_as_llm_beam_search_beside_plain_lines(llm: LLM, tmp_path: Path) -> None:
    """Two prompts, width 3 (best_of), the 2 best each, with top logprobs; a plain line runs in the same steps."""
    lines = [_completion("beam", ["hello world", "one two"], use_beam_search=True, n=2, best_of=3, max_tokens=6,
                         logprobs=2),
             _completion("plain", "hello world", max_tokens=6),
             _completion("echo", "hello world", use_beam_search=True, n=2, max_tokens=6, echo=True, logprobs=1)]
    got = _run(llm, tmp_path, lines)
    body = got["beam"]["response"]["body"]
    expected = llm.beam_search(["hello world", "one two"], BeamSearchParams(3, 6), n=2, logprobs=2)
    texts = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
    assert texts == [o.text for out in expected for o in out.outputs]
    assert [c["finish_reason"] for c in body["choices"]] == \
        [o.finish_reason.value for out in expected for o in out.outputs]  # type: ignore[union-attr]
    first = body["choices"][0]["logprobs"]
    assert len(first["tokens"]) == len(expected[0].outputs[0].token_ids) and len(first["top_logprobs"][0]) == 2
    assert body["usage"]["completion_tokens"] == sum(len(o.token_ids) for out in expected for o in out.outputs)
    echoed = got["echo"]["response"]["body"]["choices"][0]
    assert echoed["text"] == "hello world" + texts[0]  # the prompt, then the same best beam
    num_prompt = len(llm.engine.encode("hello world").token_ids)
    prompt_lps = echoed["logprobs"]["token_logprobs"][:num_prompt]
    assert prompt_lps[0] is None and all(isinstance(lp, float) for lp in prompt_lps[1:]) and num_prompt > 1
    assert len(echoed["logprobs"]["tokens"]) == \
        num_prompt + len(expected[0].outputs[0].token_ids)  # the prompt's logprobs, from the first step
    assert got["plain"]["response"]["body"]["choices"][0]["text"] == llm.generate(
        "hello world", SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0].text


def test_one_engine_request_in_flight_at_a_time_still_finishes_a_search(llm: LLM, tmp_path: Path) -> None:
    """max_in_flight below the width: a line wider than the bound runs once nothing else is in flight."""
    lines = [_completion("a", "hello world", use_beam_search=True, n=2, max_tokens=4),
             _completion("b", "one two", use_beam_search=True, n=2, max_tokens=4)]
    got = _run(llm, tmp_path, lines, max_in_flight=1)
    for custom_id, prompt in (("a", "hello world"), ("b", "one two")):
        expected = llm.beam_search(prompt, BeamSearchParams(2, 4))[0]
        assert [c["text"] for c in got[custom_id]["response"]["body"]["choices"]] == \
            [o.text for o in expected.outputs]


def test_a_chat_beam_line_and_the_server_s_refusals(llm: LLM, tmp_path: Path) -> None:
    lines = [_chat("chat", "hi there", use_beam_search=True, n=2, max_tokens=4),
             _completion("warm", "x", use_beam_search=True, temperature=0.7),
             _completion("wide", "x", use_beam_search=True, best_of=20, max_tokens=2),
             _completion("stop", "x", use_beam_search=True, stop=["a"]),
             _chat("json", "x", use_beam_search=True, response_format={"type": "json_object"})]
    got = _run(llm, tmp_path, lines)
    choices = got["chat"]["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1] and all(c["message"]["role"] == "assistant" for c in choices)
    for custom_id, param in (("warm", "temperature"), ("wide", "best_of"), ("stop", "stop"),
                             ("json", "response_format")):
        response = got[custom_id]["response"]
        assert response["status_code"] == 400, custom_id
        assert response["body"]["error"]["param"] == param, (custom_id, response["body"]["error"])
