"""Active health: probe every replica's /ready, and scrape /metrics of the ready ones for their load.

Starting replicas are probed every tick (fast), so a replica takes traffic within a fraction of a
second of becoming ready: that latency is part of the cold start the gateway can cut. Serving
ones are probed every `probe_interval_s`. A failed probe only marks the replica unready (the
breaker counts request failures); the next passing probe readmits it.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from tokenmill.gateway.config import HealthConfig
from tokenmill.gateway.metrics import GatewayMetrics
from tokenmill.gateway.replica import Lifecycle, Replica, parse_engine_load
from tokenmill.gateway.replica_set import ReplicaSet

log = logging.getLogger(__name__)

STARTING_PROBE_INTERVAL_S = 0.1


class Prober:
    def __init__(self, replicas: ReplicaSet, client: httpx.AsyncClient, config: HealthConfig,
                 metrics: GatewayMetrics) -> None:
        self.replicas = replicas
        self.client = client
        self.config = config
        self.metrics = metrics
        self._last_probe: dict[str, float] = {}

    async def run(self) -> None:
        while True:
            await self.probe_due()
            await asyncio.sleep(STARTING_PROBE_INTERVAL_S)

    async def probe_due(self) -> None:
        now = time.monotonic()
        due = [replica for replica in self.replicas if self._is_due(replica, now)]
        if due:
            await asyncio.gather(*(self.probe(replica) for replica in due))
        self.metrics.set_replica_counts(list(self.replicas))

    def _is_due(self, replica: Replica, now: float) -> bool:
        if replica.lifecycle is Lifecycle.STARTING:
            return replica.process is None or not replica.process.has_exited()
        last = self._last_probe.get(replica.url, 0.0)
        return replica.lifecycle is Lifecycle.SERVING and now - last >= self.config.probe_interval_s

    async def probe(self, replica: Replica) -> None:
        self._last_probe[replica.url] = time.monotonic()
        is_ready = await self._get_ok(replica, "/ready")
        was_routable = replica.is_routable
        if replica.on_probe(is_ready) and replica.ready_after_s is not None:
            log.info("replica %s ready %.2f s after start", replica.name, replica.ready_after_s)
            self.metrics.replica_start.observe(replica.ready_after_s)
        if replica.is_routable and not was_routable:
            self.replicas.notify()
        if is_ready:
            await self._scrape(replica)

    async def _get_ok(self, replica: Replica, path: str) -> bool:
        try:
            response = await self.client.get(replica.url + path, timeout=self.config.probe_timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _scrape(self, replica: Replica) -> None:
        try:
            response = await self.client.get(replica.url + "/metrics", timeout=self.config.probe_timeout_s)
        except httpx.HTTPError:
            return  # the load stays as last seen; readiness is what the next probe decides
        if response.status_code == 200:
            replica.engine_load = parse_engine_load(response.text)
