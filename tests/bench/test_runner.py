"""The session driver on a scripted server: the concurrency cap, arrival times, think time, and a
failed turn ending its session."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tokenmill.bench.client import Target
from tokenmill.bench.errors import BenchError
from tokenmill.bench.records import RequestRecord
from tokenmill.bench.runner import RunOutcome, RunSpec, run_sessions
from tokenmill.bench.sessions import Api, Session, Turn

REPLY_S = 0.05  # how long the scripted server takes over each request


class _Server:
    """Streams one token after REPLY_S; counts requests in flight (received, final chunk not yet
    sent); fails requests whose prompt says so."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.peak_in_flight = 0
        self.bodies: list[dict[str, Any]] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        if "FAIL" in json.dumps(body):
            return httpx.Response(500, json={"error": {"message": "scripted failure"}})
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return httpx.Response(200, stream=_Reply(self), headers={"content-type": "text/event-stream"})


class _Reply(httpx.AsyncByteStream):
    def __init__(self, server: _Server) -> None:
        self.server = server

    async def __aiter__(self) -> AsyncIterator[bytes]:
        await asyncio.sleep(REPLY_S)
        chunk = {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "length"}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
        yield f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(usage)}\n\n".encode()
        # Done before [DONE]: the client stops reading there and never resumes this generator.
        self.server.in_flight -= 1
        yield b"data: [DONE]\n\n"


def session(*contents: str) -> Session:
    return Session(tuple(Turn(text, 1, 1) for text in contents))


def drive(spec: RunSpec) -> tuple[RunOutcome, _Server]:
    server = _Server()

    async def go() -> RunOutcome:
        async with httpx.AsyncClient(transport=httpx.MockTransport(server.handler)) as client:
            return await run_sessions(client, Target("http://x", "m"), spec)

    return asyncio.run(go()), server


def by_position(outcome: RunOutcome) -> dict[tuple[int, int], RequestRecord]:
    return {(r.session_index, r.turn_index): r for r in outcome.records}


def test_max_concurrency_caps_requests_in_flight() -> None:
    sessions = [session(f"q{i}") for i in range(8)]
    outcome, server = drive(RunSpec(Api.CHAT, sessions, [0.0] * 8, max_concurrency=3))
    assert server.peak_in_flight == 3
    assert all(r.is_success for r in outcome.records) and len(outcome.records) == 8
    assert outcome.duration_s >= 3 * REPLY_S  # ceil(8 / 3) waves of one reply each
    uncapped, server = drive(RunSpec(Api.CHAT, sessions, [0.0] * 8))
    assert server.peak_in_flight == 8 and uncapped.duration_s < 3 * REPLY_S


def test_sessions_start_at_their_arrival_times() -> None:
    offsets = [0.0, 0.1, 0.2]
    outcome, _ = drive(RunSpec(Api.COMPLETIONS, [session("a"), session("b"), session("c")], offsets))
    starts = [by_position(outcome)[(i, 0)].start_s for i in range(3)]
    for start, offset in zip(starts, offsets, strict=True):
        assert start is not None and offset <= start < offset + 0.05


def test_turns_wait_for_the_reply_and_the_think_time() -> None:
    outcome, server = drive(RunSpec(Api.CHAT, [session("first", "second")], [0.0], think_time_s=0.1))
    first, second = by_position(outcome)[(0, 0)], by_position(outcome)[(0, 1)]
    assert first.end_s is not None and second.start_s is not None
    assert second.start_s >= first.end_s + 0.1
    roles = [m["role"] for m in server.bodies[1]["messages"]]
    assert roles == ["user", "assistant", "user"]  # the second turn carries the first reply
    assert all(body["ignore_eos"] is True and body["temperature"] == 0.0 for body in server.bodies)


def test_a_failed_turn_skips_the_rest_of_its_session() -> None:
    outcome, server = drive(RunSpec(Api.CHAT, [session("FAIL", "never sent", "nor this"), session("fine")],
                                    [0.0, 0.0]))
    records = by_position(outcome)
    assert records[(0, 0)].error_kind == "http_500"
    assert [records[(0, i)].error_kind for i in (1, 2)] == ["skipped", "skipped"]
    assert records[(1, 0)].is_success and len(server.bodies) == 2


def test_offsets_must_match_sessions() -> None:
    with pytest.raises(BenchError, match="2 sessions but 1 arrival times"):
        drive(RunSpec(Api.CHAT, [session("a"), session("b")], [0.0]))
