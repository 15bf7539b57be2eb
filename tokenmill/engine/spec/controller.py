"""Decides, each step, which requests propose and how many tokens: speculate only where it pays.

Two rules, both about goodput (tokens emitted per second), not acceptance:
  * per request: a request whose recent acceptance (a moving average the scheduler keeps) falls
    below min_acceptance stops proposing; it probes again with one draft every probe_interval steps.
  * per step: emitted tokens per second with and without speculation, from the measured time of
    decode-only steps as a function of their token count T(n): a moving average per token count
    where that count was measured, interpolated between measured counts, and a linear fit
    T(n) = a + b n of all samples beyond them. (The linear fit alone misjudged: on a 2-core CPU with
    integer-quantized weights, 8 rows cost 3.2x 2 rows against the 2x the fit drew from batch-1
    steps, and two requests speculating ran at 0.76x.) Request i
    proposing k tokens at acceptance a_i emits E_i = (1 - a_i^(k + 1)) / (1 - a_i) tokens (accepted
    run plus the target's own token); the step proposes the k in 0..K with the most
        sum E_i / T(n + m k)        (n decoding requests, m of them proposing; k = 0: n / T(n))
    A memory-bound step (dense weights at batch 1 on CPU: every weight streamed once) has b ≈ 0 and
    the largest k wins; where extra rows cost (integer-quantized weights, large batches) a smaller k
    or none. Until the fit has seen a spread of token counts, the step proposes K iff
    n <= max_batch_size. Every _EXPLORE_EVERY plans, the option not chosen (plain if speculating,
    k = 1 if not) runs once when its token count has few measurements or none recent, so both sides of
    the comparison stay measured as the batch and its contexts change.
"""

from __future__ import annotations

from collections import deque

from tokenmill.config import SpeculativeConfig
from tokenmill.engine.request import Request

_MIN_DRAFTS_TO_JUDGE = 4  # drafts before a request's acceptance is trusted
_MIN_SAMPLES = 16  # steps before the cost fit is trusted
_EXPLORE_EVERY = 16  # every so many steps try another k, so token counts spread and stay measured
_EWMA = 0.25  # weight of the newest step in a token count's moving average
_MIN_COUNT_SAMPLES = 2  # measurements before a token count's average is used
_STALE_PLANS = 64  # a count last measured this many plans ago is measured again (contexts grow)


def expected_emitted(acceptance: float, k: int) -> float:
    """Tokens one verification emits when each of k proposals is accepted with probability `acceptance`."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


class SpecController:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.samples: deque[tuple[int, float]] = deque(maxlen=256)  # (tokens in the step, step time s)
        # tokens → (moving average of step time s, samples, the plan count at the latest sample)
        self.by_count: dict[int, tuple[float, int, int]] = {}
        self.is_on = True  # the last step's decision, for the stats
        self._cooldown: dict[str, int] = {}
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
        a, b = fit
        measured = self.measured() if measured is None else measured
        if num_tokens in measured:
            return measured[num_tokens]
        below = max((n for n in measured if n < num_tokens), default=None)
        above = min((n for n in measured if n > num_tokens), default=None)
        if below is not None and above is not None:
            w = (num_tokens - below) / (above - below)
            return (1 - w) * measured[below] + w * measured[above]
        if below is not None:
            return measured[below] + b * (num_tokens - below)
        if above is not None:
            return max(measured[above] - b * (above - num_tokens), 0.0)
        return a + b * num_tokens

    def plan(self, requests: list[Request]) -> list[int]:
        if not self.config.adaptive:
            return [self.config.num_speculative_tokens] * len(requests)
        ks = [self._k_for(r) for r in requests]
        best = self._best_k(requests, ks) if any(ks) else 0
        self.is_on = best > 0
        return [min(k, best) for k in ks]

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

    def _best_k(self, requests: list[Request], ks: list[int]) -> int:
        """The number of proposals per proposing request that maximises emitted tokens per second."""
        n = len(requests)
        fit = self.cost_fit()
        if fit is None:
            # A draft model always proposes K, so step sizes never vary and the fit never forms:
            # cycle through the smaller k now and then to measure what they cost.
            self._num_plans += 1
            if n <= self.config.max_batch_size and self._num_plans % _EXPLORE_EVERY == 0:
                return (self._num_plans // _EXPLORE_EVERY) % self.config.num_speculative_tokens
            return self.config.num_speculative_tokens if n <= self.config.max_batch_size else 0
        proposing = [r.spec_stats.recent_acceptance for r, k in zip(requests, ks, strict=True) if k]
        measured = self.measured()
        best_k, best_rate = 0, n / max(self.predict(n, fit, measured), 1e-9)
        for k in range(1, self.config.num_speculative_tokens + 1):
            emitted = n - len(proposing) + sum(expected_emitted(alpha, k) for alpha in proposing)
            rate = emitted / max(self.predict(n + k * len(proposing), fit, measured), 1e-9)
            if rate > best_rate:
                best_k, best_rate = k, rate
        self._num_plans += 1
        if self._num_plans % _EXPLORE_EVERY == 0:
            # Not speculating, probe with one proposal: the nearest token count above the plain step,
            # which is what decides whether any k pays, at a third of K = 3's cost when it does not
            # (a batch-32 probe with K = 3 cost 2.7x a plain step for 2x its tokens, measured).
            other = 0 if best_k else 1
            _, seen, latest = self.by_count.get(n + other * len(proposing), (0.0, 0, 0))
            if seen < 2 * _MIN_COUNT_SAMPLES or self._num_plans - latest > _STALE_PLANS:
                return other
        return best_k

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
