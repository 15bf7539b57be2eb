"""Drives sessions against one target: each session starts at its arrival time, sends its turns
one after another (a turn waits for the previous reply, plus the think time), and at most
`max_concurrency` requests are in flight at once (vLLM's `--max-concurrency`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenmill.bench.client import Target, send_message
from tokenmill.bench.errors import BenchError
from tokenmill.bench.records import RequestRecord, failed
from tokenmill.bench.sessions import Api, Conversation, Session

CONNECT_TIMEOUT_S = 10.0


@dataclass(slots=True, frozen=True)
class RunSpec:
    api: Api
    sessions: Sequence[Session]
    offsets_s: Sequence[float]  # arrival time of each session
    think_time_s: float = 0.0
    max_concurrency: int | None = None
    ignore_eos: bool = True  # exact output lengths, so that targets do the same work
    temperature: float = 0.0
    extra_body: Mapping[str, Any] = field(default_factory=dict)  # more fields for every request (service_tier)


@dataclass(slots=True)
class RunOutcome:
    records: list[RequestRecord]
    duration_s: float
    started_unix: float


def make_client(timeout_s: float) -> httpx.AsyncClient:
    # No pool limit: the concurrency cap is ours to enforce, not the connection pool's.
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def run_sessions(client: httpx.AsyncClient, target: Target, spec: RunSpec) -> RunOutcome:
    if len(spec.offsets_s) != len(spec.sessions):
        raise BenchError(f"{len(spec.sessions)} sessions but {len(spec.offsets_s)} arrival times")
    num_requests = sum(len(session.turns) for session in spec.sessions)
    gate = asyncio.Semaphore(spec.max_concurrency or max(num_requests, 1))
    started_unix, run_start = time.time(), time.perf_counter()
    per_session = await asyncio.gather(*(
        _run_session(client, target, spec, index, run_start, gate) for index in range(len(spec.sessions))))
    duration_s = time.perf_counter() - run_start
    return RunOutcome([record for records in per_session for record in records], duration_s, started_unix)


async def _run_session(client: httpx.AsyncClient, target: Target, spec: RunSpec, index: int, run_start: float,
                       gate: asyncio.Semaphore) -> list[RequestRecord]:
    session = spec.sessions[index]
    await asyncio.sleep(max(0.0, run_start + spec.offsets_s[index] - time.perf_counter()))
    conversation = Conversation(session)
    records: list[RequestRecord] = []
    for turn_index, turn in enumerate(session.turns):
        if records and not records[-1].is_success:
            # The conversation cannot go on without the reply; the turns still count as failures.
            records.append(failed(index, turn_index, "skipped", "an earlier turn of this session failed"))
            continue
        if turn_index > 0 and spec.think_time_s > 0:
            await asyncio.sleep(spec.think_time_s)
        conversation.ask(turn)
        record = RequestRecord(index, turn_index, prompt_tokens=conversation.prompt_tokens_estimate(turn_index))
        async with gate:
            reply, calls = await send_message(client, target, spec.api,
                                              _payload(spec, conversation, turn.max_tokens), record, run_start)
        conversation.answer(reply, calls)
        records.append(record)
    return records


def _payload(spec: RunSpec, conversation: Conversation, max_tokens: int) -> dict[str, Any]:
    payload = {**conversation.payload(spec.api), **spec.extra_body, "max_tokens": max_tokens,
               "temperature": spec.temperature}
    if spec.ignore_eos:
        payload["ignore_eos"] = True  # vLLM, tokenmill and llama.cpp all read it
    return payload
