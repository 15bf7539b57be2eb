"""End to end against the real default model (needs `tokenmill pull smollm2-135m`): slow."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server.conftest import LiveServer, serve_real_model

MODEL = "smollm2-135m"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real() -> Iterator[LiveServer]:
    yield from serve_real_model(MODEL, num_blocks=256)


def test_chat_answers_a_factual_question(real: LiveServer) -> None:
    result = real.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0.0)
    assert "Paris" in (result.choices[0].message.content or "")
    assert result.usage is not None and result.usage.prompt_tokens > 10


def test_streamed_completion_matches_the_whole_and_counts_tokens(real: LiveServer) -> None:
    client = real.client()
    kwargs = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 16, "temperature": 0.0}
    whole = client.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
