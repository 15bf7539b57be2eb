"""The gateway over fake replicas: retries before the first token, mid-stream failures, backends that
are down at start, a flapping replica's ejection and half-open recovery, affinity, passthrough."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.conftest import FAST_HEALTH, FAST_RETRY, LiveGateway, wait_ready
from tests.gateway.fakes import FakeReplica, free_port, wait_until
from tokenmill.gateway.config import BreakerConfig, RetryConfig

Fakes = Callable[[int], list[FakeReplica]]
GatewayFor = Callable[..., LiveGateway]
COMPLETION: dict[str, Any] = {"model": "fake", "prompt": "hello", "max_tokens": 4}


def stream_events(url: str, body: dict[str, Any], path: str = "/v1/completions") -> tuple[int, list[str]]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=10) as response:
        return response.status_code, [line.removeprefix("data: ") for line in response.iter_lines() if line]


def test_proxies_completions_models_and_streams_through_the_openai_client(fakes: Fakes,
                                                                         gateway_for: GatewayFor) -> None:
    (fake,) = fakes(1)
    live = gateway_for([fake.url])
    wait_ready(live)
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
    assert client.models.list().data[0].id == "fake"
    assert client.completions.create(**COMPLETION).choices[0].text == "t0 t1 t2 t3 "
    chunks = list(client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "t0 t1 t2 t3 "
    wait_until(lambda: live.metric("success") == 3, timeout_s=2, what="the stream's outcome")
    metrics = httpx.get(f"{live.url}/metrics").text
    assert 'tokenmill:gateway_requests_total{outcome="success",replica="' + fake.url[7:] + '"} 3.0' in metrics
    assert "tokenmill:gateway_e2e_request_latency_seconds_bucket" in metrics


def test_starts_with_every_backend_down_and_serves_once_one_is_up(gateway_for: GatewayFor) -> None:
    port = free_port()
    live = gateway_for([f"http://127.0.0.1:{port}"], retry=_retry(wait_for_replica_s=0.2))
    ready = httpx.get(f"{live.url}/ready")
    assert ready.status_code == 503 and ready.json()["reason"] == "no replica is ready yet"
    refused = httpx.post(f"{live.url}/v1/completions", json=COMPLETION)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_replica"
    assert live.metric("no_replica") == 1
    fake = FakeReplica(port).start()
    try:
        wait_ready(live)
        assert httpx.post(f"{live.url}/v1/completions", json=COMPLETION).status_code == 200
    finally:
        fake.stop()


def test_a_waiting_request_is_served_when_a_replica_comes_up(fakes: Fakes, gateway_for: GatewayFor) -> None:
    (fake,) = fakes(1)
    fake.behaviour.is_ready = False
    live = gateway_for([fake.url])
    wait_until(lambda: fake.behaviour.num_probes >= 2, what="the gateway to probe the unready replica")
    with httpx.Client(timeout=10) as client:
        threading.Timer(0.3, lambda: setattr(fake.behaviour, "is_ready", True)).start()
        response = client.post(f"{live.url}/v1/completions", json=COMPLETION)  # waits for the replica
    # The unready fake answers 503 like a loading server: only a gateway that waited for a passing
    # probe gets a 200, and the request reached the replica once, after it became ready.
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "t0 t1 t2 t3 "
    assert (fake.behaviour.num_requests, fake.behaviour.num_requests_unready) == (1, 0)


@pytest.mark.parametrize("status", [429, 503, 500])
def test_error_statuses_are_retried_on_another_replica(fakes: Fakes, gateway_for: GatewayFor, status: int) -> None:
    bad, good = fakes(2)
    bad.behaviour.fail_status = status
    live = gateway_for([bad.url, good.url])
    wait_ready(live, 2)
    for _ in range(4):  # round robin: half of them meet the bad replica first
        response = httpx.post(f"{live.url}/v1/completions", json=COMPLETION)
        assert response.status_code == 200 and response.headers["x-tokenmill-replica"] == good.url[7:]
    assert bad.behaviour.num_requests >= 1
    assert live.sample("tokenmill:gateway_retries_total", reason=f"status_{status}") >= 1
    assert live.metric("failed") == 0


def test_refused_connections_and_stalls_are_retried(fakes: Fakes, gateway_for: GatewayFor) -> None:
    stalled, good = fakes(2)
    stalled.behaviour.stall_s = 1.0  # beyond the read timeout
    live = gateway_for([stalled.url, good.url, f"http://127.0.0.1:{free_port()}"],
                       health=replace(FAST_HEALTH, read_timeout_s=0.3))
    wait_ready(live, 2)
    for _ in range(3):
        assert httpx.post(f"{live.url}/v1/completions", json=COMPLETION, timeout=20).status_code == 200
    assert live.sample("tokenmill:gateway_retries_total", reason="timeout") >= 1


def test_a_stream_cut_before_its_first_token_is_retried_invisibly(fakes: Fakes, gateway_for: GatewayFor) -> None:
    cutting, good = fakes(2)
    cutting.behaviour.cut_after_events = 1  # chat: the role chunk goes out, then the connection drops
    live = gateway_for([cutting.url, good.url])
    wait_ready(live, 2)
    for _ in range(4):
        status, events = stream_events(live.url, {"messages": [{"role": "user", "content": "hi"}]},
                                       "/v1/chat/completions")
        assert status == 200 and events[-1] == "[DONE]"
        assert sum(1 for e in events if json.loads(e if e != "[DONE]" else "{}").get("choices")) == 6
        assert not any("error" in e for e in events)
    assert live.sample("tokenmill:gateway_retries_total", reason="stream_before_output") >= 1
    assert live.metric("midstream_error") == 0


def test_a_failure_mid_stream_ends_with_an_error_event_and_is_counted(fakes: Fakes,
                                                                      gateway_for: GatewayFor) -> None:
    (fake,) = fakes(1)
    fake.behaviour.cut_after_events = 2  # two tokens, then the replica "dies"
    live = gateway_for([fake.url])
    wait_ready(live)
    status, events = stream_events(live.url, {"prompt": "hi"})
    assert status == 200
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["t0 ", "t1 "]
    assert json.loads(events[2])["error"]["code"] == "replica_failed" and events[3] == "[DONE]"
    assert len(events) == 4
    # Booked when the relay closes, just after the last byte went out.
    wait_until(lambda: live.metric("midstream_error") == 1, timeout_s=2, what="the outcome")
    assert live.metric("success") == 0
    assert fake.behaviour.num_requests == 1  # not retried: tokens had reached the client


def test_a_flapping_replica_is_ejected_then_readmitted_by_a_half_open_trial(fakes: Fakes,
                                                                           gateway_for: GatewayFor) -> None:
    flapping, steady = fakes(2)
    flapping.behaviour.fail_status = 500
    live = gateway_for([flapping.url, steady.url], breaker=BreakerConfig(failure_threshold=2, open_s=1.5))
    wait_ready(live, 2)
    name = flapping.url[7:]
    for _ in range(6):
        assert httpx.post(f"{live.url}/v1/completions", json=COMPLETION).status_code == 200
    assert live.sample("tokenmill:gateway_ejections_total", replica=name) == 1
    seen_while_open = flapping.behaviour.num_requests
    for _ in range(4):  # open: the flapping replica gets nothing
        httpx.post(f"{live.url}/v1/completions", json=COMPLETION)
    assert flapping.behaviour.num_requests == seen_while_open
    flapping.behaviour.fail_status = None  # it recovers
    replica = next(r for r in live.gateway.replicas if r.name == name)
    wait_until(lambda: replica.breaker.can_route(), timeout_s=3, what="half-open")

    def served_by_flapping() -> bool:
        response = httpx.post(f"{live.url}/v1/completions", json=COMPLETION)
        return response.headers["x-tokenmill-replica"] == name

    wait_until(served_by_flapping, timeout_s=5, what="the trial request")
    assert replica.breaker.state.value == "closed"


def test_prefix_affinity_keeps_a_shared_prefix_on_one_replica(fakes: Fakes, gateway_for: GatewayFor) -> None:
    fleet = fakes(3)
    live = gateway_for([f.url for f in fleet], policy="prefix_affinity")
    wait_ready(live, 3)
    names = {httpx.post(f"{live.url}/v1/completions", json={**COMPLETION, "prompt": f"SYSTEM PROMPT {'x' * 300} q{i}"}
                        ).headers["x-tokenmill-replica"] for i in range(10)}
    assert len(names) == 1
    assert live.sample("tokenmill:gateway_routing_decisions_total", policy="prefix_affinity", reason="affinity") == 10


def _retry(**overrides: Any) -> RetryConfig:
    return replace(FAST_RETRY, **overrides)


def test_a_client_that_leaves_mid_stream_closes_the_upstream_and_is_counted(fakes: Fakes,
                                                                             gateway_for: GatewayFor) -> None:
    (fake,) = fakes(1)
    fake.behaviour.num_tokens, fake.behaviour.token_delay_s = 50, 0.05
    live = gateway_for([fake.url])
    wait_ready(live)
    with httpx.stream("POST", f"{live.url}/v1/completions", json={"prompt": "hi", "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    replica = next(iter(live.gateway.replicas))
    wait_until(lambda: live.metric("client_closed") == 1 and replica.num_outstanding == 0, timeout_s=5,
               what="the relay to close")
    assert replica.breaker.num_consecutive_failures == 0  # the client left: not the replica's fault


def test_a_conversation_is_continued_and_read_on_the_replica_that_created_it(fakes: Fakes,
                                                                             gateway_for: GatewayFor) -> None:
    fleet = fakes(3)
    live = gateway_for([f.url for f in fleet], policy="round_robin")
    wait_ready(live, 3)
    created = [httpx.post(f"{live.url}/v1/conversations", json={}) for _ in range(3)]
    assert len({r.headers["x-tokenmill-replica"] for r in created}) == 3
    for conversation in created:
        conv_id, home = conversation.json()["id"], conversation.headers["x-tokenmill-replica"]
        for _ in range(2):
            turn = httpx.post(f"{live.url}/v1/responses", json={"model": "fake", "input": "x", "conversation": conv_id})
            assert turn.status_code == 200 and turn.headers["x-tokenmill-replica"] == home, turn.text
        items = httpx.get(f"{live.url}/v1/conversations/{conv_id}/items")
        assert items.status_code == 200 and items.headers["x-tokenmill-replica"] == home
    assert live.sample("tokenmill:gateway_routing_decisions_total", policy="round_robin",
                       reason="stored_response") == 3 * 3  # every turn and read sent home, none by luck


def test_a_stored_response_is_continued_and_read_on_the_replica_that_stores_it(fakes: Fakes,
                                                                             gateway_for: GatewayFor) -> None:
    """Round robin would scatter a conversation's turns over the fleet, and each replica stores only the
    responses it answered: the gateway sends previous_response_id and GET /v1/responses/{id} home."""
    fleet = fakes(3)
    live = gateway_for([f.url for f in fleet], policy="round_robin")
    wait_ready(live, 3)
    first = [httpx.post(f"{live.url}/v1/responses", json={"model": "fake", "input": f"q{i}"}) for i in range(6)]
    assert len({r.headers["x-tokenmill-replica"] for r in first}) == 3
    for response in first:
        turn = response.json()["id"]
        for _ in range(2):
            follow = httpx.post(f"{live.url}/v1/responses", json={"model": "fake", "input": "more",
                                                                  "previous_response_id": turn})
            assert follow.status_code == 200, follow.text
            assert follow.headers["x-tokenmill-replica"] == response.headers["x-tokenmill-replica"]
            turn = follow.json()["id"]  # the continuation is stored where its conversation is
        assert httpx.get(f"{live.url}/v1/responses/{turn}").status_code == 200
    assert live.sample("tokenmill:gateway_routing_decisions_total", policy="round_robin",
                       reason="stored_response") == 6 * 3
    # the home replica gone, the conversation is gone with it: the client hears 404, not a hang
    home = next(f for f in fleet if f.url.endswith(first[0].headers["x-tokenmill-replica"]))
    home.stop()
    wait_ready(live, 2)
    lost = httpx.post(f"{live.url}/v1/responses", json={"model": "fake", "input": "x",
                                                        "previous_response_id": first[0].json()["id"]})
    assert lost.status_code == 404
