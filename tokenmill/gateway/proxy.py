"""Forwarding a client request to a replica, retried on another until something reaches the client.

    pick a routable replica (policy) ─▶ send ─▶ transport error / timeout / 429 / 5xx ─▶ backoff, next
                                         │
                                         ├─ unary: the whole body read ─▶ answer the client
                                         └─ stream: events held until one carries output ─▶ commit,
                                            relay the rest (relay.py); a cut before commit is retried

Nothing reaches the client before an attempt has succeeded or the last one has failed, so every
failure before commit is invisible to it, within `max_attempts` tries and `wait_for_replica_s`
of waiting for a routable replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.gateway.config import GatewayConfig
from tokenmill.gateway.metrics import GatewayMetrics
from tokenmill.gateway.policies import Decision, RouteKey, RoutingPolicy
from tokenmill.gateway.prompt_key import route_prefix
from tokenmill.gateway.relay import Accounting, RelayResponse, StreamRelay
from tokenmill.gateway.replica import Replica
from tokenmill.gateway.replica_set import ReplicaSet
from tokenmill.gateway.response_homes import RESPONSE_ID_HEADER, ResponseHomes, referenced_response
from tokenmill.gateway.retry import Failure, Verdict, backoff_s, status_failure, transport_failure
from tokenmill.gateway.sse import carries_output, error_body, is_error_event, split_events

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-tokenmill-replica"  # which replica answered: for debugging and tests
# Not forwarded: hop-by-hop headers, and ones httpx sets itself. accept-encoding stays out so
# that replicas answer uncompressed and the gateway can read event boundaries.
_DROPPED_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
                              "upgrade", "trailer", "proxy-authorization", "proxy-connection", "accept-encoding"})
_RETURNED_HEADERS = ("content-type", "x-request-id", "retry-after")


@dataclass(frozen=True, slots=True)
class Outbound:
    """A client request as it will be sent to replicas (the same bytes every attempt)."""

    method: str
    path: str  # with the query string
    headers: dict[str, str]
    body: bytes
    key: RouteKey
    is_stream: bool
    received: float  # time.monotonic() at arrival
    home: str | None = None  # the replica that stores the response this request refers to (response_homes.py)


class Proxy:
    def __init__(self, replicas: ReplicaSet, policy: RoutingPolicy, client: httpx.AsyncClient,
                 config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.replicas = replicas
        self.policy = policy
        self.client = client
        self.config = config
        self.metrics = metrics
        self.accounting = Accounting(metrics)
        self.homes = ResponseHomes()

    async def forward(self, request: Request) -> Response:
        outbound = await self._outbound(request)
        deadline = outbound.received + self.config.retry.wait_for_replica_s
        tried: list[Replica] = []
        failure: Failure | None = None
        for _ in range(self.config.retry.max_attempts):
            if failure is not None:
                self.metrics.retries.labels(failure.reason).inc()
                await asyncio.sleep(backoff_s(len(tried), self.config.retry))
            replica = await self._pick(outbound, tried, deadline)
            if replica is None:
                break
            tried.append(replica)
            result = await self._attempt(replica, outbound)
            if isinstance(result, Response):
                return result
            failure = result
        return self._give_up(failure, tried[-1] if tried else None, outbound)

    async def _outbound(self, request: Request) -> Outbound:
        body = await request.body()
        payload = _json_or_none(body)
        query = request.url.query
        return Outbound(
            method=request.method, path=request.url.path + (f"?{query}" if query else ""),
            headers={k: v for k, v in request.headers.items() if k.lower() not in _DROPPED_HEADERS},
            body=body, key=RouteKey(route_prefix(payload, request.headers, self.config.affinity_prefix_chars)),
            is_stream=isinstance(payload, dict) and payload.get("stream") is True, received=time.monotonic(),
            home=self.homes.home_of(referenced_response(request.method, request.url.path, payload)))

    async def _pick(self, outbound: Outbound, tried: list[Replica], deadline: float) -> Replica | None:
        timeout_s = max(0.0, deadline - time.monotonic())
        candidates = await self.replicas.wait_candidates({r.name for r in tried}, timeout_s)
        if not candidates:
            return None
        home = next((r for r in candidates if r.name == outbound.home), None)
        decision = Decision(home, "stored_response") if home is not None else self.policy.choose(candidates,
                                                                                                  outbound.key)
        self.metrics.routing.labels(self.policy.name, decision.reason).inc()
        return decision.replica

    async def _attempt(self, replica: Replica, outbound: Outbound) -> Response | Failure:
        self.accounting.begin(replica)
        try:
            return await self._exchange(replica, outbound)
        except asyncio.CancelledError:  # the gateway is stopping mid-attempt: no verdict, nothing leaked
            self.accounting.end(replica, Verdict.NONE)
            raise

    async def _exchange(self, replica: Replica, outbound: Outbound) -> Response | Failure:
        """One attempt; every path but cancellation books its end (or hands it to the relay)."""
        request = self.client.build_request(outbound.method, replica.url + outbound.path,
                                            headers=outbound.headers, content=outbound.body)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            return self._failed(replica, transport_failure(exc, replica.name))
        if response.status_code in self.config.retry.retry_statuses:
            return self._failed(replica, await _read_status_failure(response))
        if response.status_code < 300 and RESPONSE_ID_HEADER in response.headers:
            self.homes.note(response.headers[RESPONSE_ID_HEADER], replica.name)
        if outbound.is_stream and response.headers.get("content-type", "").startswith("text/event-stream"):
            return await self._open_stream(replica, response, outbound)
        return await self._unary(replica, response, outbound)

    def _failed(self, replica: Replica, failure: Failure) -> Failure:
        if failure.status == 503:
            replica.is_ready = False  # loading or draining: out of rotation until a probe passes
        self.accounting.end(replica, failure.verdict)
        log.info("attempt on %s failed: %s", replica.name, failure.message)
        return failure

    async def _unary(self, replica: Replica, response: httpx.Response, outbound: Outbound) -> Response | Failure:
        try:
            body = await response.aread()
        except httpx.HTTPError as exc:
            return self._failed(replica, transport_failure(exc, replica.name))
        finally:
            await response.aclose()
        is_healthy = response.status_code < 500
        self.accounting.end(replica, Verdict.HEALTHY if is_healthy else Verdict.BROKEN)
        outcome = "success" if response.status_code < 400 else "client_error" if is_healthy else "failed"
        self.accounting.finish(replica, outcome, outbound.received, is_stream=outbound.is_stream)
        return Response(body, status_code=response.status_code, headers=_returned_headers(response, replica))

    async def _open_stream(self, replica: Replica, response: httpx.Response,
                           outbound: Outbound) -> Response | Failure:
        """Read and hold events until one carries output; a failure before that is retried."""
        events = split_events(response.aiter_bytes())
        held: list[bytes] = []
        try:
            async for event in events:
                if is_error_event(event):
                    raise _NoOutput("the replica's stream failed before any output")
                held.append(event)
                if carries_output(event):
                    break
            else:
                raise _NoOutput("the replica's stream ended before any output")
        except (httpx.HTTPError, _NoOutput) as exc:
            await response.aclose()
            return self._failed(replica, Failure("stream_before_output", 502, f"{replica.name}: {exc}"))
        relay = StreamRelay(self.accounting, replica, response, events, held, outbound.received)
        return RelayResponse(relay, _returned_headers(response, replica))

    def _give_up(self, failure: Failure | None, replica: Replica | None, outbound: Outbound) -> Response:
        stream = outbound.is_stream
        if failure is None:
            self.accounting.finish(None, "no_replica", outbound.received, is_stream=stream)
            body = error_body("no replica is ready to serve: retry shortly", "no_replica", 503)
            return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
        self.accounting.finish(replica, "failed", outbound.received, is_stream=stream)
        headers = {REPLICA_HEADER: replica.name} if replica is not None else {}
        if failure.body is not None:  # the replica's own words (429 with Retry-After, 503 draining)
            return Response(failure.body, status_code=failure.status, headers={**failure.headers, **headers})
        body = error_body(f"every attempt failed; last: {failure.message}", failure.reason, failure.status)
        return JSONResponse(body, status_code=failure.status, headers=headers)


class _NoOutput(Exception):
    pass


async def _read_status_failure(response: httpx.Response) -> Failure:
    try:
        body = await response.aread()
    except httpx.HTTPError:
        body = b""
    finally:
        await response.aclose()
    return status_failure(response.status_code, body, response.headers)


def _returned_headers(response: httpx.Response, replica: Replica) -> dict[str, str]:
    headers = {name: response.headers[name] for name in _RETURNED_HEADERS if name in response.headers}
    return {**headers, REPLICA_HEADER: replica.name}


def _json_or_none(body: bytes) -> object:
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None  # not JSON: forwarded as-is, routed without a key
