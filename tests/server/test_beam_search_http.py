"""`use_beam_search` over HTTP with the official client: the choices are the offline API's beams (which
tests/engine/test_beam_search.py holds to transformers'), on both endpoints, with n < width, logprobs,
echo and several prompts; the engine is idle after; the fields it cannot honour are 400s."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, NUM_KV_BLOCKS, LiveServer, wait_until
from tokenmill import LLM
from tokenmill.engine.beam_search import BeamSearchParams


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=128, block_size=16)


def _beams(llm: LLM, prompt: list[int], width: int, max_tokens: int, n: int, **kwargs: Any) -> list[list[int]]:
    (out,) = llm.beam_search([prompt], BeamSearchParams(width, max_tokens, **kwargs), n=n)
    return [o.token_ids for o in out.outputs]


def _text(llm: LLM, token_ids: list[int]) -> str:
    """Decoded as an answer's stream is: bytes of a character that never completes show no text."""
    stream = llm.tokenizer.new_decode_stream(skip_special_tokens=True)
    return "".join(stream.step(t) for t in token_ids)


def _idle(live: LiveServer) -> bool:
    engine = live.engine
    return engine.num_in_flight == 0 and engine.core.kv.pool.num_free == NUM_KV_BLOCKS


def test_completion_choices_are_the_best_beams(client: openai.OpenAI, live: LiveServer, offline: LLM) -> None:
    prompts = ["Once upon a time", "The cat sat"]
    response = client.completions.create(model=MODEL, prompt=prompts, max_tokens=7, n=2, logprobs=2,
                                         extra_body={"use_beam_search": True, "best_of": 4, "length_penalty": 0.5})
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        expected = _beams(offline, offline.tokenizer.encode(prompt), 4, 7, 2, length_penalty=0.5)
        for rank in range(2):
            choice = response.choices[p * 2 + rank]
            assert choice.logprobs is not None and choice.logprobs.tokens is not None
            assert choice.text == _text(offline, expected[rank])
            assert len(choice.logprobs.tokens) == len(expected[rank])  # (top_logprobs: keyed by text, which collides)
    assert response.usage is not None and response.usage.completion_tokens == sum(
        len(c.logprobs.tokens) for c in response.choices if c.logprobs is not None and c.logprobs.tokens)
    wait_until(lambda: _idle(live), what="an idle engine after the search")


def test_chat_choices_are_the_best_beams_and_echo_works(client: openai.OpenAI, offline: LLM) -> None:
    messages = [{"role": "user", "content": "Say something"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, n=3, logprobs=True,  # type: ignore[arg-type]
                                          top_logprobs=1, extra_body={"use_beam_search": True, "ignore_eos": True})
    prompt = offline.tokenizer.encode(offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                                      add_special_tokens=False)
    expected = _beams(offline, prompt, 3, 6, 3, ignore_eos=True)
    assert [c.message.content for c in chat.choices] == [_text(offline, b) for b in expected]
    assert all(c.finish_reason == "length" and c.logprobs is not None and len(c.logprobs.content or []) == 6
               for c in chat.choices)
    echoed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, echo=True,
                                       extra_body={"use_beam_search": True})
    assert echoed.choices[0].text.startswith("Hello")


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True,
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True,
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "stop": ["a"]}, "stop"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "presence_penalty": 1.0}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "best_of": "4"}, "best_of"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "best_of": 8}, "best_of"),  # 3 × 8 candidates
    ("/v1/completions", {"prompt": "x", "early_stopping": True}, "early_stopping"),
    ("/v1/responses", {"input": "x", "use_beam_search": True}, "use_beam_search"),
])
def test_what_beam_search_cannot_honour_is_a_400(live: LiveServer, path: str, body: dict[str, Any],
                                                  param: str) -> None:
    response = httpx.post(f"{live.url}{path}", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_client_leaving_stops_the_search(live: LiveServer) -> None:
    live.engine.fault_injector = lambda: time.sleep(0.05)  # 150 steps: 7.5 s, were the search to run on
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.url}/v1/completions", timeout=1.0, json={
                "model": MODEL, "prompt": "hi", "max_tokens": 150, "n": 3, "use_beam_search": True, "ignore_eos": True})
        wait_until(lambda: _idle(live) and live.state.admission.num_in_flight == 0, timeout_s=4.0,
                   what="the search aborted and its ticket back")
    finally:
        live.engine.fault_injector = None


def _post(live: LiveServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{live.url}{path}", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def test_one_beam_is_the_greedy_answer_with_its_logprobs_and_echo(live: LiveServer) -> None:
    # width 1 is greedy search: the same tokens, the same top-5 (more than the search itself needs) and,
    # echoed, the prompt's logprobs too
    body = {"prompt": "Once upon a time", "max_tokens": 3, "logprobs": 5, "echo": True, "temperature": 0,
            "return_tokens_as_token_ids": True}
    plain_choice = _post(live, "/v1/completions", body)["choices"][0]
    beam_choice = _post(live, "/v1/completions", {**body, "use_beam_search": True})["choices"][0]
    assert beam_choice["text"] == plain_choice["text"]  # decoded alike (bytes of an unfinished character)
    plain, beam = plain_choice["logprobs"], beam_choice["logprobs"]
    assert beam["tokens"] == plain["tokens"]
    assert [None if t is None else sorted(t) for t in beam["top_logprobs"]] == \
        [None if t is None else sorted(t) for t in plain["top_logprobs"]]
    assert beam["token_logprobs"] == pytest.approx(plain["token_logprobs"], abs=1e-3)
    chat = {"messages": [{"role": "user", "content": "Say something"}], "max_tokens": 3, "logprobs": True,
            "top_logprobs": 5, "temperature": 0}
    plain_chat = _post(live, "/v1/chat/completions", chat)["choices"][0]["logprobs"]["content"]
    beam_chat = _post(live, "/v1/chat/completions", {**chat, "use_beam_search": True})["choices"][0]["logprobs"]
    assert [len(t["top_logprobs"]) for t in beam_chat["content"]] == [len(t["top_logprobs"]) for t in plain_chat]


def test_a_search_counts_as_one_finished_request_in_the_metrics(live: LiveServer) -> None:
    def finished() -> float:
        lines = httpx.get(f"{live.url}/metrics").text.splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines
                   if line.startswith("tokenmill:service_class_requests_total{"))

    before = finished()
    _post(live, "/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 2, "use_beam_search": True})
    assert finished() == before + 1
