"""The speculation controller's step-time predictor T(n): measured averages per token count, a linear fit beyond."""

from __future__ import annotations

import bisect


class StepTimePredictor:
    """Step time for a token count over one snapshot of the measured counts (SpecController.predict):
    measured there, else between the nearest measured counts, else the linear fit's slope from the
    nearest measured count (the fit itself when none is). By bisection: a plan asks it for every row
    count up to the batch's proposals (hundreds at batch 64)."""

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
