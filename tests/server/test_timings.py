"""The `tokenmill` extension: each choice's exact phase times, on non-streamed bodies and on the
final usage chunk of a stream, readable through the official OpenAI client."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, LiveServer
from tokenmill.engine.outputs import RequestMetrics
from tokenmill.server.timings import phase_times

PHASES = ("queue_s", "prefill_s", "decode_s", "ttft_s", "e2e_s")


def check_timeline(timing: dict[str, Any], wall_s: float) -> None:
    assert set(timing) == {"index", *PHASES}
    assert all(isinstance(timing[p], float) and timing[p] >= 0 for p in PHASES), timing
    assert timing["ttft_s"] == pytest.approx(timing["queue_s"] + timing["prefill_s"], abs=1e-9)
    assert timing["e2e_s"] == pytest.approx(timing["ttft_s"] + timing["decode_s"], abs=1e-9)
    assert 0 < timing["e2e_s"] <= wall_s


def test_phase_times_follow_the_timeline() -> None:
    m = RequestMetrics(arrival=10.0, first_scheduled=10.5, first_token=11.25, finished=13.0)
    t = phase_times(3, m)
    assert (t.index, t.queue_s, t.prefill_s, t.decode_s, t.ttft_s, t.e2e_s) == (3, 0.5, 0.75, 1.75, 1.25, 3.0)
    stopped = phase_times(0, RequestMetrics(10.0, 10.5, 11.25, None), now=12.0)  # a stop string: not stamped
    assert (stopped.decode_s, stopped.e2e_s) == (0.75, 2.0)


def test_non_streamed_completion_and_chat_carry_one_timing_per_choice(live: LiveServer) -> None:
    response = httpx.post(f"{live.url}/v1/completions", timeout=30,
                          json={"prompt": "hi", "max_tokens": 4, "n": 2, "ignore_eos": True})
    wall_s = response.elapsed.total_seconds()
    timings = response.json()["tokenmill"]["timings"]
    assert [t["index"] for t in timings] == [0, 1]
    for timing in timings:
        check_timeline(timing, wall_s)
    chat = httpx.post(f"{live.url}/v1/chat/completions", timeout=30,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    (timing,) = chat.json()["tokenmill"]["timings"]
    check_timeline(timing, chat.elapsed.total_seconds())


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_carries_the_timings_on_its_usage_chunk_only(live: LiveServer, path: str) -> None:
    body: dict[str, Any] = {"max_tokens": 4, "ignore_eos": True, "stream": True}
    body |= {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    for include_usage in (True, False):
        with httpx.stream("POST", live.url + path, timeout=30,
                          json={**body, "stream_options": {"include_usage": include_usage}}) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        with_timings = [e for e in events if "tokenmill" in e]
        if not include_usage:
            assert with_timings == []
            continue
        assert with_timings == [events[-1]] and events[-1]["usage"]["completion_tokens"] == 4
        (timing,) = events[-1]["tokenmill"]["timings"]
        check_timeline(timing, response.elapsed.total_seconds())


def test_the_openai_client_keeps_the_extension(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert completion.model_extra is not None
    assert [t["index"] for t in completion.model_extra["tokenmill"]["timings"]] == [0]
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                            stream=True, stream_options={"include_usage": True})
    *_, last = list(stream)
    assert last.usage is not None and last.model_extra is not None and "timings" in last.model_extra["tokenmill"]
