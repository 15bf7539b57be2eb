"""AsyncEngine.from_config loads on a thread that ends with the load (async_engine.load_on_exiting_thread).

libgomp keeps an OpenMP team for every live thread that ran a parallel region; a loader thread that
lived on beside the engine thread made libgomp count more of its threads than CPUs and stop spinning at
barriers, so the server's compute threads slept and woke ~190 times a decode step (docs/performance.md).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import tiny_engine_config
from tokenmill.config import EngineConfig
from tokenmill.engine import async_engine
from tokenmill.engine.async_engine import AsyncEngine


def test_the_load_runs_on_a_thread_that_has_ended_when_it_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[threading.Thread] = []

    def fake_load(config: EngineConfig) -> Any:
        seen.append(threading.current_thread())
        return "loaded"

    monkeypatch.setattr(async_engine, "load_engine", fake_load)
    assert async_engine.load_on_exiting_thread(EngineConfig.__new__(EngineConfig)) == "loaded"
    (loader,) = seen
    assert loader is not threading.current_thread()
    assert not loader.is_alive()


def test_a_failed_load_raises_on_the_callers_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_load(config: EngineConfig) -> Any:
        raise ValueError("no such model")

    monkeypatch.setattr(async_engine, "load_engine", failing_load)
    with pytest.raises(ValueError, match="no such model"):
        async_engine.load_on_exiting_thread(EngineConfig.__new__(EngineConfig))
    assert not any(t.name.startswith("tokenmill-load") for t in threading.enumerate())


def test_from_config_loads_on_a_thread_that_is_gone(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[threading.Thread] = []
    real_load = async_engine.load_engine

    def recording_load(config: EngineConfig) -> Any:
        seen.append(threading.current_thread())
        return real_load(config)

    monkeypatch.setattr(async_engine, "load_engine", recording_load)
    engine = AsyncEngine.from_config(tiny_engine_config(tiny_model_dir))
    try:
        (loader,) = seen
        assert loader is not threading.current_thread() and not loader.is_alive()
        assert engine._thread.is_alive() and engine._thread is not loader
    finally:
        engine.shutdown()
