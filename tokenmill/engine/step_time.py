"""Step time as a function of a step's tokens and sequences, fitted online from measured steps.

    T(tokens, seqs) = base + per_token * tokens + per_seq * seqs

base: what every step pays once (weights streamed through the cores, step bookkeeping);
per_token: one more query row through the GEMMs; per_seq: one more sequence (its attention over
its context, its sampling, its host-side tensors). The SLO-aware scheduler asks the fit how much
work fits under a class's TPOT target (StepTimeLimit).

The fit is exponentially weighted least squares over decayed sums (S = sum w x x^T, r = sum w x y,
w = decay^age), so old steps fade as the machine's load changes, each observe() is O(1) and the
solve is a 3x3 system. Non-negative: the best of the 7 subsets of coefficients (the others held
at 0) whose solution is all >= 0, by the weighted residual. A tiny ridge keeps collinear samples
(decode-only steps: tokens == seqs) solvable; it splits the cost between the collinear terms,
which predicts those steps exactly and leans towards over-predicting larger steps (conservative).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass

_RIDGE = 1e-9  # relative to the mean squared feature: only breaks exact collinearity
_SUBSETS = [s for n in (3, 2, 1) for s in itertools.combinations(range(3), n)]


@dataclass(frozen=True, slots=True)
class StepTimeFit:
    """The model's current coefficients (seconds) and how many steps it has seen."""

    base_s: float
    per_token_s: float
    per_seq_s: float
    num_samples: int

    def predict(self, num_tokens: int, num_seqs: int) -> float:
        return self.base_s + self.per_token_s * num_tokens + self.per_seq_s * num_seqs


class StepTimeModel(ABC):
    @abstractmethod
    def observe(self, num_tokens: int, num_seqs: int, step_time_s: float) -> None: ...

    @abstractmethod
    def fit(self) -> StepTimeFit | None:
        """The current fit, or None until it is trusted (then the scheduler falls back)."""


class FixedStepTimeModel(StepTimeModel):
    """A known fit that never changes (tests; a replica measured offline)."""

    def __init__(self, base_s: float, per_token_s: float, per_seq_s: float) -> None:
        self._fit = StepTimeFit(base_s, per_token_s, per_seq_s, 0)

    def observe(self, num_tokens: int, num_seqs: int, step_time_s: float) -> None:
        pass

    def fit(self) -> StepTimeFit | None:
        return self._fit


class OnlineStepTimeModel(StepTimeModel):
    def __init__(self, min_samples: int = 16, decay: float = 0.98) -> None:
        self.min_samples = min_samples
        self.decay = decay
        self.num_samples = 0
        # Plain floats, not numpy: a 3x3 system per step costs microseconds this way, not a millisecond.
        self._sxx = [[0.0] * 3 for _ in range(3)]
        self._sxy = [0.0] * 3
        self._syy = 0.0
        self._fit: StepTimeFit | None = None

    def observe(self, num_tokens: int, num_seqs: int, step_time_s: float) -> None:
        if num_tokens <= 0 or step_time_s <= 0:
            return
        x, d = (1.0, float(num_tokens), float(num_seqs)), self.decay
        for i in range(3):
            row = self._sxx[i]
            for j in range(3):
                row[j] = d * row[j] + x[i] * x[j]
            self._sxy[i] = d * self._sxy[i] + x[i] * step_time_s
        self._syy = d * self._syy + step_time_s * step_time_s
        self.num_samples += 1
        self._fit = None  # recomputed on demand

    def fit(self) -> StepTimeFit | None:
        if self.num_samples < self.min_samples:
            return None
        if self._fit is None:
            base, per_token, per_seq = self._solve()
            self._fit = StepTimeFit(base, per_token, per_seq, self.num_samples)
        return self._fit

    def _solve(self) -> tuple[float, float, float]:
        ridge = _RIDGE * (self._sxx[0][0] + self._sxx[1][1] + self._sxx[2][2]) / 3
        best, best_sse = [0.0, 0.0, 0.0], self._syy
        for subset in _SUBSETS:  # the full set first: usually already non-negative
            coef = _solve([[self._sxx[i][j] + (ridge if i == j else 0.0) for j in subset] for i in subset],
                          [self._sxy[i] for i in subset])
            if coef is None or min(coef) < 0:
                continue
            theta = [0.0, 0.0, 0.0]
            for i, c in zip(subset, coef, strict=True):
                theta[i] = c
            if len(subset) == 3:
                best = theta
                break
            sse = self._syy - 2 * sum(theta[i] * self._sxy[i] for i in range(3)) + sum(
                theta[i] * self._sxx[i][j] * theta[j] for i in range(3) for j in range(3))
            if sse < best_sse:
                best, best_sse = theta, sse
        return best[0], best[1], best[2]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


class StepTimeLimit:
    """How much more work one step may take before it breaks a TPOT target.

    With a fit: predicted time <= limit_s. Without one (too few samples): a conservative token
    count, unfitted_tokens for the whole step, whatever the hardware.
    """

    def __init__(self, limit_s: float, fit: StepTimeFit | None, unfitted_tokens: int) -> None:
        self.limit_s = limit_s
        self.fit = fit
        self.unfitted_tokens = unfitted_tokens

    def max_new_tokens(self, step_tokens: int, step_seqs: int) -> int:
        """Tokens one more sequence may add to a step already holding step_tokens / step_seqs."""
        if self.fit is None:
            return max(self.unfitted_tokens - step_tokens, 0)
        fit = self.fit
        slack = self.limit_s - fit.predict(step_tokens, step_seqs + 1)
        if slack < 0:
            return 0
        if fit.per_token_s <= 0:
            return 1 << 30
        return int(slack / fit.per_token_s + 1e-9)

    def predict(self, step_tokens: int, step_seqs: int) -> float | None:
        return None if self.fit is None else self.fit.predict(step_tokens, step_seqs)
