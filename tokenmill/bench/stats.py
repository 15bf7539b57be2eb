"""Distribution summaries as `vllm bench serve` prints them: mean, percentiles (numpy's default
linear interpolation) and max."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass(slots=True, frozen=True)
class Summary:
    """Seconds (or whatever unit the samples carry); every field is None when there are no samples."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p95: float | None
    p99: float | None
    max: float | None

    def percentile(self, p: int) -> float | None:
        value: float | None = getattr(self, f"p{p}")
        return value

    def as_dict(self) -> dict[str, float | int | None]:
        return {"count": self.count, "mean": self.mean, "p50": self.p50, "p90": self.p90, "p95": self.p95,
                "p99": self.p99, "max": self.max}


EMPTY = Summary(0, None, None, None, None, None, None)


def summarize(samples: Sequence[float]) -> Summary:
    # vLLM reports 0 for an empty list (np.percentile(ttfts or 0, p)); "no samples" is not a latency
    # of zero, so we report None and let the table print "-".
    if not samples:
        return EMPTY
    values = np.asarray(samples, dtype=np.float64)
    p50, p90, p95, p99 = (float(v) for v in np.percentile(values, PERCENTILES))  # method="linear"
    return Summary(len(values), float(values.mean()), p50, p90, p95, p99, float(values.max()))
