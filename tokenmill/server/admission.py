"""Admission control: a bounded waiting queue in front of the engine, and draining on shutdown.

A request is *waiting* from admission until its first output arrives (it may sit in the
engine's queue or in prefill meanwhile), then *running* until its response is done. Only the
waiting part is bounded, by requests and by prompt tokens: running requests already hold KV
blocks and leave on their own. A request that does not fit is refused with 429 and
Retry-After before it costs anything; an admitted one is never dropped.

    admit() ──▶ waiting ──mark_started()──▶ running ──release()──▶ gone

Service classes: a share of both bounds (`interactive_reserve`) is open to interactive requests
only. Standard and batch requests together fill at most the rest, so however many batch jobs
are submitted, a chat request finds room (and the engine's scheduler runs it ahead of them):

    waiting requests  |<──── standard + batch: (1 - reserve) × max ────>|<─ interactive only ─>|
                      |<──────────────────── interactive: max ─────────────────────────────────>|
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from tokenmill.engine.service_class import ServiceClass
from tokenmill.server.errors import ApiError


@dataclass(slots=True)
class Ticket:
    """One admitted API request (all its `n` × prompts engine requests together)."""

    num_requests: int
    num_tokens: int
    service_class: ServiceClass = ServiceClass.STANDARD
    is_waiting: bool = True
    is_released: bool = False


class Admission:
    def __init__(self, max_waiting_requests: int, max_waiting_tokens: int, retry_after_s: int,
                 interactive_reserve: float = 0.0) -> None:
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_tokens = max_waiting_tokens
        self.retry_after_s = retry_after_s
        self.interactive_reserve = interactive_reserve
        self.num_waiting_requests = 0
        self.num_waiting_tokens = 0
        self.num_waiting_by_class = dict.fromkeys(ServiceClass, 0)  # requests, for the per-class gauge
        self.num_in_flight = 0  # admitted tickets not yet released
        self.is_draining = False

    def limits_for(self, service_class: ServiceClass) -> tuple[int, int]:
        """(requests, tokens) the class may fill; at least 1 of each, so no class is shut out."""
        if service_class is ServiceClass.INTERACTIVE:
            return self.max_waiting_requests, self.max_waiting_tokens
        share = 1.0 - self.interactive_reserve
        return (max(1, int(self.max_waiting_requests * share)), max(1, int(self.max_waiting_tokens * share)))

    def admit(self, num_requests: int, num_tokens: int,
              service_class: ServiceClass = ServiceClass.STANDARD) -> Ticket:
        """A ticket for the request, or an ApiError: 503 while draining, 400 if it can never fit, 429."""
        if self.is_draining:
            raise ApiError(503, "the server is shutting down and admits no new requests: retry on another replica",
                           code="draining")
        max_requests, max_tokens = self.limits_for(service_class)
        self._check_fits_at_all(num_requests, num_tokens, max_requests, max_tokens)
        if not self._has_room(num_requests, num_tokens, max_requests, max_tokens):
            raise ApiError(429, f"the server is overloaded ({self.num_waiting_requests} requests waiting, "
                           f"{service_class.value} requests may fill {max_requests}): "
                           f"retry after {self.retry_after_s} s", code="queue_full",
                           headers={"Retry-After": str(self.retry_after_s)})
        self.num_waiting_requests += num_requests
        self.num_waiting_tokens += num_tokens
        self.num_waiting_by_class[service_class] += num_requests
        self.num_in_flight += 1
        return Ticket(num_requests, num_tokens, service_class)

    @staticmethod
    def _check_fits_at_all(num_requests: int, num_tokens: int, max_requests: int, max_tokens: int) -> None:
        # Retrying would never help these, so they get a 400 rather than a 429.
        if num_requests > max_requests:
            raise ApiError(400, f"the request asks for {num_requests} sequences but the server queues at most "
                           f"{max_requests} of its class: lower n or send fewer prompts", param="n")
        if num_tokens > max_tokens:
            raise ApiError(400, f"the request's prompts hold {num_tokens} tokens but the server queues at most "
                           f"{max_tokens} of its class: send fewer or shorter prompts", param="prompt")

    def _has_room(self, num_requests: int, num_tokens: int, max_requests: int, max_tokens: int) -> bool:
        # The shared totals count against every class's bound: interactive requests fill the reserve
        # only once the other classes have filled their share.
        return (self.num_waiting_requests + num_requests <= max_requests
                and self.num_waiting_tokens + num_tokens <= max_tokens)

    def mark_started(self, ticket: Ticket) -> None:
        """The request produced its first output: it leaves the waiting queue."""
        if ticket.is_waiting and not ticket.is_released:
            ticket.is_waiting = False
            self.num_waiting_requests -= ticket.num_requests
            self.num_waiting_tokens -= ticket.num_tokens
            self.num_waiting_by_class[ticket.service_class] -= ticket.num_requests

    def release(self, ticket: Ticket) -> None:
        """The response is done (or failed, or the client left). Safe to call twice."""
        if ticket.is_released:
            return
        self.mark_started(ticket)
        ticket.is_released = True
        self.num_in_flight -= 1

    def start_draining(self) -> None:
        self.is_draining = True

    async def wait_idle(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Wait until no admitted request is left; False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True
