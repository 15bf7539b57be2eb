"""Failure behaviour: client disconnects, engine crashes, overload. Nothing hangs, nothing leaks.

The engine's `fault_injector` runs on the engine thread before every step: tests make it sleep
(slow engine, so a request is surely still running), block on an event (paused engine, so
requests pile up in the admission queue), or raise (a crash inside the engine loop).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL, NUM_KV_BLOCKS, LiveServer, start_server, wait_until
from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.request import FinishReason

LONG: dict[str, Any] = {"prompt": "hello", "max_tokens": 250, "ignore_eos": True}  # ≥ 12.5 s on a slowed engine


@contextmanager
def slowed(engine: AsyncEngine, step_s: float = 0.05) -> Iterator[None]:
    engine.fault_injector = lambda: time.sleep(step_s)
    try:
        yield
    finally:
        engine.fault_injector = None


@contextmanager
def paused(engine: AsyncEngine) -> Iterator[threading.Event]:
    gate = threading.Event()

    def wait_for_gate() -> None:
        gate.wait(timeout=60)  # bounded: a failing test must not wedge the engine thread forever

    engine.fault_injector = wait_for_gate
    try:
        yield gate
    finally:
        gate.set()
        engine.fault_injector = None


@contextmanager
def crashing(engine: AsyncEngine, after_steps: int = 0) -> Iterator[None]:
    steps = itertools.count()

    def inject() -> None:
        if next(steps) >= after_steps:
            raise RuntimeError("injected fault")

    engine.fault_injector = inject
    try:
        yield
    finally:
        engine.fault_injector = None


def _is_idle(engine: AsyncEngine) -> bool:
    return engine.num_in_flight == 0 and engine.core.kv.pool.num_free == NUM_KV_BLOCKS


def _data_lines(response: httpx.Response) -> Iterator[str]:
    for line in response.iter_lines():
        assert line == "" or line.startswith("data: "), line  # SSE holds only data lines
        if line:
            yield line.removeprefix("data: ")


def _counter(live: LiveServer, name: str) -> float:
    text = httpx.get(f"{live.url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


# -------------------------------------------------------------------------- disconnect


def test_stream_disconnect_aborts_and_frees_kv_blocks(live: LiveServer) -> None:
    engine = live.engine
    wait_until(lambda: _is_idle(engine), what="an idle engine")
    with slowed(engine):
        with httpx.stream("POST", f"{live.url}/v1/completions", json={**LONG, "stream": True}, timeout=30) as response:
            lines = _data_lines(response)  # held: a discarded line iterator closes the connection
            next(lines)
            assert engine.num_in_flight == 1 and engine.core.kv.pool.num_free < NUM_KV_BLOCKS
        # Still slowed: the request could not have finished on its own within the wait (a loaded
        # 2-core CI machine needs seconds to notice the disconnect, hence not less).
        wait_until(lambda: _is_idle(engine), timeout_s=8, what="the blocks to return")
    assert live.state.admission.num_in_flight == 0


def test_plain_request_disconnect_aborts_too(live: LiveServer) -> None:
    engine = live.engine
    wait_until(lambda: _is_idle(engine), what="an idle engine")
    with slowed(engine):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.url}/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=0.5))
        wait_until(lambda: _is_idle(engine), timeout_s=8, what="the blocks to return")
    assert live.state.admission.num_in_flight == 0


def _metric(live: LiveServer, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{live.url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"{name} {labels} is not exposed")


def test_gauges_fall_to_zero_and_every_abort_counts_when_clients_leave(live: LiveServer) -> None:
    """24 streams dropped after their first token: once the engine idles (no step runs any
    more), /metrics must say nothing runs and no KV is held, and count 24 aborts.

    One of the 24 ran to max_tokens in three CI runs of a week (never in 40 loaded rounds here): a second
    round then decides, and the first one's diagnosis (which engine request, when its client had left) is a
    warning in the CI output. A leaving that goes unnoticed every time fails."""
    leak = _clients_leave(live)
    if leak is None:
        return
    warnings.warn(f"a client's leaving went unnoticed once (retried): {leak}", stacklevel=1)
    leak = _clients_leave(live)
    assert leak is None, leak


def _clients_leave(live: LiveServer) -> str | None:
    """One round; None when every stream was aborted, else what ran out (the engine is idle again after)."""
    engine = live.engine
    num_clients = 24
    wait_until(lambda: _is_idle(engine), what="an idle engine")
    aborts_before = _metric(live, "tokenmill:request_success_total", finished_reason="abort")
    lengths_before = _metric(live, "tokenmill:request_success_total", finished_reason="length")

    left_at: dict[str, float] = {}  # response id -> when its client left, to name a leak should one happen
    finished: list[RequestOutput] = []
    engine.add_stats_listener(lambda _, outputs: finished.extend(outputs) if recording else None)
    recording = True

    async def first_token_then_leave(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", f"{live.url}/v1/completions", json={**LONG, "stream": True}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    left_at[json.loads(line.removeprefix("data: "))["id"]] = time.monotonic()
                    return

    async def clients() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.gather(*(first_token_then_leave(client) for _ in range(num_clients)))

    # No request can finish on its own meanwhile: 250 tokens at 0.1 s a step take 25 s, longer than the wait
    # for idle below (at 0.05 s, 12.5 s: a loaded CI run once saw one request run out, 23 aborts of 24)
    with slowed(engine, step_s=0.1):
        asyncio.run(clients())
        wait_until(lambda: _is_idle(engine), timeout_s=20, what="the blocks to return")
        wait_until(lambda: _metric(live, "tokenmill:num_requests_running") == 0, timeout_s=5,
                   what="num_requests_running to fall to 0 with the engine idle")
    assert _metric(live, "tokenmill:num_requests_waiting") == 0
    assert _metric(live, "tokenmill:kv_cache_usage_perc") == 0
    recording = False
    ran_out = _metric(live, "tokenmill:request_success_total", finished_reason="length") - lengths_before
    if ran_out:
        leaks = [(o.request_id, o.metrics, left_at.get(o.request_id.rsplit("-", 1)[0])) for o in finished
                 if o.outputs[0].finish_reason is not FinishReason.ABORT]
        return (f"{ran_out} request(s) ran to max_tokens: {leaks} "
                f"(clients left at: {sorted(left_at.items(), key=lambda kv: kv[1])})")
    assert _metric(live, "tokenmill:request_success_total", finished_reason="abort") - aborts_before == num_clients
    return None


# ------------------------------------------------------------------------------ crashes


def test_engine_crash_is_a_500_and_readiness_recovers(live: LiveServer, client: openai.OpenAI) -> None:
    restarts = live.engine.num_restarts
    with crashing(live.engine):
        with pytest.raises(openai.InternalServerError, match="engine failed"):
            client.completions.create(model=MODEL, prompt="hello", max_tokens=5)
        assert httpx.get(f"{live.url}/ready").status_code == 503  # at once, not at the next probe
    wait_until(lambda: httpx.get(f"{live.url}/ready").status_code == 200, what="readiness to recover")
    assert live.engine.num_restarts > restarts
    assert _counter(live, "tokenmill:engine_restarts_total") >= 1
    assert client.completions.create(model=MODEL, prompt="hello", max_tokens=3).choices[0].finish_reason


def test_engine_crash_mid_stream_ends_with_an_error_event_then_done(live: LiveServer) -> None:
    body = {**LONG, "max_tokens": 50, "n": 3, "stream": True}
    with crashing(live.engine, after_steps=4), \
            httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        events = list(_data_lines(response))
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "engine failed" in error["message"]
    assert any("choices" in json.loads(e) for e in events[:-2])  # it had started streaming
    wait_until(lambda: httpx.get(f"{live.url}/ready").status_code == 200, what="readiness to recover")
    wait_until(lambda: _is_idle(live.engine), what="an idle engine")


# ----------------------------------------------------------------------------- overload


@pytest.fixture(scope="module")
def small_queue(tiny_engine: AsyncEngine) -> Iterator[LiveServer]:
    # No interactive reserve: these completions (standard class) may fill the whole queue.
    config = ServerConfig(served_model_name=MODEL, max_queue_requests=2, max_queue_tokens=64, retry_after_s=2,
                          interactive_queue_reserve=0.0)
    server = start_server(tiny_engine, config)
    yield server
    server.stop()


def test_overload_is_429_with_retry_after_and_no_admitted_request_is_lost(small_queue: LiveServer) -> None:
    url = f"{small_queue.url}/v1/completions"
    body = {"prompt": "hello", "max_tokens": 5, "ignore_eos": True}
    rejected_before = _counter(small_queue, "tokenmill:requests_rejected_total")
    with paused(small_queue.engine) as gate, ThreadPoolExecutor(2) as pool:
        admitted = [pool.submit(httpx.post, url, json=body, timeout=60) for _ in range(2)]
        wait_until(lambda: small_queue.state.admission.num_waiting_requests == 2, what="two waiting requests")
        refused = httpx.post(url, json=body)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "2"
        assert refused.json()["error"]["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            small_queue.client().completions.create(model=MODEL, prompt="hello", max_tokens=5)
        gate.set()
        results = [future.result() for future in admitted]
    assert [r.status_code for r in results] == [200, 200]
    assert all(r.json()["usage"]["completion_tokens"] == 5 for r in results)
    assert _counter(small_queue, "tokenmill:requests_rejected_total") == rejected_before + 2
    assert small_queue.state.admission.num_in_flight == 0


def test_queue_is_bounded_by_prompt_tokens_too(small_queue: LiveServer) -> None:
    url = f"{small_queue.url}/v1/completions"
    with paused(small_queue.engine) as gate, ThreadPoolExecutor(1) as pool:
        first = pool.submit(httpx.post, url, json={"prompt": [5] * 40, "max_tokens": 2}, timeout=60)
        wait_until(lambda: small_queue.state.admission.num_waiting_tokens == 40, what="40 waiting tokens")
        assert httpx.post(url, json={"prompt": [5] * 30, "max_tokens": 2}).status_code == 429
        # More than the whole queue holds: retrying cannot help, so it is a 400, not a 429.
        assert httpx.post(url, json={"prompt": [5] * 65, "max_tokens": 2}).status_code == 400
        gate.set()
        assert first.result().status_code == 200


def test_burst_every_request_is_answered_or_refused(small_queue: LiveServer) -> None:
    url = f"{small_queue.url}/v1/completions"
    body = {"prompt": "hello", "max_tokens": 8, "ignore_eos": True}
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda _: httpx.post(url, json=body, timeout=60), range(24)))
    statuses = [r.status_code for r in results]
    assert set(statuses) <= {200, 429} and 200 in statuses
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in results if r.status_code == 200)
    assert small_queue.state.admission.num_in_flight == 0
