"""Plain stats dataclasses the engine emits; the server turns them into Prometheus metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepStats:
    num_running: int
    num_waiting: int
    num_scheduled_tokens: int
    num_preempted: int
    kv_usage: float  # fraction of KV blocks held by requests
    prefix_cache_queries: int  # cumulative tokens looked up
    prefix_cache_hits: int  # cumulative tokens found
    step_time_s: float
