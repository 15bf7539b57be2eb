"""Arrival generators against their distributions: mean interval and coefficient of variation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tokenmill.bench.arrivals import ArrivalOptions, build_arrival
from tokenmill.bench.errors import BenchError

NUM = 20_000


def intervals(name: str, **options: float) -> np.ndarray:
    offsets = build_arrival(name, ArrivalOptions(**options)).offsets_s(NUM, np.random.default_rng(7))  # type: ignore[arg-type]
    assert offsets[0] == 0.0 and len(offsets) == NUM
    gaps = np.diff(offsets)
    assert (gaps >= 0).all()
    return gaps


def cv(values: np.ndarray) -> float:
    return float(values.std() / values.mean())


def test_poisson_is_exponential() -> None:
    gaps = intervals("poisson", rate=4.0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert cv(gaps) == pytest.approx(1.0, rel=0.03)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_keeps_the_rate_and_sets_cv_to_one_over_sqrt_burstiness(burstiness: float) -> None:
    gaps = intervals("gamma", rate=2.0, burstiness=burstiness)
    assert gaps.mean() == pytest.approx(0.5, rel=0.04)
    assert cv(gaps) == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_gamma_uses_vllms_shape_and_scale() -> None:
    offsets = build_arrival("gamma", ArrivalOptions(rate=3.0, burstiness=0.5)).offsets_s(5, np.random.default_rng(1))
    expected = np.random.default_rng(1).gamma(shape=0.5, scale=1 / (3.0 * 0.5), size=5)
    assert offsets == pytest.approx([0.0, *np.cumsum(expected[:-1])])


def test_constant_and_burst() -> None:
    gaps = intervals("constant", rate=5.0)
    assert gaps == pytest.approx(np.full(NUM - 1, 0.2))
    assert build_arrival("burst", ArrivalOptions()).offsets_s(4, np.random.default_rng(0)) == [0.0] * 4
    assert build_arrival("poisson", ArrivalOptions()).offsets_s(3, np.random.default_rng(0)) == [0.0] * 3  # rate inf


def test_ramp_goes_from_start_to_end_rate() -> None:
    gaps = intervals("ramp", rate=1.0, ramp_end_rate=9.0)
    rates = 1.0 + 8.0 * np.arange(NUM - 1) / (NUM - 1)  # the i-th interval is drawn at the i-th rate
    unit = gaps * rates  # each gap in units of its own mean: Exp(1) if the ramp is right
    assert unit.mean() == pytest.approx(1.0, rel=0.03)
    assert cv(unit) == pytest.approx(1.0, rel=0.04)
    assert gaps[:1000].mean() > 5 * gaps[-1000:].mean()


def test_diurnal_mean_rate_and_peak_to_trough() -> None:
    offsets = np.asarray(build_arrival("diurnal", ArrivalOptions(rate=10.0, diurnal_amplitude=0.5,
                                                                 diurnal_period_s=20.0))
                         .offsets_s(NUM, np.random.default_rng(3)))
    whole = offsets[offsets < 20.0 * math.floor(offsets[-1] / 20.0)]
    assert len(whole) / (20.0 * math.floor(offsets[-1] / 20.0)) == pytest.approx(10.0, rel=0.03)
    phase = np.mod(whole, 20.0)
    peak, trough = (phase < 10.0).sum(), (phase >= 10.0).sum()
    # mean of 1 + 0.5 sin over the rising half is 1 + 1/π, over the other half 1 - 1/π
    assert peak / trough == pytest.approx((1 + 1 / math.pi) / (1 - 1 / math.pi), rel=0.06)


def test_trace_replay_is_relative_to_the_first_timestamp(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_len": 3}) + "\n" for t in (100.0, 100.5, 103.0)))
    arrival = build_arrival("trace", ArrivalOptions(trace_path=str(path)))
    assert arrival.offsets_s(3, np.random.default_rng(0)) == [0.0, 0.5, 3.0]
    with pytest.raises(BenchError, match="has 3 arrivals but the run needs 4"):
        arrival.offsets_s(4, np.random.default_rng(0))
    path.write_text('{"timestamp": 2}\n{"timestamp": 1}\n')
    with pytest.raises(BenchError, match="not sorted"):
        build_arrival("trace", ArrivalOptions(trace_path=str(path)))


@pytest.mark.parametrize(("name", "options", "message"), [
    ("nope", {}, "unknown arrival"),
    ("poisson", {"rate": 0.0}, "rate must be > 0"),
    ("gamma", {"rate": 1.0, "burstiness": 0.0}, "burstiness"),
    ("ramp", {"rate": 1.0}, "--ramp-end-rate"),
    ("diurnal", {"rate": 1.0, "diurnal_amplitude": 1.0}, "amplitude"),
    ("trace", {}, "--trace"),
])
def test_bad_options_say_what_to_do(name: str, options: dict[str, float], message: str) -> None:
    with pytest.raises(BenchError, match=message):
        build_arrival(name, ArrivalOptions(**options))  # type: ignore[arg-type]


def test_describe_has_no_infinity() -> None:
    assert build_arrival("poisson", ArrivalOptions()).describe() == {"process": "poisson", "rate": None,
                                                                     "burstiness": 1.0}
