"""Server lifecycle: /ready false while the model loads; SIGTERM stops admitting (/ready 503, new
requests 503), finishes in-flight requests and exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx

from tests.server.conftest import MODEL, free_port, start_server, tiny_engine_config, wait_until
from tests.server.test_failures import slowed
from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine

REPO_ROOT = Path(__file__).resolve().parents[2]
STREAM: dict[str, Any] = {"prompt": "hello", "max_tokens": 120, "ignore_eos": True, "stream": True}


class StreamReader(threading.Thread):
    """Reads one SSE response to its end in the background."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list[str] = []

    def run(self) -> None:
        with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, timeout=60) as response:
            self.events.extend(line.removeprefix("data: ") for line in response.iter_lines() if line)

    def finish_reason(self) -> str | None:
        reason: str | None = json.loads(self.events[-2])["choices"][0]["finish_reason"]
        return reason


def test_not_ready_while_loading_then_serving(tiny_model_dir: Path) -> None:
    may_load = threading.Event()
    loaded: list[AsyncEngine] = []

    def load() -> AsyncEngine:
        may_load.wait(timeout=60)
        loaded.append(AsyncEngine.from_config(tiny_engine_config(tiny_model_dir)))
        return loaded[0]

    live = start_server(load, ServerConfig(served_model_name=MODEL))
    try:
        assert httpx.get(f"{live.url}/health").status_code == 200
        ready = httpx.get(f"{live.url}/ready")
        assert ready.status_code == 503 and ready.json()["reason"] == "loading"
        early = httpx.post(f"{live.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert early.status_code == 503 and early.json()["error"]["code"] == "loading"
        may_load.set()
        wait_until(lambda: httpx.get(f"{live.url}/ready").status_code == 200, timeout_s=60, what="the model")
        assert httpx.post(f"{live.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        may_load.set()
        live.stop()
    assert not loaded[0]._thread.is_alive()  # the app loaded the engine, so the app shut it down


def test_drain_finishes_in_flight_requests_and_refuses_new_ones(tiny_engine: AsyncEngine) -> None:
    live = start_server(tiny_engine, ServerConfig(served_model_name=MODEL, drain_timeout_s=30))
    with slowed(tiny_engine, 0.01):
        reader = StreamReader(live.url, STREAM)
        reader.start()
        wait_until(lambda: bool(reader.events), what="the stream to start")
        live.server.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
        wait_until(lambda: live.state.admission.is_draining, what="draining")
        ready = httpx.get(f"{live.url}/ready")
        assert ready.status_code == 503 and ready.json()["reason"] == "draining"
        refused = httpx.post(f"{live.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert reader.is_alive()  # the in-flight stream is still being served
        reader.join(timeout=30)
    assert reader.events[-1] == "[DONE]" and reader.finish_reason() == "length"
    live.thread.join(timeout=15)
    assert not live.thread.is_alive()


def test_sigterm_drains_and_exits_zero(tiny_model_dir: Path) -> None:
    port = free_port()
    command = [sys.executable, "-m", "tokenmill", "serve", str(tiny_model_dir), "--port", str(port),
               "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64", "--threads", "1",
               "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url), timeout_s=120, what="the server to come up")
        reader = StreamReader(url, {**STREAM, "max_tokens": 240})
        reader.start()
        wait_until(lambda: bool(reader.events), what="the stream to start")
        proc.send_signal(signal.SIGTERM)
        reader.join(timeout=60)
        assert proc.wait(timeout=60) == 0, proc.stdout.read().decode() if proc.stdout else ""
    finally:
        proc.kill()
    assert reader.events[-1] == "[DONE]" and reader.finish_reason() == "length"


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
