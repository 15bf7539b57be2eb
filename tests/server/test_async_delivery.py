"""What AsyncEngine hands a consumer: every step's output, or only the first and the final one."""

from __future__ import annotations

import asyncio

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.request import SamplingParams


async def _collect(engine: AsyncEngine, every_output: bool) -> list[RequestOutput]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return [o async for o in engine.generate([5, 6, 7, 8], params, every_output=every_output)]


def test_a_final_only_consumer_gets_the_first_and_last_outputs_with_the_same_answer(tiny_engine: AsyncEngine) -> None:
    every = asyncio.run(_collect(tiny_engine, every_output=True))
    final_only = asyncio.run(_collect(tiny_engine, every_output=False))
    assert len(every) == 6  # one a step (one token a step: no speculation here)
    assert len(final_only) == 2 and not final_only[0].finished and final_only[1].finished
    first, last = final_only
    assert first.outputs[0].token_ids == every[0].outputs[0].token_ids
    assert last.outputs[0].token_ids == every[-1].outputs[0].token_ids
    assert last.outputs[0].text == every[-1].outputs[0].text and last.metrics is not None


def test_a_coalesced_stream_carries_every_held_delta_into_the_next_chunk(tiny_engine: AsyncEngine) -> None:
    async def run(interval_s: float) -> list[RequestOutput]:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        return [o async for o in tiny_engine.generate([5, 6, 7, 8], params, min_interval_s=interval_s)]

    every, coalesced = asyncio.run(run(0.0)), asyncio.run(run(60.0))
    assert len(every) == 6 and len(coalesced) == 2  # the first token at once, the rest with the finish
    text = every[-1].outputs[0].text
    assert "".join(o.outputs[0].text_delta for o in coalesced) == text == coalesced[-1].outputs[0].text
    assert sum(o.outputs[0].num_new_tokens for o in coalesced) == 6
    assert coalesced[-1].outputs[0].token_ids == every[-1].outputs[0].token_ids
