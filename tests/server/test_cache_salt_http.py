"""`cache_salt` through the official openai client: a repeated prompt is served from the prefix cache
only for requests of the same salt (usage.prompt_tokens_details.cached_tokens), on both endpoints; with
`--cache-isolation api-key` only for requests of the same API key too, whatever the bodies say."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.server.conftest import MODEL, LiveServer, start_server, tiny_engine_config
from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.errors import TokenmillError

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


@pytest.fixture(scope="module")
def isolated(tiny_model_dir: Path) -> Iterator[LiveServer]:
    # Its own engine: a second server on the shared one would take part of its outputs' metrics.
    engine = AsyncEngine.from_config(tiny_engine_config(tiny_model_dir))
    server = start_server(engine, ServerConfig(served_model_name=MODEL, api_key="key-a",
                                               api_key_classes=(("key-b", "standard"),), cache_isolation="api-key"))
    yield server
    server.stop()
    engine.shutdown()


def test_isolation_by_api_key_keeps_each_keys_cached_blocks_its_own(isolated: LiveServer) -> None:
    a, b = isolated.client(api_key="key-a"), isolated.client(api_key="key-b")
    prompt = "each tenant's blocks stay its own, says this test. " * 2

    def cached(client: openai.OpenAI, salt: str | None = None) -> int:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0,
                                        extra_body={} if salt is None else {"cache_salt": salt})
        return _cached(out.usage)

    assert cached(a) == 0
    assert cached(b) == 0  # the same prompt, unsalted, under another key: no hit
    assert cached(a) >= 16 and cached(b) >= 16
    assert cached(a, "s") == 0 and cached(b, "s") == 0  # the same body salt under two keys: two namespaces
    assert cached(b, "s") >= 16


def test_isolation_by_api_key_needs_keys() -> None:
    with pytest.raises(TokenmillError, match="needs API keys"):
        ServerConfig(cache_isolation="api-key")
