"""Everything around the two endpoints: errors, auth, request ids, tokenizer routes, health, metrics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL, LiveServer, start_server, wait_until
from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine


def _post(live: LiveServer, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json=body, timeout=30, **kwargs)


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# ------------------------------------------------------------------------------ errors


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=2)


def test_prompt_plus_max_tokens_over_the_context_says_by_how_much(live: LiveServer) -> None:
    num_prompt = len(_post(live, "/tokenize", {"prompt": "hello"}).json()["tokens"])
    error = _error(_post(live, "/v1/completions", {"prompt": "hello", "max_tokens": 300}), 400)
    assert f"by {num_prompt + 300 - 256}" in error["message"] and error["param"] == "max_tokens"


def test_prompt_alone_over_the_context_is_400(live: LiveServer) -> None:
    error = _error(_post(live, "/v1/completions", {"prompt": [5] * 300, "max_tokens": 1}), 400)
    assert "shorten the prompt by 45 tokens" in error["message"]


ANY_PARAM = object()  # a check whose error names no field yet (SamplingParams' own cross-field rule)


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"prompt": "hi", "temperature": "hot"}, "temperature", "temperature: Input should be a valid number"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens", "max_tokens: Input should be greater than or equal to 1"),
    ({"prompt": "hi", "n": 0}, "n", "n: Input should be greater than or equal to 1"),
    ({"prompt": "hi", "stream": 1}, "stream", "stream: Input should be a valid boolean"),  # 1 is not a boolean
    ({"prompt": [1, 2, 100000]}, "prompt", "prompt holds token id 100000, outside the vocabulary [0, 263)"),
    ({"prompt": []}, "prompt", "prompt must not be an empty list"),
    ({"prompt": ""}, "prompt", "the prompt is empty: send at least one token"),
    ({"prompt": "hi", "stop": [""]}, "stop", "stop strings must be non-empty"),
    ({"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, ANY_PARAM, "min_tokens must be <= max_tokens"),
    ({"prompt": "hi", "logit_bias": {"5": 200}}, "logit_bias",
     "logit_bias of token 5 is 200.0: values must be in [-100, 100]"),
    ({"prompt": "hi", "suffix": "x"}, "suffix",
     f"suffix needs a model trained to fill in the middle; {MODEL} has no FIM tokens: "
     "put the whole text in the prompt"),
    ({"prompt": "hi", "logit_bias": {"five": 1}}, "logit_bias", "logit_bias keys must be token ids, got 'five'"),
    ({"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias",
     "logit_bias holds token id 99999, outside the vocabulary [0, 263)"),
    ({"prompt": "hi", "seed": 2**70}, "seed", "seed: Input should be less than or equal to 9223372036854775743"),
    ({"prompt": "hi", "stop_token_ids": [99999]}, "stop_token_ids",
     "stop_token_ids holds token id 99999, outside the vocabulary [0, 263)"),
    ({"prompt": "hi", "cache_salt": ""}, "cache_salt", "cache_salt: String should have at least 1 character"),
    ({"prompt": "hi", "cache_salt": 7}, "cache_salt", "cache_salt: Input should be a valid string"),
    ({"prompt": "hi", "use_beam_search": True, "stream": True}, "stream",
     "stream does not combine with use_beam_search: leave it out"),
    ({"prompt": "hi", "use_beam_search": True, "temperature": 0.7}, "temperature",
     "use_beam_search ranks beams by the model's own log-probabilities: leave temperature out (or 0 or 1)"),
    ({"prompt": "hi", "use_beam_search": True, "best_of": 11}, "best_of",
     "beam search scores 33 candidates a beam (width 11 × 3 for 2 stop tokens); at most 20: use a smaller width"),
    ({"prompt": "hi", "best_of": 3}, "best_of", "best_of is not supported by tokenmill: leave it out"),
    ({"prompt": "hi", "allowed_token_ids": [1, 999]}, "allowed_token_ids",
     "allowed_token_ids holds token id 999, outside the vocabulary [0, 263)"),
    ({"prompt": "hi", "length_penalty": 0.5}, "length_penalty", "length_penalty applies to beam search only: set "
     "use_beam_search or leave it out"),
    ({"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens",
     "truncate_prompt_tokens must be -1 or at least 1"),
    ({"prompt": "hi", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens",
     "truncate_prompt_tokens: Input should be greater than or equal to -1"),
    ({"max_tokens": 2}, "prompt", "prompt: Field required"),  # no prompt
    ([1, 2, 3], None, "Input should be a valid dictionary or object to extract fields from"),  # not an object
])
def test_bad_completion_bodies_are_400_and_say_what_is_wrong(live: LiveServer, body: Any, param: object,
                                                             message: str) -> None:
    error = _error(_post(live, "/v1/completions", body), 400)
    assert (error["type"], error["code"], error["message"]) == ("invalid_request_error", None, message)
    if param is not ANY_PARAM:
        assert error["param"] == param


def test_neutral_vllm_fields_and_unknown_fields_pass_and_truncation_keeps_the_prompts_end(live: LiveServer) -> None:
    ok = _post(live, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "best_of": 1, "use_beam_search": False,
                                         "bad_words": [], "some_future_field": {"x": 1}})
    assert ok.status_code == 200, ok.text
    ids = [5 + (7 * i) % 250 for i in range(300)]
    long = _post(live, "/v1/completions", {"prompt": ids, "max_tokens": 2, "temperature": 0.0,
                                           "truncate_prompt_tokens": 100})
    assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] == 100
    end = _post(live, "/v1/completions", {"prompt": ids[-100:], "max_tokens": 2, "temperature": 0.0})
    assert long.json()["choices"][0]["text"] == end.json()["choices"][0]["text"]  # the same last 100 tokens
    most = _post(live, "/v1/completions", {"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": -1})
    assert most.status_code == 200 and most.json()["usage"]["prompt_tokens"] == 255  # the context less one
    chat = _post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 50}], "max_tokens": 1,
                                                "truncate_prompt_tokens": 20})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 20
    refused = _error(_post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                          "continue_final_message": True}), 400)
    assert refused["param"] == "continue_final_message"


def test_allowed_token_ids_and_bad_words_through_the_openai_client(client: openai.OpenAI) -> None:
    allowed = client.completions.create(model=MODEL, prompt="hello", max_tokens=12, temperature=0.0,
                                        extra_body={"allowed_token_ids": [72, 105]})
    tokens = _post_tokens(client, allowed.choices[0].text)
    assert tokens and set(tokens) <= {72, 105}
    plain = client.completions.create(model=MODEL, prompt="hello", max_tokens=16, temperature=0.0).choices[0].text
    word = plain.split()[0] if plain.split() else plain[:2]
    banned = client.completions.create(model=MODEL, prompt="hello", max_tokens=16, temperature=0.0,
                                       extra_body={"bad_words": [word]}).choices[0].text
    assert word not in banned and banned != plain
    with pytest.raises(openai.BadRequestError, match="bad_words must be non-empty words"):
        client.completions.create(model=MODEL, prompt="hello", max_tokens=2, extra_body={"bad_words": [" "]})


def _post_tokens(client: openai.OpenAI, text: str) -> list[int]:
    response = httpx.post(f"{client.base_url}".removesuffix("/v1/") + "/tokenize",
                          json={"prompt": text, "add_special_tokens": False}, timeout=30)
    return list(response.json()["tokens"])


def test_continue_final_message_leaves_the_answer_open_and_template_kwargs_reach_the_template(
        live: LiveServer) -> None:
    from tokenmill.server.openai_inputs import chat_prompt
    from tokenmill.server.protocol import ChatMessage

    prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    tokenizer = live.engine.tokenizer
    messages = [ChatMessage(**m) for m in prefill]
    opened = chat_prompt(tokenizer, messages, False, continue_final=True).text or ""
    closed = chat_prompt(tokenizer, messages, False).text or ""
    assert opened.endswith("The answer is") and closed.startswith(opened) and len(closed) > len(opened)
    ok = _post(live, "/v1/chat/completions", {"messages": prefill, "max_tokens": 2, "add_generation_prompt": False,
                                              "continue_final_message": True, "chat_template_kwargs": {"x": 1}})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(opened, add_special_tokens=False))
    counted = _post(live, "/tokenize", {"messages": prefill, "add_generation_prompt": False,
                                        "continue_final_message": True}).json()["count"]
    assert counted == ok.json()["usage"]["prompt_tokens"]  # /tokenize counts the prompt the chat ran
    for body, message in [
        ({"continue_final_message": True}, "needs add_generation_prompt: false"),
        ({"continue_final_message": True, "add_generation_prompt": False, "messages": prefill[:1]},
         "needs the last message to be an assistant's"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs may not set messages"),
    ]:
        error = _error(_post(live, "/v1/chat/completions", {"messages": prefill, "max_tokens": 2, **body}), 400)
        assert message in error["message"], error


def test_malformed_json_is_400(live: LiveServer) -> None:
    response = httpx.post(f"{live.url}/v1/completions", content=b'{"prompt": "hi",',
                          headers={"Content-Type": "application/json"})
    error = _error(response, 400)
    assert error["type"] == "invalid_request_error" and error["param"] is None  # no field is at fault
    assert error["message"] == ("the request body is not valid JSON: "
                                "Expecting property name enclosed in double quotes (at character 16)")


def test_lone_surrogate_is_400_not_500(live: LiveServer) -> None:
    response = httpx.post(f"{live.url}/v1/completions", content=b'{"prompt": "a\\ud800b", "max_tokens": 2}',
                          headers={"Content-Type": "application/json"})
    error = _error(response, 400)
    assert (error["param"], error["message"]) == (
        "prompt", "prompt is not valid UTF-8 text: surrogates not allowed at position 1")


def test_unknown_fields_are_ignored(live: LiveServer) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "user": "me", "some_future_field": {"x": [1]}}
    response = _post(live, "/v1/completions", body)
    assert response.status_code == 200, response.text
    completion = response.json()
    assert completion["object"] == "text_completion" and completion["model"] == MODEL
    assert completion["usage"]["completion_tokens"] == 2 and completion["choices"][0]["finish_reason"] == "length"
    assert "some_future_field" not in completion and "user" not in completion


def test_unknown_route_has_an_openai_error_body(live: LiveServer) -> None:
    error = _error(httpx.get(f"{live.url}/v1/nothing-here"), 404)
    assert (error["type"], error["message"], error["param"]) == ("not_found_error", "Not Found", None)


# ------------------------------------------------------------------------ request ids


def test_request_id_is_honoured_and_echoed(live: LiveServer) -> None:
    response = _post(live, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers={"X-Request-Id": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123"
    made_up = _post(live, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert len(made_up.headers["x-request-id"]) == 32
    assert _post(live, "/v1/completions", {}).headers["x-request-id"]  # errors carry it too


# ------------------------------------------------------------------------------- auth


@pytest.fixture(scope="module")
def guarded(tiny_engine: AsyncEngine) -> Iterator[LiveServer]:
    server = start_server(tiny_engine, ServerConfig(served_model_name=MODEL, api_key="s3cret"))
    yield server
    server.stop()


def test_api_key_is_required_on_v1(guarded: LiveServer) -> None:
    with pytest.raises(openai.AuthenticationError):
        guarded.client(api_key="wrong").completions.create(model=MODEL, prompt="hi", max_tokens=2)
    denied = httpx.get(f"{guarded.url}/v1/models")
    error = _error(denied, 401)
    assert (error["type"], error["code"], error["message"]) == (
        "authentication_error", "invalid_api_key", "invalid or missing API key: send 'Authorization: Bearer <key>'")
    assert denied.headers["www-authenticate"] == "Bearer"
    result = guarded.client(api_key="s3cret").completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert result.choices[0].finish_reason is not None


def test_health_and_metrics_stay_open_with_a_key(guarded: LiveServer) -> None:
    assert httpx.get(f"{guarded.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{guarded.url}/ready").json() == {"status": "ready"}
    metrics = httpx.get(f"{guarded.url}/metrics")
    assert metrics.status_code == 200 and 'tokenmill:num_requests_running{model_name="tiny"}' in metrics.text


# ---------------------------------------------------------------- tokenizer and models


def test_tokenize_detokenize_round_trip(live: LiveServer) -> None:
    tokenized = _post(live, "/tokenize", {"prompt": "hello world", "return_token_strs": True}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) == len(tokenized["token_strs"])
    assert tokenized["max_model_len"] == 256
    assert _post(live, "/detokenize", {"tokens": tokenized["tokens"]}).json() == {"prompt": "hello world"}
    error = _error(_post(live, "/detokenize", {"tokens": [-1]}), 400)
    assert (error["param"], error["message"]) == ("tokens", "tokens holds token id -1, outside the vocabulary [0, 263)")


def test_tokenize_chat_messages_uses_the_template(live: LiveServer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    tokens = _post(live, "/tokenize", {"messages": messages}).json()["tokens"]
    text = _post(live, "/detokenize", {"tokens": tokens}).json()["prompt"]
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_info_has_what_remote_tokenizers_read(live: LiveServer) -> None:
    info = httpx.get(f"{live.url}/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|im_start|>"
    assert info["model_max_length"] == 256 and "{% for message in messages %}" in info["chat_template"]


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra is not None and models[0].model_extra["max_model_len"] == 256


def test_health_and_ready(live: LiveServer) -> None:
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{live.url}/ready").json() == {"status": "ready"}


def test_metrics_parse_and_count_finished_requests(live: LiveServer) -> None:
    def success_total() -> float:
        text = httpx.get(f"{live.url}/metrics").text
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        return sum(s.value for s in samples if s.name == "tokenmill:request_success_total")

    before = success_total()
    _post(live, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    # The engine counts a request after the step that finished it, possibly after the response left.
    wait_until(lambda: success_total() == before + 1, what="the success counter to move")
