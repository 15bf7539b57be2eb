"""`suffix` on /v1/completions: a fill-in-the-middle prompt for a model trained on it (Qwen2.5-Coder,
pulled by `make test`), through the official openai client."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.conftest import LiveServer, serve_real_model

MODEL = "qwen2.5-coder-0.5b"
PREFIX, SUFFIX = "numbers = [3, 1, 2]\ntotal = ", "\nprint(total)\n"


@pytest.fixture(scope="module")
def coder() -> Iterator[LiveServer]:
    yield from serve_real_model(MODEL, num_blocks=64)


def test_the_middle_fits_between_prefix_and_suffix(coder: LiveServer) -> None:
    client = coder.client()
    filled = client.completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX, max_tokens=24, temperature=0.0)
    assert filled.choices[0].text.startswith("sum(numbers)")
    assert filled.choices[0].finish_reason == "stop"
    plain = client.completions.create(model=MODEL, prompt=PREFIX, max_tokens=24, temperature=0.0)
    assert plain.usage is not None and filled.usage is not None
    # the frame: three markers around the prefix's and the suffix's tokens
    suffix_tokens = len(httpx.post(f"{coder.url}/tokenize", json={"prompt": SUFFIX, "add_special_tokens": False})
                        .json()["tokens"])
    assert filled.usage.prompt_tokens == plain.usage.prompt_tokens + suffix_tokens + 3


def test_echo_with_a_suffix_is_a_400(coder: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError, match="echo cannot be combined with suffix"):
        coder.client().completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX, echo=True, max_tokens=4)
