"""Client-side load for the slow gateway tests: concurrent requests through the gateway, streaming or
not, each ending in a `Result` that says whether it succeeded and whether tokens had reached it."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from tests.gateway.fakes import wait_until
from tokenmill.gateway.replica import EngineLoad, parse_engine_load


@dataclass
class Result:
    is_stream: bool
    status: int | None = None
    num_token_events: int = 0
    saw_done: bool = False
    saw_error: bool = False
    ttft_s: float | None = None
    transport_error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and (not self.is_stream or (self.saw_done and not self.saw_error))

    @property
    def started_streaming(self) -> bool:
        return self.num_token_events > 0


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Result:
    is_stream = bool(body.get("stream"))
    result = Result(is_stream)
    started = time.monotonic()
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    try:
        async with client.stream("POST", url + path, json=body) as response:
            result.status = response.status_code
            if not is_stream or response.status_code != 200:
                await response.aread()
                result.ttft_s = time.monotonic() - started
                return result
            async for line in response.aiter_lines():
                _note_event(result, line.removeprefix("data: "), started)
    except httpx.HTTPError as exc:
        result.transport_error = f"{type(exc).__name__}: {exc}"
    return result


def _note_event(result: Result, data: str, started: float) -> None:
    if not data:
        return
    if data == "[DONE]":
        result.saw_done = True
        return
    payload = json.loads(data)
    if "error" in payload:
        result.saw_error = True
        return
    choice = payload["choices"][0]
    if choice.get("text") or (choice.get("delta") or {}).get("content"):
        result.num_token_events += 1
        if result.ttft_s is None:
            result.ttft_s = time.monotonic() - started


async def run_load(url: str, bodies: Sequence[dict[str, Any]], concurrency: int,
                   on_done: Callable[[int], None] | None = None) -> list[Result]:
    """Send every body with at most `concurrency` in flight; `on_done(n)` after each of them finishes."""
    queue = list(enumerate(bodies))
    results: list[Result | None] = [None] * len(bodies)
    num_done = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal num_done
        while queue:
            index, body = queue.pop(0)
            results[index] = await send(client, url, body)
            num_done += 1
            if on_done is not None:
                on_done(num_done)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return [r for r in results if r is not None]


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else float("nan")


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def engine_loads(urls: Sequence[str]) -> list[EngineLoad]:
    return [parse_engine_load(httpx.get(f"{url}/metrics", timeout=10).text) for url in urls]


def wait_http_ready(url: str, timeout_s: float) -> None:
    def ready() -> bool:
        try:
            return httpx.get(f"{url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, timeout_s, what=f"{url} to be ready")
