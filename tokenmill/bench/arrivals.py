"""Arrival processes: when each session (a single request, or the first turn of a conversation)
is sent, in seconds after the start of the run.

As in vLLM, the first arrival is at 0 and each later one follows a random interval. Gamma
intervals with shape = burstiness and scale = 1 / (rate × burstiness) keep the mean interval at
1 / rate while the coefficient of variation is 1 / sqrt(burstiness): burstiness 1 is Poisson,
< 1 burstier, > 1 more regular.
"""

from __future__ import annotations

import itertools
import json
import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from tokenmill.bench.errors import BenchError


@dataclass(slots=True, frozen=True)
class ArrivalOptions:
    """Every knob of every process, as the CLI collects them; each process reads its own."""

    rate: float = math.inf  # sessions per second
    burstiness: float = 1.0
    ramp_end_rate: float | None = None
    diurnal_amplitude: float = 0.5
    diurnal_period_s: float = 60.0
    trace_path: str | None = None


class ArrivalProcess(ABC):
    name: ClassVar[str]

    @abstractmethod
    def offsets_s(self, num: int, rng: np.random.Generator) -> list[float]:
        """`num` non-decreasing send times, the first at 0."""

    @classmethod
    @abstractmethod
    def from_options(cls, options: ArrivalOptions) -> ArrivalProcess: ...

    def describe(self) -> dict[str, Any]:
        fields: dict[str, Any] = asdict(self)  # type: ignore[call-overload]  # every process is a dataclass
        return {"process": self.name, **{k: (None if v == math.inf else v) for k, v in fields.items()}}


def _from_intervals(intervals: np.ndarray) -> list[float]:
    return [0.0, *np.cumsum(intervals[:-1]).tolist()] if len(intervals) else []


def _check_rate(rate: float) -> float:
    if not rate > 0:
        raise BenchError(f"the arrival rate must be > 0 requests/s (inf: all at once), got {rate}")
    return rate


@dataclass(slots=True, frozen=True)
class GammaArrivals(ArrivalProcess):
    name: ClassVar[str] = "gamma"
    rate: float
    burstiness: float = 1.0

    def offsets_s(self, num: int, rng: np.random.Generator) -> list[float]:
        if self.rate == math.inf:
            return [0.0] * num
        scale = 1.0 / (self.rate * self.burstiness)
        return _from_intervals(rng.gamma(shape=self.burstiness, scale=scale, size=num))

    @classmethod
    def from_options(cls, options: ArrivalOptions) -> ArrivalProcess:
        if not options.burstiness > 0:
            raise BenchError(f"burstiness must be > 0 (1: Poisson), got {options.burstiness}")
        return cls(_check_rate(options.rate), options.burstiness)


@dataclass(slots=True, frozen=True)
class PoissonArrivals(GammaArrivals):
    """Exponential intervals: gamma with burstiness 1 (and the same random draws as vLLM's)."""

    name: ClassVar[str] = "poisson"

    @classmethod
    def from_options(cls, options: ArrivalOptions) -> ArrivalProcess:
        return cls(_check_rate(options.rate), 1.0)


@dataclass(slots=True, frozen=True)
class ConstantArrivals(ArrivalProcess):
    name: ClassVar[str] = "constant"
    rate: float

    def offsets_s(self, num: int, rng: np.random.Generator) -> list[float]:
        return [i / self.rate for i in range(num)]

    @classmethod
    def from_options(cls, options: ArrivalOptions) -> ArrivalProcess:
        return cls(_check_rate(options.rate))


@dataclass(slots=True, frozen=True)
class BurstArrivals(ArrivalProcess):
    """Everything at once (vLLM's request rate inf); pair with a concurrency cap."""

    name: ClassVar[str] = "burst"

    def offsets_s(self, num: int, rng: np.random.Generator) -> list[float]:
        return [0.0] * num

    @classmethod
    def from_options(cls, options: ArrivalOptions) -> ArrivalProcess:
        return cls()


@dataclass(slots=True, frozen=True)
class RampArrivals(ArrivalProcess):
    """vLLM's linear ramp-up: the i-th interval is gamma at rate start + (end - start) · i / (n - 1)."""

    name: ClassVar[str] = "ramp"
    start_rate: float
    end_rate: float
    burstiness: float = 1.0

    def offsets_s(self, num: int, rng: np.random.Generator) -> list[float]:
        progress = np.arange(num) / max(num - 1, 1)
        rates = self.start_rate + (self.end_rate - self.start_rate) * progress
        return _from_intervals(rng.gamma(shape=self.burstiness, scale=1.0 / (rates * self.burstiness)))

    @classmethod
    def from_options(cls, options: ArrivalOptions) -> ArrivalProcess:
        if options.ramp_end_rate is None:
            raise BenchError("--arrival ramp needs --ramp-end-rate (it ramps from --rate to there)")
        return cls(_check_rate(options.rate), _check_rate(options.ramp_end_rate), options.burstiness)


@dataclass(slots=True, frozen=True)
class DiurnalArrivals(ArrivalProcess):
    """Poisson with rate(t) = rate · (1 + amplitude · sin(2πt / period)), sampled exactly by thinning:
    candidates at the peak rate, each kept with probability rate(t) / peak."""

    name: ClassVar[str] = "diurnal"
    rate: float
    amplitude: float = 0.5
    period_s: float = 60.0

    def offsets_s(self, num: int, rng: np.random.Generator) -> list[float]:
        peak = self.rate * (1 + self.amplitude)
        times: list[float] = []
        t = 0.0
        while len(times) < num:
            if rng.random() * peak <= self._rate_at(t):
                times.append(t)
            t += rng.exponential(1.0 / peak)
        return [x - times[0] for x in times] if times else []

    def _rate_at(self, t: float) -> float:
        return self.rate * (1 + self.amplitude * math.sin(2 * math.pi * t / self.period_s))

    @classmethod
    def from_options(cls, options: ArrivalOptions) -> ArrivalProcess:
        if not 0 <= options.diurnal_amplitude < 1 or not options.diurnal_period_s > 0:
            raise BenchError("diurnal arrivals need 0 <= --diurnal-amplitude < 1 and --diurnal-period-s > 0")
        rate = _check_rate(options.rate)
        if rate == math.inf:
            raise BenchError("--arrival diurnal needs a finite --rate (the mean rate)")
        return cls(rate, options.diurnal_amplitude, options.diurnal_period_s)


@dataclass(slots=True, frozen=True)
class TraceArrivals(ArrivalProcess):
    """Replays a JSONL trace: one object per line with `timestamp` in seconds (any origin)."""

    name: ClassVar[str] = "trace"
    path: str
    timestamps_s: tuple[float, ...] = field(default=(), repr=False)

    def offsets_s(self, num: int, rng: np.random.Generator) -> list[float]:
        if num > len(self.timestamps_s):
            raise BenchError(f"the trace {self.path} has {len(self.timestamps_s)} arrivals but the run needs {num}: "
                             "ask for fewer sessions or a longer trace")
        first = self.timestamps_s[0] if self.timestamps_s else 0.0
        return [t - first for t in self.timestamps_s[:num]]

    def describe(self) -> dict[str, Any]:
        return {"process": self.name, "path": self.path, "num_arrivals": len(self.timestamps_s)}

    @classmethod
    def from_options(cls, options: ArrivalOptions) -> ArrivalProcess:
        if options.trace_path is None:
            raise BenchError("--arrival trace needs --trace FILE.jsonl (lines with a `timestamp` in seconds)")
        return cls(options.trace_path, read_trace(Path(options.trace_path)))


def read_trace(path: Path) -> tuple[float, ...]:
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        stamps = tuple(float(json.loads(line)["timestamp"]) for line in lines)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"cannot read the trace {path}: {exc}; each line must be an object with a "
                         "numeric `timestamp` (seconds)") from exc
    if any(b < a for a, b in itertools.pairwise(stamps)):
        raise BenchError(f"the trace {path} is not sorted by timestamp")
    return stamps


ARRIVALS: dict[str, type[ArrivalProcess]] = {
    cls.name: cls for cls in (PoissonArrivals, GammaArrivals, ConstantArrivals, BurstArrivals, RampArrivals,
                              DiurnalArrivals, TraceArrivals)
}


def build_arrival(name: str, options: ArrivalOptions) -> ArrivalProcess:
    if name not in ARRIVALS:
        raise BenchError(f"unknown arrival process {name!r}: pick one of {', '.join(ARRIVALS)}")
    return ARRIVALS[name].from_options(options)


def with_rate(options: ArrivalOptions, rate: float) -> ArrivalOptions:
    return replace(options, rate=rate)
