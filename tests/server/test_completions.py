"""POST /v1/completions through the official openai client against a live server."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, LiveServer

GREEDY = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}  # the random model may pick EOS anywhere; tests want exact lengths


def _complete(client: openai.OpenAI, prompt: str | list[int] | list[str], **kwargs: Any) -> Any:
    """A Completion, or a stream of them with stream=True."""
    extra = {**NO_EOS, **kwargs.pop("extra_body", {})}
    return client.completions.create(model=MODEL, prompt=prompt, extra_body=extra, **kwargs)


def _tokenize(live: LiveServer, text: str) -> list[int]:
    tokens: list[int] = httpx.post(f"{live.url}/tokenize", json={"prompt": text}).json()["tokens"]
    return tokens


def test_completion_returns_text_finish_reason_and_usage(client: openai.OpenAI, live: LiveServer) -> None:
    result = _complete(client, "Hello there", max_tokens=8, **GREEDY)
    assert result.object == "text_completion" and result.model == MODEL
    assert result.id.startswith("cmpl-")
    assert [c.index for c in result.choices] == [0]
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(_tokenize(live, "Hello there"))
    assert result.usage.completion_tokens == 8
    assert result.usage.total_tokens == result.usage.prompt_tokens + 8


def test_stream_concatenates_to_the_same_text(client: openai.OpenAI) -> None:
    whole = _complete(client, "The quick brown fox", max_tokens=12, **GREEDY).choices[0].text
    chunks = list(_complete(client, "The quick brown fox", max_tokens=12, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)


def test_stream_include_usage_ends_with_a_usage_chunk(client: openai.OpenAI, live: LiveServer) -> None:
    chunks = list(_complete(client, "hello", max_tokens=5, stream=True, stream_options={"include_usage": True},
                            **GREEDY))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 5
    assert last.usage.prompt_tokens == len(_tokenize(live, "hello"))
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client: openai.OpenAI) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(_complete(client, "hello", max_tokens=6, stream=True, stream_options=options, **GREEDY))
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert len(counts) == len([c for c in chunks if c.choices]) and counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    chats = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, temperature=0.0, stream=True,
                                                stream_options=options))  # type: ignore[arg-type]
    assert all(c.usage is not None for c in chats[1:])  # the opening role chunk has none yet
    assert chats[-1].usage is not None and chats[-1].usage.completion_tokens == 4


def test_token_id_prompt_equals_text_prompt(client: openai.OpenAI, live: LiveServer) -> None:
    by_text = _complete(client, "def main():", max_tokens=6, **GREEDY).choices[0].text
    by_ids = _complete(client, _tokenize(live, "def main():"), max_tokens=6, **GREEDY).choices[0].text
    assert by_ids == by_text


def test_batch_of_prompts_times_n_indexes_choices(client: openai.OpenAI, live: LiveServer) -> None:
    result = _complete(client, ["hello", "1 2 3 4"], max_tokens=3, n=2, temperature=1.0, seed=5)
    assert sorted(c.index for c in result.choices) == [0, 1, 2, 3]
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(_tokenize(live, "hello")) + len(_tokenize(live, "1 2 3 4"))
    assert result.usage.completion_tokens == 4 * 3


def test_seed_reproduces_and_children_differ(client: openai.OpenAI) -> None:
    def texts(seed: int) -> list[str]:
        result = _complete(client, "Hello there", max_tokens=10, n=3, temperature=1.0, seed=seed)
        return [c.text for c in sorted(result.choices, key=lambda c: c.index)]

    first = texts(1234)
    assert texts(1234) == first
    assert len(set(first)) > 1  # children run with seed + i, not all with the same seed
    # Child i of seed s samples like child 0 of seed s + i.
    assert texts(1235)[0] == first[1]


def test_logprobs_legacy_object(client: openai.OpenAI) -> None:
    choice = _complete(client, "hello", max_tokens=6, logprobs=3, **GREEDY).choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob is not None and logprob <= 0.0
        assert top is not None and token in top and 1 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)  # greedy: the chosen token is the top one
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_with_logprobs_scores_every_prompt_token(client: openai.OpenAI, live: LiveServer) -> None:
    prompt = "Hello there"
    num_prompt = len(_tokenize(live, prompt))
    choice = _complete(client, prompt, max_tokens=4, logprobs=1, echo=True, **GREEDY).choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == num_prompt + 4
    assert "".join(lp.tokens[:num_prompt]) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert all(v is not None and v <= 0.0 for v in lp.token_logprobs[1:])


def test_echo_in_a_stream_sends_the_prompt_first(client: openai.OpenAI) -> None:
    chunks = list(_complete(client, "hello", max_tokens=3, echo=True, stream=True, **GREEDY))
    whole = _complete(client, "hello", max_tokens=3, echo=True, **GREEDY).choices[0].text
    assert chunks[0].choices[0].text.startswith("hello")
    assert "".join(c.choices[0].text for c in chunks) == whole


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_truncates_and_reports_it(client: openai.OpenAI, stream: bool) -> None:
    full = _complete(client, "def main():", max_tokens=16, **GREEDY).choices[0].text
    stop = full[3:6]
    expected = full[: full.index(stop)]
    if stream:
        chunks = list(_complete(client, "def main():", max_tokens=16, stop=[stop], stream=True, **GREEDY))
        text, last = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0]
    else:
        last = _complete(client, "def main():", max_tokens=16, stop=stop, **GREEDY).choices[0]
        text = last.text
    assert text == expected
    assert last.finish_reason == "stop"
    assert last.model_extra is not None and last.model_extra["stop_reason"] == stop


def test_stop_string_kept_when_asked(client: openai.OpenAI) -> None:
    full = _complete(client, "def main():", max_tokens=16, **GREEDY).choices[0].text
    stop = full[3:6]
    kept = _complete(client, "def main():", max_tokens=16, stop=[stop], extra_body={"include_stop_str_in_output": True},
                     **GREEDY).choices[0].text
    assert kept == full[: full.index(stop) + len(stop)]


def test_min_tokens_and_priority_are_accepted(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt="hello", max_tokens=4,
                                       extra_body={"min_tokens": 4, "priority": -5, "top_k": 5, "min_p": 0.1})
    assert result.usage is not None and result.usage.completion_tokens == 4



def _greedy_ids(client: openai.OpenAI, **kwargs: Any) -> tuple[list[int], list[float]]:
    """Five greedy tokens after "hello" as ids, with their logprobs."""
    lp = _complete(client, "hello", max_tokens=5, logprobs=0, extra_body={"return_tokens_as_token_ids": True},
                   **GREEDY, **kwargs).choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    return [int(t.removeprefix("token_id:")) for t in lp.tokens], [float(x) for x in lp.token_logprobs]


def test_logit_bias_forces_and_bans_tokens(client: openai.OpenAI) -> None:
    """+100 on one id makes it every greedy token, -100 on the unbiased run's tokens keeps them all out;
    logprobs stay the raw model's (the forced token is far from certain under it)."""
    plain, _ = _greedy_ids(client)
    assert plain != [42] * 5
    forced, logprobs = _greedy_ids(client, logit_bias={"42": 100})
    assert forced == [42] * 5 and all(x < -0.1 for x in logprobs)
    banned, _ = _greedy_ids(client, logit_bias={str(t): -100 for t in set(plain)})
    assert not set(banned) & set(plain)
