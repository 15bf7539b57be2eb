"""Service classes: what a request is willing to wait for (docs/workload_classes.md).

`interactive` requests (a person waits: chat) have TTFT and TPOT targets the scheduler protects;
`batch` requests (offline jobs) only want throughput and fill the capacity interactive work leaves;
`standard` sits between. The class is orthogonal to `priority`, which orders requests within a class.
"""

from __future__ import annotations

import enum

from tokenmill.errors import RequestValidationError


class ServiceClass(enum.Enum):
    INTERACTIVE = "interactive"
    STANDARD = "standard"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        """0 = most latency-sensitive; batch is preempted first and scheduled last."""
        return _RANKS[self]


_RANKS = {ServiceClass.INTERACTIVE: 0, ServiceClass.STANDARD: 1, ServiceClass.BATCH: 2}

# Our names, plus OpenAI's `service_tier` values mapped onto them.
SERVICE_TIERS: dict[str, ServiceClass] = {
    "interactive": ServiceClass.INTERACTIVE,
    "standard": ServiceClass.STANDARD,
    "batch": ServiceClass.BATCH,
    "priority": ServiceClass.INTERACTIVE,
    "default": ServiceClass.STANDARD,
    "auto": ServiceClass.STANDARD,
    "flex": ServiceClass.BATCH,
}


def parse_service_tier(value: str) -> ServiceClass:
    """A `service_tier` body field / header value → its class, or a one-line error naming the choices."""
    try:
        return SERVICE_TIERS[value.strip().lower()]
    except KeyError:
        raise RequestValidationError(
            f"service_tier '{value}' is not supported: use one of {', '.join(SERVICE_TIERS)}") from None
