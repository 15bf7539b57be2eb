"""Routing policies on plain Replica objects: exact choices, and prefix affinity's load bound."""

from __future__ import annotations

from collections import Counter

import pytest

from tokenmill.errors import TokenmillError
from tokenmill.gateway.config import BreakerConfig, GatewayConfig
from tokenmill.gateway.policies import LeastOutstanding, PrefixAffinity, RoundRobin, RouteKey, make_policy
from tokenmill.gateway.replica import Replica


def replicas(num: int) -> list[Replica]:
    return [Replica(f"http://127.0.0.1:{9000 + i}", BreakerConfig()) for i in range(num)]


def test_round_robin_cycles_in_order() -> None:
    fleet, policy = replicas(3), RoundRobin()
    picks = [policy.choose(fleet, RouteKey()).replica for _ in range(6)]
    assert picks == fleet + fleet


def test_least_outstanding_picks_the_idlest_and_rotates_ties() -> None:
    fleet, policy = replicas(3), LeastOutstanding()
    fleet[0].num_outstanding, fleet[1].num_outstanding, fleet[2].num_outstanding = 4, 1, 2
    assert policy.choose(fleet, RouteKey()).replica is fleet[1]
    for replica in fleet:
        replica.num_outstanding = 0
    assert {policy.choose(fleet, RouteKey()).replica.name for _ in range(3)} == {r.name for r in fleet}


def route(policy: PrefixAffinity, fleet: list[Replica], prefix: str | None) -> tuple[Replica, str]:
    """Choose and hold: the chosen replica's load goes up, as the proxy's bookkeeping does."""
    decision = policy.choose(fleet, RouteKey(prefix))
    decision.replica.num_outstanding += 1
    return decision.replica, decision.reason


def test_prefix_affinity_sticks_until_the_load_bound_then_spreads() -> None:
    fleet, policy = replicas(3), PrefixAffinity(epsilon=0.5)
    home, reason = route(policy, fleet, "You are a helpful agent. Tools: ...")
    assert reason == "affinity"
    # Sequential traffic (each request done before the next): always home, however many.
    home.num_outstanding = 0
    for _ in range(20):
        assert policy.choose(fleet, RouteKey("You are a helpful agent. Tools: ...")).replica is home
    # Concurrent traffic: home takes requests while load <= ceil(1.5 x mean), then spills.
    placed = [route(policy, fleet, "You are a helpful agent. Tools: ...") for _ in range(12)]
    first_spill = next(i for i, (_, why) in enumerate(placed) if why == "spill")
    assert all(replica is home for replica, _ in placed[:first_spill])
    assert home.num_outstanding <= policy.capacity(fleet)
    loads = sorted(replica.num_outstanding for replica in fleet)
    assert loads == [0, 6, 6]  # each ≤ ceil(1.5 x mean 4): home, then its ring successor, full


def test_prefix_affinity_spills_to_the_same_next_replica_and_returns_home() -> None:
    fleet, policy = replicas(3), PrefixAffinity(epsilon=0.25)
    home = policy.choose(fleet, RouteKey("shared system prompt")).replica
    home.num_outstanding = 10  # far above the bound
    spills = {policy.choose(fleet, RouteKey("shared system prompt")).replica.name for _ in range(5)}
    assert len(spills) == 1 and home.name not in spills  # the spill target is consistent too
    home.num_outstanding = 0
    assert policy.choose(fleet, RouteKey("shared system prompt")).replica is home


def test_prefix_affinity_spreads_distinct_prefixes_and_keeps_homes_when_a_replica_leaves() -> None:
    fleet, policy = replicas(4), PrefixAffinity()
    keys = [f"user {i} conversation" for i in range(400)]
    homes = {key: policy.choose(fleet, RouteKey(key)).replica.name for key in keys}
    assert min(Counter(homes.values()).values()) > 50  # each of 4 replicas owns a fair share
    gone = fleet[0].name
    after = {key: policy.choose(fleet[1:], RouteKey(key)).replica.name for key in keys}
    # Consistent hashing: only the departed replica's keys move.
    assert all(after[key] == homes[key] for key in keys if homes[key] != gone)


def test_prefix_affinity_without_a_prefix_balances_by_load() -> None:
    fleet, policy = replicas(2), PrefixAffinity()
    fleet[0].num_outstanding = 3
    decision = policy.choose(fleet, RouteKey(None))
    assert decision.replica is fleet[1] and decision.reason == "no_prefix"


def test_registry_builds_policies_by_name_and_refuses_unknown_ones() -> None:
    config = GatewayConfig(backends=("http://x:1",), policy="prefix_affinity", affinity_epsilon=0.1)
    policy = make_policy(config)
    assert isinstance(policy, PrefixAffinity) and policy.epsilon == 0.1
    with pytest.raises(TokenmillError, match="round_robin"):
        make_policy(GatewayConfig(backends=("http://x:1",), policy="random"))
