"""POST /v1/chat/completions through the official openai client against a live server."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, LiveServer

USER = [{"role": "user", "content": "Tell me a story"}]
OPTS: dict[str, Any] = {"extra_body": {"ignore_eos": True}, "temperature": 0.0}


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]] = USER, **kwargs: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, **{**OPTS, **kwargs})  # type: ignore[arg-type]


def test_chat_completion_message_and_usage(client: openai.OpenAI, live: LiveServer) -> None:
    result = _chat(client, max_tokens=6)
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    choice = result.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    prompt_tokens = httpx.post(f"{live.url}/tokenize", json={"messages": USER}).json()["count"]
    assert result.usage.prompt_tokens == prompt_tokens
    assert result.usage.completion_tokens == 6


def test_max_completion_tokens_wins_over_max_tokens(client: openai.OpenAI) -> None:
    result = _chat(client, max_tokens=9, max_completion_tokens=3)
    assert result.usage.completion_tokens == 3


def test_stream_opens_with_the_role_and_matches_the_whole(client: openai.OpenAI) -> None:
    whole = _chat(client, max_tokens=8).choices[0].message.content
    chunks = list(_chat(client, max_tokens=8, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8


def test_content_parts_are_joined_like_paragraphs(client: openai.OpenAI) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a story"}]}]
    joined = [{"role": "user", "content": "Tell me\na story"}]
    assert _chat(client, parts, max_tokens=5).choices[0].message.content == \
        _chat(client, joined, max_tokens=5).choices[0].message.content


def test_image_parts_are_refused(client: openai.OpenAI) -> None:
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    with pytest.raises(openai.BadRequestError, match="image_url"):
        _chat(client, image, max_tokens=2)


def test_n_samples_are_seeded_and_indexed(client: openai.OpenAI) -> None:
    first = _chat(client, max_tokens=8, n=3, temperature=1.0, seed=42)
    again = _chat(client, max_tokens=8, n=3, temperature=1.0, seed=42)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert first.usage.completion_tokens == 3 * 8


def test_logprobs_and_top_logprobs(client: openai.OpenAI) -> None:
    choice = _chat(client, max_tokens=5, logprobs=True, top_logprobs=2).choices[0]
    content = choice.logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0.0 and isinstance(entry.bytes, list)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)  # greedy picks the top
    assert "".join(e.token for e in content) == choice.message.content or "\ufffd" in choice.message.content


def test_streamed_logprobs_cover_every_token(client: openai.OpenAI) -> None:
    chunks = list(_chat(client, max_tokens=6, logprobs=True, top_logprobs=1, stream=True))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 6


def test_an_unknown_response_format_is_refused_clearly(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, max_tokens=2, response_format={"type": "yaml"})  # type: ignore[typeddict-item]
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == "response_format"
    assert "not supported" in error["message"]


def test_top_logprobs_without_logprobs_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        _chat(client, max_tokens=2, top_logprobs=2)


def test_stop_string_in_chat(client: openai.OpenAI) -> None:
    full = _chat(client, max_tokens=16).choices[0].message.content
    stop = full[2:4]
    assert stop, "the model's output is too short for this test"
    choice = _chat(client, max_tokens=16, stop=[stop]).choices[0]
    assert choice.message.content == full[: full.index(stop)]
    assert choice.finish_reason == "stop"
