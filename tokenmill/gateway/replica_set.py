"""The fleet: every replica the gateway knows, which of them may take a request now, and waiting
for one when none may (cold start, all ejected): requests then wait rather than fail at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Collection, Iterator

from tokenmill.gateway.replica import Lifecycle, Replica

# Breakers turn half-open on a clock, not an event: a waiting request looks again this often.
_RECHECK_S = 0.1


class ReplicaSet:
    def __init__(self) -> None:
        self._replicas: list[Replica] = []
        self._changed = asyncio.Event()

    def __iter__(self) -> Iterator[Replica]:
        return iter(list(self._replicas))  # a copy: the fleet may change while a caller iterates

    def __len__(self) -> int:
        return len(self._replicas)

    def add(self, replica: Replica) -> None:
        self._replicas.append(replica)
        self.notify()

    def remove(self, replica: Replica) -> None:
        replica.lifecycle = Lifecycle.GONE
        if replica in self._replicas:
            self._replicas.remove(replica)
        self.notify()

    def notify(self) -> None:
        """Something may have become routable: wake the waiting requests."""
        self._changed.set()
        self._changed = asyncio.Event()

    def routable(self) -> list[Replica]:
        return [replica for replica in self._replicas if replica.is_routable]

    def local(self) -> list[Replica]:
        return [replica for replica in self._replicas if replica.is_local]

    def candidates(self, tried: Collection[str]) -> list[Replica]:
        """Routable replicas, untried ones only while there are some (a retry prefers a new one)."""
        routable = self.routable()
        untried = [replica for replica in routable if replica.name not in tried]
        return untried or routable

    async def wait_candidates(self, tried: Collection[str], timeout_s: float) -> list[Replica]:
        """Candidates, waiting up to `timeout_s` for one to appear; [] when none did."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not (found := self.candidates(tried)):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return []
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, _RECHECK_S))
        return found
