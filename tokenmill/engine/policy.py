"""Swappable ordering of requests: who is admitted first, and who is preempted first."""

from __future__ import annotations

import bisect
import itertools
from abc import ABC, abstractmethod

from tokenmill.engine.request import Request


class SchedulingPolicy(ABC):
    """A total order on requests; smaller keys run first and are preempted last."""

    @abstractmethod
    def key(self, request: Request) -> tuple[float, ...]: ...

    def rotation_key(self, request: Request, last_scheduled_step: int) -> tuple[float, ...]:
        """Order among requests that cannot all run this step (the SLO-aware scheduler's fillers):
        the longest-paused first, so every one progresses; the policy's key breaks ties."""
        return (last_scheduled_step, *self.key(request))


class FCFSPolicy(SchedulingPolicy):
    def key(self, request: Request) -> tuple[float, ...]:
        return (request.arrival_time,)


class PriorityPolicy(SchedulingPolicy):
    """Integer priority first (lower value = more urgent, as in vLLM), then arrival."""

    def key(self, request: Request) -> tuple[float, ...]:
        return (request.priority, request.arrival_time)

    def rotation_key(self, request: Request, last_scheduled_step: int) -> tuple[float, ...]:
        # Priority stays strict: the rotation only shares steps among requests of equal priority.
        return (request.priority, last_scheduled_step, request.arrival_time)


class ClassRankedPolicy(SchedulingPolicy):
    """Service class first (interactive, standard, batch), then the inner policy: batch requests
    are scheduled last and preempted first."""

    def __init__(self, inner: SchedulingPolicy) -> None:
        self.inner = inner

    def key(self, request: Request) -> tuple[float, ...]:
        return (request.service_class.rank, *self.inner.key(request))

    def rotation_key(self, request: Request, last_scheduled_step: int) -> tuple[float, ...]:
        return (request.service_class.rank, *self.inner.rotation_key(request, last_scheduled_step))


POLICIES: dict[str, type[SchedulingPolicy]] = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}


def build_policy(name: str, rank_classes: bool) -> SchedulingPolicy:
    policy = POLICIES[name]()
    return ClassRankedPolicy(policy) if rank_classes else policy


class RequestQueue:
    """Requests kept sorted by the policy's key (ties keep insertion order)."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self._items: list[tuple[tuple[float, ...], int, Request]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return (item[2] for item in self._items)

    def add(self, request: Request) -> None:
        bisect.insort(self._items, (self.policy.key(request), next(self._counter), request),
                      key=lambda item: (item[0], item[1]))

    def peek(self) -> Request:
        return self._items[0][2]

    def pop(self) -> Request:
        return self._items.pop(0)[2]

    def pop_last(self) -> Request:
        return self._items.pop()[2]

    def remove(self, request: Request) -> bool:
        for i, item in enumerate(self._items):
            if item[2] is request:
                del self._items[i]
                return True
        return False
