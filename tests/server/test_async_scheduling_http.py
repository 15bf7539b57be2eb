"""A server with asynchronous scheduling on (engine/pipeline.py), through the official `openai` client:
concurrent streams, stop strings that end a request whose next step was already scheduled, logprobs,
and penalties (which force synchronous steps) give what the synchronous server gives."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.server.conftest import MODEL, LiveServer, start_server, tiny_engine_config
from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine

PROMPTS = [f"Story number {i}: once" for i in range(16)]


def _params(i: int, stop: str | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": 8 + i % 12, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    if stop is not None:
        params["stop"] = [stop]  # text-level: the output processor aborts the request mid-pipeline
    if i % 8 == 2:
        params["logprobs"] = 2  # reads no history: overlaps
    if i % 8 == 6:
        params["frequency_penalty"] = 1.5  # needs its tokens on the host: the engine steps synchronously meanwhile
    return params


@pytest.fixture(scope="module")
def async_live(tiny_model_dir: Path) -> Iterator[LiveServer]:
    config = tiny_engine_config(tiny_model_dir)
    config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, async_scheduling="on"))
    engine = AsyncEngine.from_config(config)
    assert engine.core.pipeline is not None
    server = start_server(engine, ServerConfig(served_model_name=MODEL))
    yield server
    server.stop()
    engine.shutdown()


async def _stream(client: openai.AsyncOpenAI, i: int, stop: str | None) -> tuple[str, str | None]:
    stream = await client.completions.create(model=MODEL, prompt=PROMPTS[i], stream=True, **_params(i, stop))
    text, reason = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def _all_at_once(server: LiveServer, stops: list[str | None]) -> list[tuple[str, str | None]]:
    async def run() -> list[tuple[str, str | None]]:
        async with server.async_client() as client:
            return await asyncio.gather(*[_stream(client, i, stop) for i, stop in enumerate(stops)])
    return asyncio.run(run())


def test_streams_equal_the_synchronous_server(async_live: LiveServer, live: LiveServer) -> None:
    free = _all_at_once(live, [None] * len(PROMPTS))
    # Every fourth request stops at a piece of the text it writes unstopped, a little past its middle.
    stops = [text[len(text) // 2:len(text) // 2 + 3] if i % 4 == 1 and len(text) > 8 else None
             for i, (text, _) in enumerate(free)]
    expected = _all_at_once(live, stops)
    assert sum(reason == "stop" for _, reason in expected) >= 2
    assert _all_at_once(async_live, stops) == expected
    assert async_live.engine.num_in_flight == 0
    core = async_live.engine.core
    assert core.pipeline is not None and core.pipeline.in_flight is None
    assert core.kv.pool.num_free == core.kv.num_blocks
