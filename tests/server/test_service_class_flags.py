"""Service classes from the command line and around the server: the `serve` flags (SLO targets, API-key
classes, the interactive reserve, the relative bound) and their one-line errors, the Grafana panel of
SLO attainment by class, and the engine's calibration while idle (docs/workload_classes.md)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.server.conftest import MODEL, wait_until
from tokenmill import cli
from tokenmill.config import ServerConfig, ServiceClassConfig, SLOTarget
from tokenmill.engine.async_engine import AsyncEngine


@pytest.fixture
def captured(captured: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """conftest's capture, with the served model name fixed (these tests pass no model path)."""
    monkeypatch.setattr("tokenmill.cli.serve._installed_model_name", lambda model: MODEL)
    return captured


def test_serve_flags_set_slo_targets_key_classes_and_the_reserve(captured: dict[str, Any]) -> None:
    argv = ["serve", "m", "--slo", "interactive:ttft=0.5,tpot=0.08", "--slo", "batch:ttft=60", "--slo",
            "standard:tpot=none", "--api-key-class", "k1=flex", "--api-key-class", "a=b=batch",
            "--interactive-queue-reserve", "0.4"]
    assert cli.main(argv) == 0
    classes: ServiceClassConfig = captured["engine"].scheduler.service_classes
    assert classes.interactive == SLOTarget(ttft_s=0.5, tpot_s=0.08)
    assert classes.standard == SLOTarget(ttft_s=5.0, tpot_s=None)  # the default TTFT kept
    assert classes.batch == SLOTarget(ttft_s=60.0) and classes.enabled
    server: ServerConfig = captured["server"]
    assert server.api_key_classes == (("k1", "batch"), ("a=b", "batch"))
    assert server.interactive_queue_reserve == 0.4


def test_no_slo_scheduling_flag(captured: dict[str, Any]) -> None:
    assert cli.main(["serve", "m", "--no-slo-scheduling"]) == 0
    assert not captured["engine"].scheduler.service_classes.enabled


@pytest.mark.parametrize(("value", "expected"), [(None, ServiceClassConfig().protected_slowdown), ("0.3", 0.3),
                                                 ("none", None), ("0", 0.0)])
def test_protected_slowdown_flag(captured: dict[str, Any], value: str | None, expected: float | None) -> None:
    assert cli.main(["serve", "m", *([] if value is None else ["--protected-slowdown", value])]) == 0
    assert captured["engine"].scheduler.service_classes.protected_slowdown == expected


@pytest.mark.parametrize(("flags", "message"), [
    (["--slo", "interactive"], "--slo takes CLASS:ttft=SECONDS,tpot=SECONDS, got 'interactive'"),
    (["--slo", "gold:ttft=1"], "service_tier 'gold' is not supported"),
    (["--slo", "batch:e2e=1"], "each target is ttft=SECONDS or tpot=SECONDS"),
    (["--slo", "batch:ttft=-1"], "a target must be positive seconds"),
    (["--slo", "batch:ttft=soon"], "'soon' is not a number of seconds"),
    (["--api-key-class", "nokey"], "--api-key-class takes KEY=CLASS, got 'nokey'"),
    (["--interactive-queue-reserve", "1"], "interactive_queue_reserve must be in [0, 1)"),
    (["--protected-slowdown", "-0.1"], "--protected-slowdown must be >= 0, got '-0.1'"),
    (["--protected-slowdown", "some"], "--protected-slowdown takes a fraction or 'none', got 'some'"),
])
def test_bad_service_class_flags_are_one_line_errors(captured: dict[str, Any], capsys: pytest.CaptureFixture[str],
                                                     flags: list[str], message: str) -> None:
    assert cli.main(["serve", "m", *flags]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not captured


def test_dashboard_has_slo_attainment_by_class() -> None:
    import json
    from pathlib import Path

    dashboard = json.loads((Path(__file__).parents[2] / "deploy" / "grafana" / "tokenmill.json").read_text())
    [panel] = [p for p in dashboard["panels"] if p.get("title") == "SLO attainment by class"]
    exprs = [t["expr"] for t in panel["targets"]]
    assert all("tokenmill:slo_met_total" in e and "tokenmill:slo_requests_total" in e for e in exprs)
    assert all("by (service_class)" in e for e in exprs) and any('slo="all"' in e for e in exprs)


def test_the_engine_calibrates_while_idle_and_a_request_meanwhile_is_served(tiny_model_dir: Any) -> None:
    """engine/calibration.py in the engine thread: a request sent while the synthetic steps run is
    answered exactly as by an engine that never calibrated, and calibration then ends for good."""
    import asyncio
    from dataclasses import replace

    from tests.server.conftest import tiny_engine_config
    from tokenmill.engine.request import SamplingParams

    base = tiny_engine_config(tiny_model_dir)
    classes = ServiceClassConfig(calibration_steps=24)
    calibrating = AsyncEngine.from_config(replace(base, scheduler=replace(base.scheduler, service_classes=classes)))
    plain = AsyncEngine.from_config(base)

    async def tokens(engine: AsyncEngine) -> list[int]:
        last = None
        async for out in engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=8, temperature=0.0)):
            last = out
        assert last is not None
        return list(last.outputs[0].token_ids)

    try:
        assert calibrating.calibration is not None
        first = asyncio.run(tokens(calibrating))  # lands during calibration (or right after it)
        assert first == asyncio.run(tokens(plain))
        wait_until(lambda: calibrating.calibration is not None and not calibrating.calibration.active, 30)
        assert not calibrating.core.scheduler.requests  # no synthetic request left behind
        assert asyncio.run(tokens(calibrating)) == first
    finally:
        calibrating.shutdown()
        plain.shutdown()
