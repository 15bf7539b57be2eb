"""A live gateway on a free 127.0.0.1 port, in a thread, with test-sized timeouts (fast probes, short
ejections), in front of fake replicas (fakes.py) or, for the slow tests, real local replicas."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest
import uvicorn

from tests.gateway.fakes import FakeReplica, free_port, wait_until
from tokenmill.gateway.app import Gateway, make_server
from tokenmill.gateway.config import BreakerConfig, GatewayConfig, HealthConfig, LocalReplicaConfig, RetryConfig

FAST_HEALTH = HealthConfig(probe_interval_s=0.05, probe_timeout_s=0.5, connect_timeout_s=0.5, read_timeout_s=2.0)
FAST_RETRY = RetryConfig(max_attempts=3, backoff_base_s=0.01, backoff_max_s=0.05, wait_for_replica_s=2.0)
FAST_BREAKER = BreakerConfig(failure_threshold=2, open_s=0.3, max_open_s=1.0)


def fast_config(**overrides: object) -> GatewayConfig:
    base = GatewayConfig(port=free_port(), backends=("http://127.0.0.1:1",), health=FAST_HEALTH,
                         retry=FAST_RETRY, breaker=FAST_BREAKER, policy="round_robin")
    return replace(base, **overrides)  # type: ignore[arg-type]


@dataclass
class LiveGateway:
    server: uvicorn.Server
    thread: threading.Thread
    url: str
    gateway: Gateway

    def metric(self, outcome: str) -> float:
        return self.gateway.metrics.total(outcome)

    def sample(self, name: str, **labels: str) -> float:
        value = self.gateway.metrics.registry.get_sample_value(name, labels)
        return value or 0.0

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_gateway(config: GatewayConfig, gateway: Gateway | None = None) -> LiveGateway:
    gateway = gateway or Gateway(config)
    server = make_server(config, gateway=gateway, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), what="the gateway to start")
    assert thread.is_alive(), "the gateway failed to start"
    return LiveGateway(server, thread, f"http://127.0.0.1:{config.port}", gateway)


@pytest.fixture
def fakes() -> Iterator[Callable[[int], list[FakeReplica]]]:
    """`fakes(n)`: n fake replicas, started; all stopped after the test."""
    started: list[FakeReplica] = []

    def make(num: int) -> list[FakeReplica]:
        replicas = [FakeReplica(name=f"fake{len(started) + i}").start() for i in range(num)]
        started.extend(replicas)
        return replicas

    yield make
    for replica in started:
        replica.stop()


@pytest.fixture
def gateway_for() -> Iterator[Callable[..., LiveGateway]]:
    """`gateway_for([urls], **config)`: a live gateway over those backends; stopped after the test."""
    live: list[LiveGateway] = []

    def make(backends: list[str], **overrides: object) -> LiveGateway:
        live.append(start_gateway(fast_config(backends=tuple(backends), **overrides)))
        return live[-1]

    yield make
    for gateway in live:
        gateway.stop()


def wait_ready(gateway: LiveGateway, num_routable: int = 1, timeout_s: float = 10.0) -> None:
    def ready() -> bool:
        response = httpx.get(f"{gateway.url}/ready", timeout=2)
        return response.status_code == 200 and response.json()["num_routable"] >= num_routable

    wait_until(ready, timeout_s, what=f"{num_routable} routable replicas")


# ---- real local replicas (slow tests): `tokenmill serve` of the tiny llama

TINY_SERVE_ARGS = ("--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "128", "--threads", "1",
                   "--log-level", "warning")
REAL_HEALTH = HealthConfig(probe_interval_s=1.0, probe_timeout_s=2.0, connect_timeout_s=2.0, read_timeout_s=60.0)
REAL_RETRY = RetryConfig(max_attempts=3, wait_for_replica_s=60.0)


@pytest.fixture(scope="module")
def tiny_model(tiny_hf_dir: Callable[[str], Path]) -> Path:
    return tiny_hf_dir("llama")


@pytest.fixture
def local_gateway(tiny_model: Path, tmp_path: Path) -> Iterator[Callable[..., LiveGateway]]:
    started: list[LiveGateway] = []

    def make(num_replicas: int, serve_args: tuple[str, ...] = TINY_SERVE_ARGS, **overrides: object) -> LiveGateway:
        local = LocalReplicaConfig(str(tiny_model), serve_args, log_dir=str(tmp_path / "logs"), drain_timeout_s=10)
        config = fast_config(backends=(), local=local, initial_replicas=num_replicas, health=REAL_HEALTH,
                             retry=REAL_RETRY, breaker=BreakerConfig(failure_threshold=3, open_s=2.0),
                             policy="least_outstanding")
        started.append(start_gateway(replace(config, **overrides)))  # type: ignore[arg-type]
        return started[-1]

    yield make
    for live in started:
        live.stop()
