"""vLLM's `prompt_logprobs` on /v1/completions and /v1/chat/completions, through the official client."""

from __future__ import annotations

import math
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, LiveServer

GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPT = "The quick brown fox jumps over"


def _tokenize(live: LiveServer, text: str) -> list[int]:
    tokens: list[int] = httpx.post(f"{live.url}/tokenize", json={"prompt": text}).json()["tokens"]
    return tokens


def _complete(client: openai.OpenAI, prompt: str | list[int], **extra: Any) -> Any:
    max_tokens = extra.pop("max_tokens", 2)
    logprobs = extra.pop("logprobs", None)
    echo = extra.pop("echo", False)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, logprobs=logprobs, echo=echo,
                                     extra_body={**GREEDY, **extra})


def test_completion_prompt_logprobs_cover_every_prompt_token(client: openai.OpenAI, live: LiveServer) -> None:
    ids = _tokenize(live, PROMPT)
    choice = _complete(client, PROMPT, prompt_logprobs=3).choices[0]
    entries = choice.model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None  # nothing precedes the first token
    for token_id, entry in zip(ids[1:], entries[1:], strict=True):
        own = entry[str(token_id)]
        assert next(iter(entry)) == str(token_id)  # the prompt token's own entry comes first, as vLLM's
        assert own["rank"] >= 1 and own["logprob"] <= 0.0 and isinstance(own["decoded_token"], str)
        top = sorted((e for k, e in entry.items() if k != str(token_id) or e["rank"] <= 3), key=lambda e: e["rank"])
        assert [e["rank"] for e in top][:3] == [1, 2, 3]
        assert [e["logprob"] for e in top] == sorted((e["logprob"] for e in top), reverse=True)
        assert len(entry) == (3 if own["rank"] <= 3 else 4)
        best = max(e["logprob"] for e in entry.values())
        assert (own["rank"] == 1) == math.isclose(own["logprob"], best, abs_tol=1e-6)


def test_prompt_logprobs_equal_the_decode_time_logprob_of_the_same_token(client: openai.OpenAI,
                                                                         live: LiveServer) -> None:
    """Position i of the prompt scored in prefill equals token i sampled after ids[:i] (forced with
    allowed_token_ids; logprobs are the raw distribution's), a different path through the model."""
    ids = _tokenize(live, PROMPT)
    entries = _complete(client, ids, prompt_logprobs=0).choices[0].model_extra["prompt_logprobs"]
    assert all(len(e) == 1 for e in entries[1:])  # 0: the prompt token's own entry only
    for i in (1, len(ids) // 2, len(ids) - 1):
        sampled = _complete(client, ids[:i], max_tokens=1, logprobs=0, allowed_token_ids=[ids[i]]).choices[0]
        assert sampled.logprobs.tokens is not None and sampled.logprobs.token_logprobs is not None
        assert math.isclose(sampled.logprobs.token_logprobs[0], entries[i][str(ids[i])]["logprob"], abs_tol=2e-4)


def test_echo_keeps_its_own_top_n_beside_prompt_logprobs(client: openai.OpenAI, live: LiveServer) -> None:
    ids = _tokenize(live, PROMPT)
    choice = _complete(client, PROMPT, prompt_logprobs=5, logprobs=1, echo=True).choices[0]
    echoed = choice.logprobs.top_logprobs[1:len(ids)]
    assert all(1 <= len(top) <= 2 for top in echoed)  # the top-1 and the chosen token, not the top-5
    assert all(len(entry) >= 5 for entry in choice.model_extra["prompt_logprobs"][1:])
    for i in range(1, len(ids)):
        assert math.isclose(choice.logprobs.token_logprobs[i],
                            choice.model_extra["prompt_logprobs"][i][str(ids[i])]["logprob"], abs_tol=1e-6)


def test_each_prompt_of_a_batch_gets_its_own(client: openai.OpenAI, live: LiveServer) -> None:
    prompts = ["hello world", PROMPT]
    result = client.completions.create(model=MODEL, prompt=prompts, max_tokens=1, n=2,
                                       extra_body={**GREEDY, "prompt_logprobs": 1})
    for choice in result.choices:
        assert len(choice.model_extra["prompt_logprobs"]) == len(_tokenize(live, prompts[choice.index // 2]))
    assert "prompt_logprobs" not in _complete(client, PROMPT).choices[0].model_extra  # not asked: not sent


def test_chat_prompt_logprobs_come_once_on_the_response(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Say something."}]
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, n=2,
                                            extra_body={**GREEDY, "prompt_logprobs": 2})
    entries = result.model_extra["prompt_logprobs"]
    assert result.usage is not None and len(entries) == result.usage.prompt_tokens
    assert entries[0] is None and all(2 <= len(e) <= 3 for e in entries[1:])
    assert all("prompt_logprobs" not in c.model_extra for c in result.choices)


@pytest.mark.parametrize("extra", [{"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 21},
                                   {"prompt_logprobs": -1}, {"prompt_logprobs": "2"}])
def test_bad_prompt_logprobs_are_a_400_naming_the_field(live: LiveServer, extra: dict[str, Any]) -> None:
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        response = httpx.post(f"{live.url}{path}", json={**body, "max_tokens": 2, **extra})
        assert response.status_code == 400, (path, extra, response.text)
        assert response.json()["error"]["param"] == "prompt_logprobs"
