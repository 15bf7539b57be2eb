"""Slow: the gateway over real local `tokenmill serve` replicas of a tiny model.

- chaos: steady mixed load, one replica SIGKILLed mid-run; nothing that had not started streaming
  fails, mid-stream failures end with an error event and are counted, the replica is replaced.
- warm buffer: TTFT before and after a step up in load, with one warm idle replica vs none.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import pytest

from tests.gateway.conftest import TINY_SERVE_ARGS, LiveGateway, wait_ready
from tests.gateway.fakes import wait_until
from tests.gateway.load import Result, median, percentile, run_load
from tokenmill.gateway.config import AutoscaleConfig
from tokenmill.gateway.replica import Lifecycle

pytestmark = pytest.mark.slow

REPLACED = "tokenmill:gateway_replicas_replaced_total"


def mixed_bodies(num: int) -> list[dict[str, object]]:
    """Half streaming (long, so some are mid-way when the kill comes); completions and chat; greedy,
    EOS ignored so every request runs its length."""
    bodies: list[dict[str, object]] = []
    for i in range(num):
        is_stream = i % 2 == 0
        body: dict[str, object] = {"max_tokens": 96 if is_stream else 24, "ignore_eos": True, "temperature": 0.0,
                                   "stream": is_stream}
        if i % 4 < 2:
            body["prompt"] = f"request {i}: the quick brown fox jumps over the lazy dog"
        else:
            body["messages"] = [{"role": "user", "content": f"request {i}: tell me about foxes"}]
        bodies.append(body)
    return bodies


def kill_busiest(live: LiveGateway) -> int:
    serving = [r for r in live.gateway.replicas if r.lifecycle is Lifecycle.SERVING and r.process is not None]
    victim = max(serving, key=lambda r: r.num_outstanding)
    assert victim.process is not None
    os.kill(victim.process.pid, signal.SIGKILL)
    return victim.num_outstanding


def test_chaos_sigkill_one_of_three_replicas_under_load(local_gateway: Callable[..., LiveGateway]) -> None:
    live = local_gateway(3)
    wait_ready(live, 3, timeout_s=180)
    bodies = mixed_bodies(300)
    killed: list[int] = []

    def on_done(num_done: int) -> None:
        if num_done == 100 and not killed:
            killed.append(kill_busiest(live))

    started = time.monotonic()
    results = asyncio.run(run_load(live.url, bodies, concurrency=12, on_done=on_done))
    elapsed_s = time.monotonic() - started
    report_chaos(results, killed, elapsed_s, live)
    not_started = [r for r in results if not r.started_streaming]
    assert [r for r in not_started if not r.ok] == []  # 0 failures among requests that had not streamed
    midstream = [r for r in results if not r.ok]
    assert all(r.is_stream and r.started_streaming and r.saw_error and r.saw_done for r in midstream)
    wait_until(lambda: live.metric("midstream_error") == len(midstream), timeout_s=5, what="counted failures")
    assert sum(r.ok for r in results) == len(bodies) - live.metric("midstream_error")
    assert live.sample(REPLACED) >= 1
    wait_ready(live, 3, timeout_s=180)  # the replacement is up


def report_chaos(results: list[Result], killed: list[int], elapsed_s: float, live: LiveGateway) -> None:
    num_ok = sum(r.ok for r in results)
    print(f"\nchaos: sent {len(results)}, ok {num_ok}, mid-stream failures {len(results) - num_ok} "
          f"(counted {live.metric('midstream_error'):.0f}), in flight on the killed replica {killed}, "
          f"retries {_total(live, 'tokenmill:gateway_retries'):.0f}, "
          f"replaced {live.sample(REPLACED):.0f}, {elapsed_s:.1f} s")


def _total(live: LiveGateway, name: str) -> float:
    return sum(sample.value for metric in live.gateway.metrics.registry.collect() for sample in metric.samples
               if sample.name == f"{name}_total")


def step_load_ttfts(live: LiveGateway, base: int, step: int, per_client: int) -> tuple[list[float], list[float]]:
    """TTFTs of streams under `base` concurrent clients, then right after stepping to `step` clients."""

    def bodies(num: int) -> list[dict[str, object]]:
        return [{"prompt": f"client {i}: once upon a time", "max_tokens": 48, "ignore_eos": True,
                 "stream": True} for i in range(num)]

    async def scenario() -> tuple[list[Result], list[Result]]:
        before = await run_load(live.url, bodies(base * per_client), concurrency=base)
        after = await run_load(live.url, bodies(step * per_client), concurrency=step)
        return before, after

    before, after = asyncio.run(scenario())
    assert all(r.ok for r in before + after)
    return [r.ttft_s or 0.0 for r in before], [r.ttft_s or 0.0 for r in after]


@pytest.mark.parametrize("warm", [1, 0])
def test_warm_buffer_absorbs_a_step_in_load(local_gateway: Callable[..., LiveGateway], warm: int) -> None:
    # A replica runs 4 requests at once (the rest queue): a step from 3 to 8 clients needs a second one.
    autoscale = AutoscaleConfig(min_replicas=1, max_replicas=3, warm_replicas=warm, target_load_per_replica=4,
                                interval_s=0.25, scale_down_delay_s=300)
    live = local_gateway(1, (*TINY_SERVE_ARGS, "--max-num-seqs", "4"), autoscale=autoscale)
    wait_ready(live, 1 + warm, timeout_s=180)
    cold_start_s = max(r.ready_after_s or 0.0 for r in live.gateway.replicas)
    before, after = step_load_ttfts(live, base=3, step=8, per_client=4)
    print(f"\nwarm={warm}: cold start {cold_start_s:.1f} s; TTFT before the step p50 {median(before):.3f} s "
          f"p90 {percentile(before, 0.9):.3f} s; after p50 {median(after):.3f} s p90 {percentile(after, 0.9):.3f} s"
          f" (max {max(after):.3f} s); replicas now {len(live.gateway.replicas)}")
    if warm:
        assert max(after) < cold_start_s  # no request waited for a replica to load
