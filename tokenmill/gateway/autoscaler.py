"""Autoscaling of local replicas, with a buffer of warm idle ones, and replacement of dead ones.

    load     = Σ over local replicas of max(gateway's outstanding, replica's running + waiting)
    busy     = max(ceil(load / target_load_per_replica), min_replicas)
    desired  = min(busy + warm_replicas, max_replicas)

The `warm_replicas` term is the buffer: replicas already loaded and idle beyond what the load
(or the floor) needs, so a step up in traffic lands on a ready replica at once while the autoscaler starts a
cold one to refill the buffer. Scale-up is immediate (new replicas start concurrently); scale-
down waits until the fleet has been too big for `scale_down_delay_s` (no flapping on bursty
traffic) and then drains one replica at a time with SIGTERM, so no request is cut off.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from tokenmill.gateway.config import AutoscaleConfig, BreakerConfig
from tokenmill.gateway.local import LocalLauncher
from tokenmill.gateway.metrics import GatewayMetrics
from tokenmill.gateway.replica import Lifecycle, Replica
from tokenmill.gateway.replica_set import ReplicaSet

log = logging.getLogger(__name__)


class Autoscaler:
    def __init__(self, replicas: ReplicaSet, launcher: LocalLauncher, config: AutoscaleConfig,
                 breaker_config: BreakerConfig, metrics: GatewayMetrics) -> None:
        self.replicas = replicas
        self.launcher = launcher
        self.config = config
        self.breaker_config = breaker_config
        self.metrics = metrics
        self._too_big_since: float | None = None
        self._drains: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        while True:
            self.tick()
            await asyncio.sleep(self.config.interval_s)

    def tick(self) -> None:
        self.reap_dead()
        live = [replica for replica in self.replicas.local() if replica.is_live]
        desired = self.desired(live)
        if len(live) < desired:
            self.start(desired - len(live))
            self.metrics.scale_events.labels("up").inc(desired - len(live))
        self._maybe_drain(live, desired)

    def desired(self, live: list[Replica]) -> int:
        load = sum(replica.load() for replica in live)
        busy = max(math.ceil(load / self.config.target_load_per_replica), self.config.min_replicas)
        return min(busy + self.config.warm_replicas, self.config.max_replicas)

    def start(self, num_replicas: int) -> list[Replica]:
        """Spawn replicas at once: they load in parallel, and the prober admits each when ready."""
        started = []
        for _ in range(num_replicas):
            url, process = self.launcher.spawn()
            replica = Replica(url, self.breaker_config, process=process)
            self.replicas.add(replica)
            started.append(replica)
        return started

    def reap_dead(self) -> None:
        for replica in self.replicas.local():
            if replica.lifecycle is not Lifecycle.DRAINING and replica.has_died():
                log.warning("replica %s died: replacing it", replica.name)
                self.replicas.remove(replica)
                self.metrics.replacements.inc()

    def _maybe_drain(self, live: list[Replica], desired: int) -> None:
        if len(live) <= desired:
            self._too_big_since = None
            return
        now = time.monotonic()
        if self._too_big_since is None:
            self._too_big_since = now
        if now - self._too_big_since >= self.config.scale_down_delay_s:
            self._too_big_since = now  # one replica per delay: re-measure the load before the next
            self.drain(_drain_choice(live))
            self.metrics.scale_events.labels("down").inc()

    def drain(self, replica: Replica) -> None:
        replica.lifecycle = Lifecycle.DRAINING  # routes no new request; in-flight ones finish
        task = asyncio.get_running_loop().create_task(self._stop(replica))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def _stop(self, replica: Replica) -> None:
        if replica.process is not None:
            await self.launcher.stop(replica.process)
        self.replicas.remove(replica)

    async def stop_all(self) -> None:
        """Gateway shutdown: drain every local replica at once and wait for them."""
        for replica in self.replicas.local():
            if replica.lifecycle is not Lifecycle.DRAINING and replica.lifecycle is not Lifecycle.GONE:
                self.drain(replica)
        if self._drains:
            await asyncio.gather(*self._drains, return_exceptions=True)


def _drain_choice(live: list[Replica]) -> Replica:
    """A replica still starting costs nothing to stop; else the least busy, newest first."""
    starting = [replica for replica in live if replica.lifecycle is Lifecycle.STARTING]
    if starting:
        return starting[-1]
    return min(reversed(live), key=lambda replica: replica.num_outstanding)
