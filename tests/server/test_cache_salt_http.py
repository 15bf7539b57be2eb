"""`cache_salt` through the official openai client: a repeated prompt is served from the prefix cache
only for requests of the same salt (usage.prompt_tokens_details.cached_tokens), on both endpoints."""

from __future__ import annotations

import openai

from tests.server.conftest import MODEL

PROMPT = "only the cache salt test sends this prompt. " * 2  # several 16-token blocks of the tiny model


def _cached(usage: openai.types.CompletionUsage | None) -> int:
    assert usage is not None and usage.prompt_tokens_details is not None
    return usage.prompt_tokens_details.cached_tokens or 0


def _completion(client: openai.OpenAI, salt: str | None) -> tuple[str, int]:
    extra = {} if salt is None else {"cache_salt": salt}
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0, extra_body=extra)
    return out.choices[0].text, _cached(out.usage)


def test_completions_share_cached_blocks_only_within_a_salt(client: openai.OpenAI) -> None:
    first = _completion(client, "tenant-a")
    assert first[1] == 0
    assert _completion(client, "tenant-b") == (first[0], 0)
    assert _completion(client, None) == (first[0], 0)
    text, cached = _completion(client, "tenant-a")
    assert text == first[0] and cached >= 16
    assert _completion(client, None)[1] >= 16  # unsalted requests share among themselves


def test_chat_completions_are_salted_too(client: openai.OpenAI) -> None:
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": PROMPT + "chat"}]

    def cached(salt: str) -> int:
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                             extra_body={"cache_salt": salt})
        return _cached(out.usage)

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached("tenant-a") >= 16
