"""Decides, each step, which requests propose and how many tokens: speculate only where it pays.

Two rules, both about goodput (tokens emitted per second), not acceptance:
  * per request: a request whose recent acceptance (a moving average the scheduler keeps) falls
    below min_acceptance stops proposing; it probes again with one draft every probe_interval steps.
    A request the proposer has nothing for (the n-gram proposer found no match) is not counted.
  * per step: emitted tokens per second with and without speculation, from the measured time of
    decode-only steps as a function of their token count T(n): a moving average per token count
    where that count was measured, interpolated between measured counts, and a linear fit
    T(n) = a + b n of all samples beyond them. (The linear fit alone misjudged: on a 2-core CPU with
    integer-quantized weights, 8 rows cost 3.2x 2 rows against the 2x the fit drew from batch-1
    steps, and two requests speculating ran at 0.76x.) Each request's j-th proposal is worth its
    expected gain g_ij, the chance that verification gets to it and accepts it: from the proposer's
    bucket for the request (acceptance.py: position by position, per kind of proposal, e.g. the
    n-gram match length) or, for proposals without one (a draft model), a_i^j with a_i the
    request's recent acceptance. Gains fall with j, so the R proposals worth most over the whole
    batch are a prefix of each request's, and the step proposes the R in 0..sum of caps with the most
        (n + sum of the R largest gains) / T(n + R)       (n decoding requests; R = 0: n / T(n))
    A memory-bound step (dense weights at batch 1 on CPU: every weight streamed once) has b ≈ 0 and
    proposals are nearly free; where extra rows cost (integer-quantized weights, large batches) only
    the likeliest proposals pay, or none. Until the fit has seen a spread of token counts, the step
    proposes K iff n <= max_batch_size. Every _EXPLORE_EVERY plans, the option not chosen (plain if
    speculating, one proposal a request if not) runs once when its token count has few measurements
    or none recent, so both sides of the comparison stay measured as the batch and its contexts change.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.config import SpeculativeConfig
from tokenmill.engine.request import Request
from tokenmill.engine.spec.acceptance import AcceptanceModel

_MIN_DRAFTS_TO_JUDGE = 4  # drafts before a request's acceptance is trusted
_MIN_SAMPLES = 16  # steps before the cost fit is trusted
_EXPLORE_EVERY = 16  # every so many steps try another k, so token counts spread and stay measured
_EWMA = 0.25  # weight of the newest step in a token count's moving average
_MIN_COUNT_SAMPLES = 2  # measurements before a token count's average is used
_STALE_PLANS = 64  # a count last measured this many plans ago is measured again (contexts grow)
# Speculate only for a predicted gain of at least this much: at batch 32 on a 2-core CPU every row
# costs and the best plan's predicted edge was a few percent, inside the step-time averages' noise,
# and speculating on it measured 0.93x of plain where the old one-k-for-all plan measured 0.96x.
_MIN_GAIN = 0.05


def geometric_gains(acceptance: float, k: int) -> list[float]:
    """Gains of proposals 1..k when each is accepted with probability `acceptance` independently of
    the others (no bucket: a request's recent acceptance); a verification emits 1 + their sum."""
    return [acceptance ** j for j in range(1, k + 1)]


@dataclass(slots=True)
class _Pending:
    """A request's draft planned this step: its bucket and its counters before verification."""

    bucket: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int


class SpecController:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.samples: deque[tuple[int, float]] = deque(maxlen=256)  # (tokens in the step, step time s)
        # tokens → (moving average of step time s, samples, the plan count at the latest sample)
        self.by_count: dict[int, tuple[float, int, int]] = {}
        self.acceptance = AcceptanceModel(config.num_speculative_tokens)
        self.is_on = True  # the last step's decision, for the stats
        self._cooldown: dict[str, int] = {}
        self._pending: dict[str, _Pending] = {}
        self._num_plans = 0

    def observe(self, num_tokens: int, step_time_s: float) -> None:
        if num_tokens > 0:
            self.samples.append((num_tokens, step_time_s))
            mean, seen, _ = self.by_count.get(num_tokens, (step_time_s, 0, 0))
            self.by_count[num_tokens] = ((1 - _EWMA) * mean + _EWMA * step_time_s if seen else step_time_s,
                                         seen + 1, self._num_plans)

    def measured(self) -> dict[int, float]:
        """Token counts measured often enough to trust → their moving-average step time."""
        return {n: t for n, (t, seen, _) in self.by_count.items() if seen >= _MIN_COUNT_SAMPLES}

    def predict(self, num_tokens: int, fit: tuple[float, float], measured: dict[int, float] | None = None) -> float:
        """Step time for `num_tokens`: measured there, else between the nearest measured counts,
        else the fit's slope from the nearest measured count (the fit itself when none is).
        `measured`: self.measured(), when the caller predicts several counts at once."""
        return _Predictor(fit, self.measured() if measured is None else measured)(num_tokens)

    def plan(self, requests: list[Request], buckets: Sequence[int | None] | None = None) -> list[int]:
        """Proposals per request. `buckets`: the proposer's kind of proposal per request (None: none;
        0: the proposer has nothing to offer it), see acceptance.py."""
        buckets = list(buckets) if buckets is not None else [None] * len(requests)
        self._learn(requests)
        if not self.config.adaptive:
            ks = [0 if b == 0 else self.config.num_speculative_tokens for b in buckets]
        else:
            caps = [0 if b == 0 else self._k_for(r) for r, b in zip(requests, buckets, strict=True)]
            ks = self._allocate(requests, buckets, caps) if any(caps) else caps
            self.is_on = any(ks)
        for request, bucket, k in zip(requests, buckets, ks, strict=True):
            if k and bucket is not None:
                stats = request.spec_stats
                self._pending[request.request_id] = _Pending(bucket, stats.num_drafts, stats.num_draft_tokens,
                                                             stats.num_accepted_tokens)
        return ks

    def _learn(self, requests: list[Request]) -> None:
        """Score last step's drafts into the acceptance model, from the requests' counters: a draft
        the step did not verify (the request was skipped or preempted) teaches nothing."""
        for request in requests:
            pending = self._pending.pop(request.request_id, None)
            stats = request.spec_stats
            if pending is not None and stats.num_drafts == pending.num_drafts + 1:
                self.acceptance.record(pending.bucket, stats.num_draft_tokens - pending.num_draft_tokens,
                                       stats.num_accepted_tokens - pending.num_accepted_tokens)

    def _k_for(self, request: Request) -> int:
        stats, rid = request.spec_stats, request.request_id
        if stats.num_drafts < _MIN_DRAFTS_TO_JUDGE or stats.recent_acceptance >= self.config.min_acceptance:
            self._cooldown.pop(rid, None)
            return self.config.num_speculative_tokens
        left = self._cooldown.get(rid, self.config.probe_interval)
        if left <= 0:
            self._cooldown.pop(rid)
            return self.config.num_speculative_tokens  # probe: one draft to re-measure acceptance
        self._cooldown[rid] = left - 1
        return 0

    def _gains(self, request: Request, bucket: int | None, k: int) -> list[float]:
        if bucket is None:
            return geometric_gains(request.spec_stats.recent_acceptance, k)
        return self.acceptance.gains(bucket, k)

    def _allocate(self, requests: list[Request], buckets: list[int | None], caps: list[int]) -> list[int]:
        """Proposals per request (each at most its cap) that maximise emitted tokens per second."""
        n = len(requests)
        fit = self.cost_fit()
        self._num_plans += 1
        if fit is None:
            # A draft model always proposes K, so step sizes never vary and the fit never forms:
            # cycle through the smaller k now and then to measure what they cost.
            if n > self.config.max_batch_size:
                return [0] * n
            k = self.config.num_speculative_tokens
            if self._num_plans % _EXPLORE_EVERY == 0:
                k = (self._num_plans // _EXPLORE_EVERY) % self.config.num_speculative_tokens
            return [min(cap, k) for cap in caps]
        # Every request's proposal j by its gain; a request's gains fall with j, so the R best over the
        # batch take a prefix of each request's (the sort is stable, so equal gains keep j's order).
        ranked = sorted(((g, i) for i, (r, b, cap) in enumerate(zip(requests, buckets, caps, strict=True))
                         for g in self._gains(r, b, cap)), key=lambda e: -e[0])
        predict = _Predictor(fit, self.measured())
        plain_rate = n / max(predict(n), 1e-9)
        best_r, best_rate, emitted = 0, plain_rate, float(n)
        for rows, (gain, _) in enumerate(ranked, start=1):
            emitted += gain
            rate = emitted / max(predict(n + rows), 1e-9)
            if rate > best_rate:
                best_r, best_rate = rows, rate
        if best_rate < plain_rate * (1 + _MIN_GAIN):
            best_r = 0  # a predicted gain within the step-time estimates' noise is not worth its rows
        ks = [0] * n
        for _, i in ranked[:best_r]:
            ks[i] += 1
        if self._num_plans % _EXPLORE_EVERY == 0:
            # Not speculating, probe with one proposal a request: the nearest token count above the
            # plain step, which is what decides whether any pays, at a third of K = 3's cost when it
            # does not (a batch-32 probe with K = 3 cost 2.7x a plain step for 2x its tokens, measured).
            other = [0] * n if best_r else [min(cap, 1) for cap in caps]
            _, seen, latest = self.by_count.get(n + sum(other), (0.0, 0, 0))
            if seen < 2 * _MIN_COUNT_SAMPLES or self._num_plans - latest > _STALE_PLANS:
                return other
        return ks

    def cost_fit(self) -> tuple[float, float] | None:
        """Least-squares (a, b) of step time = a + b * tokens; None until the samples spread."""
        if len(self.samples) < _MIN_SAMPLES:
            return None
        xs = [float(x) for x, _ in self.samples]
        ys = [y for _, y in self.samples]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        if var < len(xs) * 0.25:  # token counts barely vary: the slope is noise
            return None
        b = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var, 0.0)
        return max(my - b * mx, 0.0), b

    def forget(self, request_id: str) -> None:
        self._cooldown.pop(request_id, None)
        self._pending.pop(request_id, None)


class _Predictor:
    """SpecController.predict over one snapshot of the measured counts, by bisection: a plan asks it for
    every row count up to the batch's proposals (hundreds at batch 64)."""

    def __init__(self, fit: tuple[float, float], measured: dict[int, float]) -> None:
        self.a, self.b = fit
        self.counts = sorted(measured)
        self.times = [measured[n] for n in self.counts]

    def __call__(self, num_tokens: int) -> float:
        counts, times = self.counts, self.times
        i = bisect.bisect_left(counts, num_tokens)
        if i < len(counts) and counts[i] == num_tokens:
            return times[i]
        if 0 < i < len(counts):
            below, above = counts[i - 1], counts[i]
            w = (num_tokens - below) / (above - below)
            return (1 - w) * times[i - 1] + w * times[i]
        if i > 0:
            return times[-1] + self.b * (num_tokens - counts[-1])
        if counts:
            return max(times[0] - self.b * (counts[0] - num_tokens), 0.0)
        return self.a + self.b * num_tokens
