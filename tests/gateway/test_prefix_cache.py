"""Slow: prefix-cache hit rate of an agent workload over 3 real replicas, round-robin vs prefix affinity.

Eight agents, each with its own system prompt, take turns (turn-major, as agent loops interleave);
each turn's prompt is the system prompt plus the whole conversation so far. A replica's KV pool
(64 blocks of 16 tokens) holds about four agents' prefixes: with round-robin every replica sees
all eight and LRU evicts what the next turn needs; with affinity each replica keeps its own agents.
The hit rate is read from the replicas' own /metrics (tokens served from cache / tokens looked up).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from tests.gateway.conftest import TINY_SERVE_ARGS, LiveGateway, fast_config, start_gateway, wait_ready
from tests.gateway.load import engine_loads, run_load
from tokenmill.gateway.replica import EngineLoad

pytestmark = pytest.mark.slow

NUM_AGENTS, NUM_TURNS = 8, 6  # 8, not a multiple of 3: round-robin must not pin agents by accident
PREFIX_CHARS = 64  # within every system prompt: the key names the agent, not its latest turn
WORDS = ("search", "file", "read", "plan", "tool", "result", "error", "retry", "patch", "test", "build", "log")


def agent_bodies(seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    systems = [f"agent {seed}-{a}: " + " ".join(rng.choice(WORDS) for _ in range(20)) for a in range(NUM_AGENTS)]
    histories = ["" for _ in range(NUM_AGENTS)]
    bodies = []
    for _ in range(NUM_TURNS):
        for agent in range(NUM_AGENTS):
            histories[agent] += " obs: " + " ".join(rng.choice(WORDS) for _ in range(2))
            bodies.append({"prompt": systems[agent] + histories[agent], "max_tokens": 4, "temperature": 0.0})
    return bodies


def hit_rate(before: Sequence[EngineLoad], after: Sequence[EngineLoad]) -> float:
    hits = sum(b.prefix_cache_hits - a.prefix_cache_hits for a, b in zip(before, after, strict=True))
    queries = sum(b.prefix_cache_queries - a.prefix_cache_queries for a, b in zip(before, after, strict=True))
    return hits / queries


def measure(live: LiveGateway, urls: list[str], seed: int) -> float:
    before = engine_loads(urls)
    results = asyncio.run(run_load(live.url, agent_bodies(seed), concurrency=3))
    assert all(r.ok for r in results)
    return hit_rate(before, engine_loads(urls))


def test_prefix_affinity_raises_the_prefix_cache_hit_rate(local_gateway: Callable[..., LiveGateway]) -> None:
    serve_args = tuple(a if a != "128" else "64" for a in TINY_SERVE_ARGS)  # --num-kv-blocks 64
    assert "64" in serve_args
    round_robin = local_gateway(3, serve_args, policy="round_robin", affinity_prefix_chars=PREFIX_CHARS)
    wait_ready(round_robin, 3, timeout_s=180)
    urls = [replica.url for replica in round_robin.gateway.replicas]
    rr_rate = measure(round_robin, urls, seed=1)
    # Same replicas, a second gateway with affinity; new agents, so nothing is cached for them yet.
    affinity = start_gateway(fast_config(backends=tuple(urls), policy="prefix_affinity",
                                         affinity_prefix_chars=PREFIX_CHARS))
    try:
        wait_ready(affinity, 3)
        affinity_rate = measure(affinity, urls, seed=2)
        spills = affinity.sample("tokenmill:gateway_routing_decisions_total", policy="prefix_affinity",
                                 reason="spill")
    finally:
        affinity.stop()
    print(f"\nprefix cache hit rate, {NUM_AGENTS} agents x {NUM_TURNS} turns on 3 replicas: round-robin "
          f"{rr_rate:.1%}, prefix affinity {affinity_rate:.1%} ({spills:.0f} spills)")
    assert affinity_rate > rr_rate
