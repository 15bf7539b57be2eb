"""A server with --speculative ngram through the official openai client: greedy completions equal
the plain server's, and /metrics counts the drafts."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, LiveServer, start_server, tiny_engine_config
from tokenmill.config import ServerConfig, SpeculativeConfig
from tokenmill.engine.async_engine import AsyncEngine

PROMPTS = ["the the the the the the", "abc abc abc abc", "hello world, hello world, hello"]


def _serve(model_dir: Path, spec: SpeculativeConfig) -> Iterator[LiveServer]:
    engine = AsyncEngine.from_config(replace(tiny_engine_config(model_dir), speculative=spec))
    server = start_server(engine, ServerConfig(served_model_name=MODEL))
    yield server
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def spec_live(tiny_model_dir: Path) -> Iterator[LiveServer]:
    yield from _serve(tiny_model_dir, SpeculativeConfig("ngram", 3, adaptive=False))


def _completions(client: openai.OpenAI, **kwargs: object) -> list[str]:
    return [client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0.0,  # type: ignore[call-overload]
                                      **kwargs).choices[0].text for p in PROMPTS]


def test_greedy_completions_match_the_plain_server_and_drafts_are_counted(
        spec_live: LiveServer, client: openai.OpenAI) -> None:
    spec_client = spec_live.client()
    assert _completions(spec_client) == _completions(client)
    assert _completions(spec_client, stop=["o"]) == _completions(client, stop=["o"])
    # logit_bias applies to every verified row: the biased greedy text, token for token
    biased = _completions(client, logit_bias={str(t): 4.0 for t in range(40, 120, 3)})
    assert biased != _completions(client)
    assert _completions(spec_client, logit_bias={str(t): 4.0 for t in range(40, 120, 3)}) == biased
    metrics = httpx.get(f"{spec_live.url}/metrics").text
    drafts = [line for line in metrics.splitlines() if line.startswith("tokenmill:spec_decode_num_drafts_total")]
    assert drafts and float(drafts[0].split()[-1]) > 0


@pytest.fixture(scope="module")
def hybrid_live(tiny_model_dir: Path) -> Iterator[LiveServer]:
    """--speculative ngram-draft with the tiny model as its own draft (lookups and draft guesses)."""
    yield from _serve(tiny_model_dir, SpeculativeConfig("ngram-draft", 3, draft_model=str(tiny_model_dir),
                                                        draft_quantization="none"))


def test_lookup_then_draft_serves_greedy_and_sampled_requests(hybrid_live: LiveServer, client: openai.OpenAI) -> None:
    """Greedy: the plain server's text. Sampled (the draft draws its guesses from q, which verification
    takes): every token comes back, and the drafts are counted. (A seeded request is not reproducible
    here: the adaptive controller's k per step changes how much randomness verification draws.)"""
    spec_client = hybrid_live.client()
    assert _completions(spec_client) == _completions(client)
    before = _num_drafts(hybrid_live)
    sampled = spec_client.completions.create(model=MODEL, prompt="zebra quantum violin", max_tokens=32,
                                             temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sampled.usage is not None and sampled.usage.completion_tokens == 32
    assert sampled.choices[0].finish_reason == "length"
    assert _num_drafts(hybrid_live) > before  # the sampled request drafted


def _num_drafts(server: LiveServer) -> float:
    return _metric(server, "tokenmill:spec_decode_num_drafts_total")


@pytest.fixture(scope="module")
def suffix_live(tiny_model_dir: Path) -> Iterator[LiveServer]:
    yield from _serve(tiny_model_dir, SpeculativeConfig("suffix", 4, adaptive=False))


def test_suffix_guesses_a_second_request_from_the_first_ones_answer(
        suffix_live: LiveServer, client: openai.OpenAI) -> None:
    """The same prompt twice: the second answer is guessed from the cached first one (the tiny model's
    answer also repeats itself, so the first is partly guessed too; tests/engine/test_suffix_speculation.py
    separates the two). The text is the plain server's both times; /metrics shows the cache filling."""
    spec_client = suffix_live.client()
    prompt = "zebra quantum violin oak"

    def ask(c: openai.OpenAI) -> str:
        return c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.0,
                                    extra_body={"ignore_eos": True}).choices[0].text

    expected = ask(client)
    accepted = []
    for _ in range(2):
        before = _metric(suffix_live, "tokenmill:spec_decode_num_accepted_tokens_total")
        assert ask(spec_client) == expected
        accepted.append(_metric(suffix_live, "tokenmill:spec_decode_num_accepted_tokens_total") - before)
    assert accepted[1] >= max(accepted[0], 15)
    assert _metric(suffix_live, "tokenmill:spec_decode_suffix_cache_tokens") >= 24


def _metric(server: LiveServer, name: str) -> float:
    metrics = httpx.get(f"{server.url}/metrics").text
    return float(next(line for line in metrics.splitlines() if line.startswith(name)).split()[-1])


def test_predicted_outputs_are_taken_and_counted(spec_live: LiveServer, client: openai.OpenAI) -> None:
    """OpenAI's `prediction` through the official client: the answer is the plain server's, and
    usage.completion_tokens_details counts the prediction tokens it took (content parts too)."""
    spec_client = spec_live.client()
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "zq vx wy"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0.0)
    answer = plain.choices[0].message.content or ""
    assert plain.usage is not None and plain.usage.completion_tokens_details is None  # no prediction sent
    predicted = spec_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0.0,
                                                    prediction={"type": "content", "content": answer})
    assert predicted.choices[0].message.content == answer
    details = predicted.usage.completion_tokens_details if predicted.usage is not None else None
    assert details is not None and (details.accepted_prediction_tokens or 0) >= 12
    parts = spec_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0.0,
                                                prediction={"type": "content", "content": [{"type": "text",
                                                                                             "text": answer}]})
    assert parts.choices[0].message.content == answer
    assert parts.usage is not None and parts.usage.completion_tokens_details is not None
    assert (parts.usage.completion_tokens_details.accepted_prediction_tokens or 0) >= 12
    stream = spec_client.completions.create(model=MODEL, prompt="zq vx wy", max_tokens=16, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"prediction": {"type": "content", "content": "vx wy zq"}})
    usage = [c.usage for c in stream if c.usage is not None][-1]
    assert usage.completion_tokens_details is not None  # counted on streams too


@pytest.mark.parametrize(("prediction", "message"), [
    ({"type": "image", "content": "x"}, "prediction.type: Input should be 'content'"),
    ({"type": "content", "content": [{"type": "image_url"}]}, "prediction content parts must be text parts"),
])
def test_bad_predictions_are_400(spec_live: LiveServer, prediction: object, message: str) -> None:
    response = httpx.post(f"{spec_live.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "prediction": prediction})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] == message and error["param"] == "prediction"


@pytest.fixture(scope="module")
def unspeculating_live(tiny_model_dir: Path) -> Iterator[LiveServer]:
    yield from _serve(tiny_model_dir, SpeculativeConfig())  # no --speculative: its own engine, not the shared one


def test_a_server_without_speculation_takes_predictions(unspeculating_live: LiveServer,
                                                        client: openai.OpenAI) -> None:
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "zq vx wy"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                            temperature=0.0).choices[0].message.content or ""
    out = unspeculating_live.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0.0,
        prediction={"type": "content", "content": answer})
    assert out.choices[0].message.content == answer
    assert out.usage is not None and out.usage.completion_tokens_details is not None
    accepted = out.usage.completion_tokens_details.accepted_prediction_tokens or 0
    assert accepted >= 12
    metrics = httpx.get(f"{unspeculating_live.url}/metrics").text
    line = next(x for x in metrics.splitlines()
                if x.startswith("tokenmill:spec_decode_num_prediction_tokens_total") and 'outcome="accepted"' in x)
    assert float(line.split()[-1]) == accepted  # the engine's counter, summed over steps
