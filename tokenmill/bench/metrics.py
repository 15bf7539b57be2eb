"""Run metrics from request records, with the definitions of vLLM's `vllm bench serve`.

- TTFT: send → first chunk carrying output; TPOT per request: (E2E - TTFT) / (output tokens - 1),
  only for requests with ≥ 2 output tokens; ITL: gaps between content chunks, pooled over requests.
- Throughputs divide totals of *successful* requests by the run's duration (first send → last
  answer, as vLLM's benchmark duration), so failures lower them.
- Goodput: successful requests per second that meet every given SLO; as in vLLM a request with
  fewer than 2 output tokens has TPOT 0 for this purpose. SLO attainment: the fraction of all
  requests (failed ones count as missed) that meet every SLO.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.bench.records import RequestRecord
from tokenmill.bench.stats import Summary, summarize

SECONDS_PER_HOUR = 3600.0


@dataclass(slots=True, frozen=True)
class SLO:
    """Per-request latency bounds in seconds (None: no bound), and the percentile the run is judged at."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    percentile: int = 99

    @property
    def is_empty(self) -> bool:
        return self.ttft_s is None and self.tpot_s is None and self.e2e_s is None

    def bounds(self) -> dict[str, float]:
        named = {"ttft": self.ttft_s, "tpot": self.tpot_s, "e2e": self.e2e_s}
        return {name: bound for name, bound in named.items() if bound is not None}

    def is_met_by(self, record: RequestRecord) -> bool:
        if not record.is_success:
            return False
        values = {"ttft": record.ttft_s, "tpot": record.tpot_s or 0.0, "e2e": record.e2e_s}
        return all((values[name] or 0.0) <= bound for name, bound in self.bounds().items())


@dataclass(slots=True, frozen=True)
class SLOCheck:
    """Run-level verdict on one bound: is the chosen percentile of the metric within it?

    The percentile is over successful requests; a failed request never got its answer, as if
    infinitely slow, so the check also fails when failures alone fill the tail (P99: > 1% failed).
    """

    metric: str
    percentile: int
    bound_s: float
    value_s: float | None
    failed_fraction: float = 0.0

    @property
    def is_met(self) -> bool:
        tail_fraction = (100 - self.percentile) / 100
        return self.value_s is not None and self.value_s <= self.bound_s and self.failed_fraction <= tail_fraction


@dataclass(slots=True)
class BenchMetrics:
    num_requests: int
    num_completed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: Summary
    tpot: Summary
    itl: Summary
    e2e: Summary
    output_tokens: Summary
    max_concurrency: int
    errors: dict[str, int] = field(default_factory=dict)
    goodput: float | None = None
    slo_attainment: float | None = None
    slo_checks: list[SLOCheck] = field(default_factory=list)
    usd_per_million_output_tokens: float | None = None

    @property
    def num_failed(self) -> int:
        return self.num_requests - self.num_completed

    @property
    def is_slo_met(self) -> bool | None:
        return all(check.is_met for check in self.slo_checks) if self.slo_checks else None

    def to_json(self) -> dict[str, Any]:
        return {
            "num_requests": self.num_requests, "num_completed": self.num_completed, "num_failed": self.num_failed,
            "duration_s": self.duration_s, "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens, "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput, "total_token_throughput": self.total_token_throughput,
            "goodput": self.goodput, "slo_attainment": self.slo_attainment, "is_slo_met": self.is_slo_met,
            "slo_checks": [_check_json(check) for check in self.slo_checks],
            "ttft_s": self.ttft.as_dict(), "tpot_s": self.tpot.as_dict(), "itl_s": self.itl.as_dict(),
            "e2e_s": self.e2e.as_dict(), "output_tokens": self.output_tokens.as_dict(),
            "max_concurrency": self.max_concurrency, "errors": self.errors,
            "usd_per_million_output_tokens": self.usd_per_million_output_tokens,
        }


def _check_json(check: SLOCheck) -> dict[str, Any]:
    return {"metric": check.metric, "percentile": check.percentile, "bound_s": check.bound_s,
            "value_s": check.value_s, "failed_fraction": check.failed_fraction, "is_met": check.is_met}


def compute_metrics(records: Sequence[RequestRecord], duration_s: float, slo: SLO | None = None,
                    usd_per_hour: float | None = None) -> BenchMetrics:
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    done = [r for r in records if r.is_success]
    total_in = sum(r.prompt_tokens or 0 for r in done)
    total_out = sum(r.output_tokens for r in done)
    metrics = BenchMetrics(
        num_requests=len(records), num_completed=len(done), duration_s=duration_s,
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=len(done) / duration_s, output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        ttft=summarize([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot=summarize([t for r in done if (t := r.tpot_s) is not None]),
        itl=summarize([gap for r in done for gap in r.itl_s]),
        e2e=summarize([r.e2e_s for r in done if r.e2e_s is not None]),
        output_tokens=summarize([float(r.output_tokens) for r in done]),
        max_concurrency=max_concurrency(records), errors=errors_by_kind(records),
        usd_per_million_output_tokens=usd_per_million_tokens(usd_per_hour, total_out / duration_s),
    )
    if slo is not None and not slo.is_empty:
        _apply_slo(metrics, records, slo)
    return metrics


def _apply_slo(metrics: BenchMetrics, records: Sequence[RequestRecord], slo: SLO) -> None:
    num_good = sum(slo.is_met_by(r) for r in records)
    metrics.goodput = num_good / metrics.duration_s
    metrics.slo_attainment = num_good / len(records) if records else None
    summaries = {"ttft": metrics.ttft, "tpot": metrics.tpot, "e2e": metrics.e2e}
    failed_fraction = metrics.num_failed / metrics.num_requests if metrics.num_requests else 0.0
    metrics.slo_checks = [SLOCheck(name, slo.percentile, bound, summaries[name].percentile(slo.percentile),
                                   failed_fraction) for name, bound in slo.bounds().items()]


def errors_by_kind(records: Sequence[RequestRecord]) -> dict[str, int]:
    return dict(sorted(Counter(r.error_kind for r in records if r.error_kind is not None).items()))


def max_concurrency(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight at once (a request ending at t no longer overlaps one starting at t)."""
    events = sorted((t, delta) for r in records if r.start_s is not None and r.end_s is not None
                    for t, delta in ((r.start_s, 1), (r.end_s, -1)))
    in_flight = peak = 0
    for _, delta in events:  # at equal times -1 sorts first
        in_flight += delta
        peak = max(peak, in_flight)
    return peak


def usd_per_million_tokens(usd_per_hour: float | None, tokens_per_s: float) -> float | None:
    """A machine billed by the hour, kept busy at this rate: dollars per million tokens."""
    if usd_per_hour is None or tokens_per_s <= 0:
        return None
    return usd_per_hour / (tokens_per_s * SECONDS_PER_HOUR) * 1e6
