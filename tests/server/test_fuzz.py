"""Property: no request body, however odd, gets a 5xx or hurts the server (it stays ready and
the engine never restarts). Bodies mix plausible values with junk of every JSON type; sizes
stay small so that a run takes seconds."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.server.conftest import LiveServer, wait_until

JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 40), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False, width=32), st.text(max_size=8),
)
JSON = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=6), inner, max_size=3), max_leaves=6)


# Each field in its valid range (edges included); `_bodies` then breaks at most one field.
SAMPLING = {
    "model": st.just("tiny"),
    "temperature": st.floats(0.0, 2.0),
    "top_p": st.floats(0.01, 1.0),
    "top_k": st.integers(-1, 400),
    "min_p": st.floats(0.0, 1.0),
    "repetition_penalty": st.floats(0.01, 3.0),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "seed": st.integers(-(2**63), 2**63 - 65),
    "n": st.integers(1, 3),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 262), max_size=3),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "priority": st.integers(-10, 10),
    "skip_special_tokens": st.booleans(),
}
PROMPT = st.one_of(st.text(min_size=1, max_size=24), st.lists(st.integers(0, 262), min_size=1, max_size=8),
                   st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=3),
                   st.lists(st.lists(st.integers(0, 262), min_size=1, max_size=4), min_size=1, max_size=2))
PART = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)})
CALL = st.fixed_dictionaries({"id": st.text(max_size=6), "type": st.just("function"), "function": st.one_of(
    st.fixed_dictionaries({"name": st.text(max_size=4), "arguments": st.text(max_size=8)}), JSON)})
MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant", "tool"]),
    "content": st.one_of(st.none(), st.text(max_size=24), st.lists(PART, max_size=2)),
}, optional={"tool_calls": st.lists(CALL, max_size=2), "tool_call_id": st.text(max_size=6)})
BEAMS = {"use_beam_search": st.booleans(), "length_penalty": st.floats(-2.0, 2.0),
         "early_stopping": st.sampled_from([True, False, "never"]), "best_of": st.integers(1, 4)}
COMPLETION_FIELDS = {**SAMPLING, **BEAMS, "logprobs": st.integers(0, 5), "echo": st.booleans()}
CHAT_FIELDS = {**SAMPLING, **BEAMS, "max_completion_tokens": st.integers(1, 6), "logprobs": st.booleans(),
               "top_logprobs": st.integers(0, 5), "response_format": st.fixed_dictionaries({"type": st.just("text")})}
# Out-of-range values and bodies parts that are refused with a 400, never a 500.
INVALID = st.one_of(JSON, st.integers(-(2**70), 2**70), st.floats(-1e30, 1e30), st.text(max_size=300))


@st.composite
def _bodies(draw: st.DrawFn, required: dict[str, Any], optional: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = draw(st.fixed_dictionaries(required, optional=optional))
    if draw(st.integers(0, 2)) == 0:  # a third of the bodies get one field broken (or removed)
        key = draw(st.sampled_from(sorted({*required, *optional})))
        body[key] = draw(INVALID)
        if draw(st.booleans()) and key in required:
            del body[key]
    return body


COMPLETION = _bodies({"prompt": PROMPT, "max_tokens": st.integers(1, 6)}, COMPLETION_FIELDS)
CHAT = _bodies({"messages": st.lists(MESSAGE, min_size=1, max_size=3), "max_tokens": st.integers(1, 6)},
               CHAT_FIELDS)
TOOL = st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(["f", "g"]),
                              "parameters": st.just({"type": "object", "properties": {"x": {"type": "integer"}}})})
ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "developer"]),
                           "content": st.one_of(st.text(max_size=24), st.lists(st.fixed_dictionaries(
                               {"type": st.just("input_text"), "text": st.text(max_size=8)}), max_size=2))}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.text(max_size=4),
                           "name": st.sampled_from(["f", "g"]), "arguments": st.text(max_size=8)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.text(max_size=4),
                           "output": st.text(max_size=8)}))
RESPONSES_FIELDS = {
    **{k: v for k, v in SAMPLING.items() if k not in ("n", "stream_options")},
    "instructions": st.text(max_size=16), "top_logprobs": st.integers(0, 5), "store": st.booleans(),
    "tools": st.lists(TOOL, max_size=2), "tool_choice": st.sampled_from(["auto", "none", "required"]),
    "text": st.fixed_dictionaries({"format": st.sampled_from([{"type": "text"}, {"type": "json_object"}])}),
    "previous_response_id": st.text(max_size=8), "background": st.booleans(),
    "conversation": st.one_of(st.text(max_size=8), st.fixed_dictionaries({"id": st.text(max_size=8)})),
}
RESPONSES = _bodies({"input": st.one_of(st.text(min_size=1, max_size=24), st.lists(ITEM, min_size=1, max_size=3)),
                     "max_output_tokens": st.integers(1, 6)}, RESPONSES_FIELDS)
CONVERSATION = _bodies({}, {"items": st.lists(ITEM, max_size=3),
                            "metadata": st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2)})
FUZZ_SETTINGS = settings(max_examples=120, deadline=None, database=None,
                         suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=60) as client:
        yield client


def _check(http: httpx.Client, live: LiveServer, path: str, body: dict[str, Any]) -> None:
    restarts = live.engine.num_restarts
    with http.stream("POST", path, json=body) as response:
        text = response.read().decode()
    assert response.status_code < 500, (body, text)
    event(f"HTTP {response.status_code}")  # --hypothesis-show-statistics: how many got through
    if response.status_code == 200 and text.startswith("data:"):
        events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        assert all("error" not in json.loads(e) for e in events[:-1]), (body, text)
    assert live.engine.num_restarts == restarts, body


@FUZZ_SETTINGS
@given(body=COMPLETION)
def test_fuzzed_completion_bodies_never_5xx(http: httpx.Client, live: LiveServer, body: dict[str, Any]) -> None:
    _check(http, live, "/v1/completions", body)


@FUZZ_SETTINGS
@given(body=CHAT)
def test_fuzzed_chat_bodies_never_5xx(http: httpx.Client, live: LiveServer, body: dict[str, Any]) -> None:
    _check(http, live, "/v1/chat/completions", body)


@FUZZ_SETTINGS
@given(body=RESPONSES)
def test_fuzzed_responses_bodies_never_5xx(http: httpx.Client, live: LiveServer, body: dict[str, Any]) -> None:
    _check(http, live, "/v1/responses", body)


@FUZZ_SETTINGS
@given(body=CONVERSATION, more=st.lists(ITEM, min_size=1, max_size=2) | INVALID)
def test_fuzzed_conversations_never_5xx(http: httpx.Client, live: LiveServer, body: dict[str, Any],
                                        more: Any) -> None:
    created = http.post("/v1/conversations", json=body)
    assert created.status_code < 500, (body, created.text)
    if created.status_code == 200:
        conv = created.json()["id"]
        added = http.post(f"/v1/conversations/{conv}/items", json={"items": more})
        assert added.status_code < 500, (more, added.text)
        _check(http, live, "/v1/responses", {"model": "tiny", "input": "x", "max_output_tokens": 2,
                                             "conversation": conv})


def test_server_is_ready_after_fuzzing(http: httpx.Client, live: LiveServer) -> None:
    assert http.get("/ready").status_code == 200
    wait_until(lambda: live.state.admission.num_in_flight == 0, what="fuzzed background responses to end")
