"""Continuous batching must not change results: 32 concurrent greedy streams give the texts that
the same requests give one at a time."""

from __future__ import annotations

import asyncio

import openai

from tests.server.conftest import MODEL, LiveServer

NUM_STREAMS = 32
PROMPTS = [f"Story number {i}: once" for i in range(NUM_STREAMS)]
PARAMS = {"max_tokens": 24, "temperature": 0.0, "extra_body": {"ignore_eos": True}}


async def _stream_text(client: openai.AsyncOpenAI, prompt: str) -> str:
    stream = await client.completions.create(model=MODEL, prompt=prompt, stream=True, **PARAMS)  # type: ignore[call-overload]
    return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])


async def _all_at_once(live: LiveServer) -> list[str]:
    async with live.async_client() as client:
        return await asyncio.gather(*[_stream_text(client, p) for p in PROMPTS])


def test_concurrent_streams_match_one_by_one(live: LiveServer, client: openai.OpenAI) -> None:
    one_by_one = [client.completions.create(model=MODEL, prompt=p, **PARAMS).choices[0].text  # type: ignore[call-overload]
                  for p in PROMPTS]
    batch_sizes: list[int] = []
    recording = True
    live.engine.add_stats_listener(lambda stats, _: batch_sizes.append(stats.num_running) if recording else None)
    try:
        assert asyncio.run(_all_at_once(live)) == one_by_one
    finally:
        recording = False
    assert max(batch_sizes) >= NUM_STREAMS // 2  # they really shared the batch
    assert live.engine.num_in_flight == 0
