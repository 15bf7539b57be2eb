"""Local replicas: the autoscaler's arithmetic on stand-in processes, and the whole path (spawn, probe,
admit, die, replace, drain on shutdown) with fake replicas run as subprocesses."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import httpx

from tests.gateway.conftest import fast_config, start_gateway, wait_ready
from tests.gateway.fakes import wait_until
from tokenmill.gateway.app import Gateway
from tokenmill.gateway.autoscaler import Autoscaler
from tokenmill.gateway.config import AutoscaleConfig, BreakerConfig, LocalReplicaConfig
from tokenmill.gateway.local import LocalLauncher
from tokenmill.gateway.metrics import GatewayMetrics
from tokenmill.gateway.replica import Lifecycle
from tokenmill.gateway.replica_set import ReplicaSet

FAKES = Path(__file__).with_name("fake_serve.py")
REPLACED = "tokenmill:gateway_replicas_replaced_total"


class SleepLauncher(LocalLauncher):
    """Processes that only exist (no HTTP): enough for the autoscaler's bookkeeping."""

    def command(self, port: int) -> list[str]:
        return ["sleep", "60"]


class FakeServeLauncher(LocalLauncher):
    """Runs fake_serve.py in place of `tokenmill serve`: a replica ready in a blink."""

    def command(self, port: int) -> list[str]:
        return [sys.executable, str(FAKES), "--port", str(port)]


def test_autoscaler_keeps_a_warm_buffer_replaces_the_dead_and_drains_down() -> None:
    async def scenario() -> None:
        replicas, metrics = ReplicaSet(), GatewayMetrics()
        config = AutoscaleConfig(min_replicas=1, max_replicas=4, warm_replicas=1, target_load_per_replica=2,
                                 scale_down_delay_s=0.0)
        scaler = Autoscaler(replicas, SleepLauncher(LocalReplicaConfig("m", drain_timeout_s=1)), config,
                            BreakerConfig(), metrics)
        try:
            scaler.tick()
            assert len(replicas) == 2  # idle: the floor (min 1) + 1 warm
            first = next(iter(replicas))
            first.num_outstanding = 5  # ceil(5 / 2) = 3 busy + 1 warm
            scaler.tick()
            assert len(replicas) == 4
            victim = list(replicas)[1]
            assert victim.process is not None
            victim.process.signal(signal.SIGKILL)
            wait_until(victim.process.has_exited, what="the kill")
            scaler.tick()  # reaped and replaced in one tick
            assert victim not in list(replicas) and len(replicas) == 4
            assert metrics.registry.get_sample_value(REPLACED) == 1
            first.num_outstanding = 0
            for _ in range(4):  # one drain per tick (delay 0) down to the floor
                scaler.tick()
                await asyncio.sleep(0)
            assert sum(r.is_live for r in replicas) == 2
        finally:
            await scaler.stop_all()
        assert all(r.lifecycle is Lifecycle.GONE for r in replicas) and len(replicas) == 0

    asyncio.run(scenario())


def test_local_replicas_start_concurrently_serve_and_are_replaced_and_drained(tmp_path: Path) -> None:
    local = LocalReplicaConfig("fake-model", log_dir=str(tmp_path), drain_timeout_s=2)
    config = fast_config(backends=(), local=local, initial_replicas=2)
    live = start_gateway(config, Gateway(config, FakeServeLauncher(local)))
    try:
        wait_ready(live, 2, timeout_s=60)
        assert httpx.post(f"{live.url}/v1/completions", json={"prompt": "hi"}).status_code == 200
        first = next(iter(live.gateway.replicas))
        assert first.ready_after_s is not None and first.process is not None
        os.kill(first.process.pid, signal.SIGKILL)
        wait_until(lambda: live.sample(REPLACED) == 1, timeout_s=10, what="replacement")
        wait_ready(live, 2, timeout_s=60)
        assert first not in list(live.gateway.replicas)
        processes = [r.process for r in live.gateway.replicas if r.process is not None]
    finally:
        live.stop()
    assert all(process.has_exited() for process in processes)  # drained (SIGTERM) on shutdown
    assert len(list(tmp_path.glob("replica-*.log"))) == 3
