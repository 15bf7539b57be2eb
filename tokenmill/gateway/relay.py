"""Bookkeeping of attempts, and the relay of a committed stream from a replica to the client.

Once a stream has committed (its first output event went to the client) it cannot move to
another replica: a failure then ends the client's stream with one terminal error event and
`data: [DONE]`, so no client hangs or mistakes a cut stream for a finished one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import anyio
import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenmill.gateway.metrics import GatewayMetrics
from tokenmill.gateway.replica import Replica
from tokenmill.gateway.retry import Verdict
from tokenmill.gateway.sse import DONE, error_event, event_data, is_error_event

log = logging.getLogger(__name__)


class Accounting:
    """Outstanding counts, breaker verdicts and per-request metrics, kept in one place so that
    every path (success, retry, mid-stream failure, client gone) books the same way."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def begin(self, replica: Replica) -> None:
        replica.num_outstanding += 1
        replica.breaker.on_routed()
        self.metrics.attempts.labels(replica.name).inc()

    def end(self, replica: Replica, verdict: Verdict) -> None:
        replica.num_outstanding -= 1
        if verdict is Verdict.HEALTHY:
            replica.breaker.on_success()
        elif verdict is Verdict.NONE:
            replica.breaker.on_aborted()
        elif replica.breaker.on_failure():
            log.warning("replica %s ejected after %d consecutive failures", replica.name,
                        replica.breaker.num_consecutive_failures)
            self.metrics.ejections.labels(replica.name).inc()

    def finish(self, replica: Replica | None, outcome: str, received: float, *, is_stream: bool) -> None:
        self.metrics.on_outcome(replica, outcome)
        self.metrics.e2e_latency.labels("true" if is_stream else "false").observe(time.monotonic() - received)


class StreamRelay:
    """A committed stream: the held events, then the rest of the replica's events as they come."""

    def __init__(self, accounting: Accounting, replica: Replica, response: httpx.Response,
                 events: AsyncIterator[bytes], held: list[bytes], received: float) -> None:
        self.accounting = accounting
        self.replica = replica
        self.response = response
        self.events = events
        self.held = held
        self.received = received
        self._outcome: str | None = None
        self._verdict = Verdict.NONE
        self._is_closed = False

    async def body(self) -> AsyncIterator[bytes]:
        self.accounting.metrics.ttft.observe(time.monotonic() - self.received)
        for event in self.held:
            yield event
        try:
            async for event in self._rest():
                yield event
        except (httpx.HTTPError, _StreamCut) as exc:
            log.warning("stream from %s failed mid-way: %s", self.replica.name, exc or type(exc).__name__)
            self._settle("midstream_error", Verdict.BROKEN)
            yield error_event(f"replica {self.replica.name} failed mid-stream: {type(exc).__name__}: "
                              f"the response is incomplete", "replica_failed")
            yield DONE

    async def _rest(self) -> AsyncIterator[bytes]:
        if self.held and event_data(self.held[-1]) == b"[DONE]":
            self._settle("success", Verdict.HEALTHY)
            return
        async for event in self.events:
            if is_error_event(event):  # the replica's own error (engine failure): it ends the stream
                self._settle("midstream_error", Verdict.BROKEN)
            yield event
            if event_data(event) == b"[DONE]":
                self._settle("success", Verdict.HEALTHY)
                return
        raise _StreamCut("the stream ended without [DONE]")

    def _settle(self, outcome: str, verdict: Verdict) -> None:
        if self._outcome is None:  # the first word counts: an error event, then [DONE], is an error
            self._outcome, self._verdict = outcome, verdict

    async def close(self) -> None:
        """Idempotent; shielded, because it runs while the client's task is being cancelled."""
        if self._is_closed:
            return
        self._is_closed = True
        with anyio.CancelScope(shield=True):
            await self.response.aclose()  # closing the connection aborts the request on the replica
        self.accounting.end(self.replica, self._verdict)
        self.accounting.finish(self.replica, self._outcome or "client_closed", self.received, is_stream=True)


class _StreamCut(Exception):
    pass


class RelayResponse(StreamingResponse):
    """An SSE response that always closes its relay, even when the client left before the first byte."""

    media_type = "text/event-stream"

    def __init__(self, relay: StreamRelay, headers: dict[str, str]) -> None:
        super().__init__(relay.body(), headers={"Cache-Control": "no-cache", **headers})
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.close()
