"""Routing policies: which routable replica gets a request. One ABC, a registry, three policies.

`prefix_affinity` is consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018):
the prompt's prefix hashes to a point on a ring of virtual nodes; the request goes to the first
replica clockwise whose load stays within ceil((1 + epsilon) x mean), the mean counting this
request. Same prefix → same replica (its prefix cache hits) until that replica is (1 + epsilon)
times busier than average; then the request walks on to the next replica on the ring, which is
again the same one for every request of that prefix, so the spill-over gets cache hits too.

    ring:  0 ──●a──●c──●b──●a──✕──●b──●c──●a── 2**64      ✕ = hash(prefix); home = b (then c, a)
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from tokenmill.errors import TokenmillError
from tokenmill.gateway.config import GatewayConfig
from tokenmill.gateway.replica import Replica

VIRTUAL_NODES_PER_REPLICA = 64  # enough points that each replica owns ≈ 1/n of the ring (±15%)


@dataclass(frozen=True, slots=True)
class RouteKey:
    """What a policy may know about a request."""

    prefix: str | None = None  # a prompt prefix or session id; None: no affinity wanted


@dataclass(frozen=True, slots=True)
class Decision:
    replica: Replica
    reason: str  # why this one: a label of the routing-decisions metric


class RoutingPolicy(ABC):
    name: ClassVar[str]

    @classmethod
    def from_config(cls, config: GatewayConfig) -> RoutingPolicy:
        return cls()

    @abstractmethod
    def choose(self, candidates: Sequence[Replica], key: RouteKey) -> Decision:
        """Pick one of `candidates` (never empty, all routable, in a stable order)."""


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Replica], key: RouteKey) -> Decision:
        return Decision(candidates[next(self._counter) % len(candidates)], "round_robin")


class LeastOutstanding(RoutingPolicy):
    name = "least_outstanding"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Replica], key: RouteKey) -> Decision:
        # Ties rotate: otherwise an idle fleet would send everything to the first replica.
        start = next(self._counter) % len(candidates)
        rotated = [*candidates[start:], *candidates[:start]]
        return Decision(min(rotated, key=lambda r: r.num_outstanding), "least_outstanding")


def _hash64(text: str) -> int:
    # Stable across processes and runs (unlike hash()): a restarted gateway keeps the same homes.
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


class _Ring:
    def __init__(self, names: Sequence[str]) -> None:
        points = sorted((_hash64(f"{name}#{i}"), name) for name in names for i in range(VIRTUAL_NODES_PER_REPLICA))
        self._hashes = [h for h, _ in points]
        self._names = [name for _, name in points]

    def walk(self, key: str) -> list[str]:
        """Distinct replica names clockwise from the key's point: its home first."""
        start = bisect.bisect(self._hashes, _hash64(key))
        order: dict[str, None] = {}
        for i in range(len(self._names)):
            order.setdefault(self._names[(start + i) % len(self._names)])
        return list(order)


class PrefixAffinity(RoutingPolicy):
    name = "prefix_affinity"

    def __init__(self, epsilon: float = 0.25) -> None:
        self.epsilon = epsilon
        self._ring: _Ring | None = None
        self._ring_names: tuple[str, ...] = ()
        self._fallback = LeastOutstanding()

    @classmethod
    def from_config(cls, config: GatewayConfig) -> RoutingPolicy:
        return cls(config.affinity_epsilon)

    def choose(self, candidates: Sequence[Replica], key: RouteKey) -> Decision:
        if key.prefix is None:
            return Decision(self._fallback.choose(candidates, key).replica, "no_prefix")
        by_name = {replica.name: replica for replica in candidates}
        capacity = self.capacity(candidates)
        order = self._ring_for(tuple(by_name)).walk(key.prefix)
        for rank, name in enumerate(order):
            if by_name[name].num_outstanding + 1 <= capacity:
                return Decision(by_name[name], "affinity" if rank == 0 else "spill")
        return Decision(by_name[order[0]], "affinity")  # unreachable: the capacities sum to ≥ the load

    def capacity(self, candidates: Sequence[Replica]) -> int:
        """Most requests one replica may hold once this one is placed: ceil((1 + eps) x mean)."""
        total = sum(replica.num_outstanding for replica in candidates) + 1
        return math.ceil((1 + self.epsilon) * total / len(candidates))

    def _ring_for(self, names: tuple[str, ...]) -> _Ring:
        key = tuple(sorted(names))
        if self._ring is None or key != self._ring_names:  # rebuilt only when the fleet changes
            self._ring, self._ring_names = _Ring(key), key
        return self._ring


POLICIES: dict[str, type[RoutingPolicy]] = {
    policy.name: policy for policy in (RoundRobin, LeastOutstanding, PrefixAffinity)
}


def make_policy(config: GatewayConfig) -> RoutingPolicy:
    policy = POLICIES.get(config.policy)
    if policy is None:
        raise TokenmillError(f"routing policy '{config.policy}' does not exist: use one of {', '.join(POLICIES)}")
    return policy.from_config(config)
