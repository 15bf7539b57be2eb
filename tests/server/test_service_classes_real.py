"""Service classes on the real default model (needs `tokenmill pull smollm2-135m`): slow.

A batch job fills every sequence slot; chat requests arriving meanwhile are served at once
(they do not wait for a slot behind the batch), every batch request still finishes in full, and
the per-class metrics show both classes ran. Through the official openai client.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import LiveServer, start_server, wait_until
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.errors import ModelNotInstalledError

MODEL = "smollm2-135m"
MAX_NUM_SEQS = 4
NUM_BATCH = 8
BATCH_TOKENS = 48
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real() -> Iterator[LiveServer]:
    try:
        engine = AsyncEngine.from_config(EngineConfig(ModelConfig(MODEL), CacheConfig(num_blocks=256),
                                                      SchedulerConfig(max_num_seqs=MAX_NUM_SEQS)))
    except ModelNotInstalledError:
        pytest.skip(f"{MODEL} is not installed: run `tokenmill pull {MODEL}`")
    server = start_server(engine, ServerConfig(served_model_name=MODEL))
    yield server
    server.stop()
    engine.shutdown()


def _class_series(live: LiveServer, name: str, service_class: str) -> float:
    text = httpx.get(f"{live.url}/metrics").text
    pattern = rf'tokenmill:{name}\{{[^}}]*service_class="{service_class}"[^}}]*\}} (\S+)'
    return sum(float(v) for v in re.findall(pattern, text))


def _batch(client: openai.OpenAI, index: int) -> Any:
    return client.completions.create(model=MODEL, prompt=f"Item {index}: write a long story about a lighthouse.",
                                     max_tokens=BATCH_TOKENS, temperature=0.0,
                                     extra_body={"ignore_eos": True, "service_tier": "flex"})


def _chat(client: openai.OpenAI) -> tuple[Any, float]:
    create: Any = client.chat.completions.create
    started = time.monotonic()
    reply = create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                   max_tokens=8, temperature=0.0, service_tier="priority")
    return reply, time.monotonic() - started


def test_chat_is_served_while_a_batch_job_fills_every_slot_and_the_batch_still_finishes(real: LiveServer) -> None:
    client = real.client()
    before = {c: _class_series(real, "service_class_generation_tokens_total", c) for c in ("interactive", "batch")}
    with ThreadPoolExecutor(NUM_BATCH + 2) as pool:
        batch = [pool.submit(_batch, client, i) for i in range(NUM_BATCH)]
        wait_until(lambda: _class_series(real, "service_class_num_requests_running", "batch") == MAX_NUM_SEQS,
                   timeout_s=60, what="the batch job to fill every slot")
        chats = [_chat(client) for _ in range(2)]  # one after another, while the batch runs
        still_running = sum(not f.done() for f in batch)
        results = [f.result(timeout=300) for f in batch]
    assert still_running > 0, "the batch job ended before the chat requests: the test proved nothing"
    for reply, _ in chats:
        assert reply.service_tier == "interactive" and "Paris" in (reply.choices[0].message.content or "")
        timings = (reply.model_extra or {})["tokenmill"]["timings"][0]
        # Admitted at once, not after a batch request freed a slot (each takes ~BATCH_TOKENS steps).
        assert timings["queue_s"] < 1.0
    assert all(r.usage.completion_tokens == BATCH_TOKENS and r.model_extra["service_tier"] == "batch"
               for r in results)
    wait_until(lambda: _class_series(real, "service_class_generation_tokens_total", "batch")
               == before["batch"] + NUM_BATCH * BATCH_TOKENS, what="the batch tokens counted")
    assert _class_series(real, "service_class_generation_tokens_total", "interactive") > before["interactive"]
    assert _class_series(real, "slo_requests_total", "interactive") >= 2


def test_bad_service_tier_is_an_openai_400(real: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        create: Any = real.client().chat.completions.create
        create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, service_tier="scale")
    body: Any = caught.value.body
    assert (body["param"], body["type"]) == ("service_tier", "invalid_request_error")
