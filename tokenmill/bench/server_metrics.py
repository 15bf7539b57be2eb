"""Where the time went on the server: queue vs prefill vs decode, exact where the server says.

Two sources, and the result names which (`method`):

- `exact`: a tokenmill server returns each request's phase times with its usage (the `tokenmill`
  extension, read by client.py into `RequestRecord.server_s`); percentiles are numpy's over those
  values, as for the client-side metrics.
- `buckets` (vLLM, with its `vllm:` prefix, or a server without the extension): the per-phase
  Prometheus histograms, scraped before and after the run and subtracted. Quantiles are then
  PromQL's `histogram_quantile` (linear inside a bucket) capped by what the bucket's sum allows:
  approximate, only as fine as the buckets (0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5 s...).

The scrape also gives the prefix-cache hit rate, whichever the phase source.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.bench.records import RequestRecord
from tokenmill.bench.stats import PERCENTILES, summarize

PREFIXES = ("tokenmill:", "vllm:")
PHASES = {"queue": "request_queue_time_seconds", "prefill": "request_prefill_time_seconds",
          "decode": "request_decode_time_seconds", "ttft": "time_to_first_token_seconds",
          "e2e": "e2e_request_latency_seconds"}
SETTLE_TIMEOUT_S = 3.0
SETTLE_POLL_S = 0.05
PREFIX_CACHE = ("prefix_cache_queries_total", "prefix_cache_hits_total")

SampleKey = tuple[str, float | None]  # (sample name, `le` bound or None), summed over other labels
Samples = dict[SampleKey, float]


@dataclass(slots=True, frozen=True)
class Histogram:
    buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ending with +Inf
    sum: float

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def minus(self, earlier: Histogram) -> Histogram:
        before = dict(earlier.buckets)
        return Histogram(tuple((le, n - before.get(le, 0.0)) for le, n in self.buckets), self.sum - earlier.sum)

    def quantile(self, q: float) -> float | None:
        """PromQL histogram_quantile, capped by the sum; None without observations."""
        interpolated = self.interpolated_quantile(q)
        if interpolated is None:
            return None
        # The k-th smallest of N non-negative observations is at most sum / (N - k + 1): the N - k + 1
        # observations from it upwards are each at least as large. When every observation sits in
        # the first bucket (queue times of 0.1 ms under a 300 ms bound) interpolation alone says
        # P50 150 ms; this bound says at most 2 x the mean.
        k = max(1, math.ceil(q * self.count))
        return min(interpolated, self.sum / max(1.0, self.count - k + 1))

    def interpolated_quantile(self, q: float) -> float | None:
        """PromQL histogram_quantile: None without observations; the top finite bound if it lands in +Inf."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for upper, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(upper):
                    return lower
                return lower + (upper - lower) * (rank - below) / (cumulative - below)
            lower, below = upper, cumulative
        return lower

    def summary(self) -> dict[str, float | None]:
        mean = self.sum / self.count if self.count > 0 else None
        return {"count": self.count, "mean": mean, **{f"p{p}": self.quantile(p / 100) for p in PERCENTILES}}


async def scrape(client: httpx.AsyncClient, base_url: str) -> Samples | None:
    """The server's samples, or None when it has no Prometheus endpoint."""
    try:
        response = await client.get(base_url + "/metrics")
        if response.status_code != 200:
            return None
        return parse(response.text)
    except (httpx.HTTPError, ValueError):
        return None


async def scrape_settled(client: httpx.AsyncClient, base_url: str, min_finished: float = 0.0) -> Samples | None:
    """Scrapes until the server has booked every finished request: a stream can end a few
    milliseconds before the server records the request's histograms, so we wait until the count
    of finished requests reaches `min_finished` and holds still across two scrapes."""
    previous: float | None = None
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        samples = await scrape(client, base_url)
        count = finished_count(samples)
        if count is None or (count == previous and count >= min_finished) or time.monotonic() > deadline:
            return samples
        previous = count
        await asyncio.sleep(SETTLE_POLL_S)


def finished_count(samples: Samples | None) -> float | None:
    prefix = _prefix(samples) if samples is not None else None
    e2e = histogram(samples, prefix + PHASES["e2e"]) if samples is not None and prefix is not None else None
    return e2e.count if e2e is not None else None


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            le = sample.labels.get("le")
            key = (sample.name, float(le) if le is not None else None)
            samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def histogram(samples: Samples, name: str) -> Histogram | None:
    buckets = sorted((le, n) for (sample, le), n in samples.items() if sample == f"{name}_bucket" and le is not None)
    if not buckets:
        return None
    return Histogram(tuple(buckets), samples.get((f"{name}_sum", None), 0.0))


def _prefix(samples: Samples) -> str | None:
    return next((p for p in PREFIXES if any(name.startswith(p + PHASES["queue"]) for name, _ in samples)), None)


EXACT = "exact"
BUCKETS = "buckets"


def phase_breakdown(before: Samples | None, after: Samples | None,
                    records: list[RequestRecord] | None = None) -> dict[str, Any] | None:
    """Per phase: count, mean and percentiles of this run's requests; None if the target reports no phases.

    Exact when every successful request carried the server's phase times, else from the buckets.
    """
    prefix = _prefix(after) if after is not None else None
    exact = exact_phases(records or [])
    if exact is not None:
        return {"source": "tokenmill", "method": EXACT, "phases_s": exact,
                "prefix_cache_hit_rate": _hit_rate(before, after, prefix)}
    if before is None or after is None or prefix is None:
        return None
    phases: dict[str, Any] = {}
    for phase, name in PHASES.items():
        now, then = histogram(after, prefix + name), histogram(before, prefix + name)
        if now is not None:
            phases[phase] = (now.minus(then) if then is not None else now).summary()
    return {"source": prefix.rstrip(":"), "method": BUCKETS, "phases_s": phases,
            "prefix_cache_hit_rate": _hit_rate(before, after, prefix)}


def exact_phases(records: list[RequestRecord]) -> dict[str, Any] | None:
    """Summaries of the server's own per-request times; None unless every success has them."""
    done = [r for r in records if r.is_success]
    if not done or any(r.server_s is None for r in done):
        return None
    phases: dict[str, Any] = {}
    for phase in PHASES:
        values = [v for r in done if r.server_s is not None and (v := r.server_s.get(f"{phase}_s")) is not None]
        if values:
            phases[phase] = summarize(values).as_dict()
    return phases


def _hit_rate(before: Samples | None, after: Samples | None, prefix: str | None) -> float | None:
    if before is None or after is None or prefix is None:
        return None
    queries, hits = (after.get((prefix + n, None), 0.0) - before.get((prefix + n, None), 0.0) for n in PREFIX_CACHE)
    return hits / queries if queries > 0 else None
