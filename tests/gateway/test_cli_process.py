"""`tokenmill gateway` as a process: it imports nothing from the engine or server, serves over a
backend, and exits 0 on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.gateway.fakes import FakeReplica, free_port, wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


def test_the_gateway_package_imports_neither_engine_server_nor_torch() -> None:
    code = ("import json, sys, pkgutil, importlib, tokenmill.gateway as g\n"
            "for m in pkgutil.iter_modules(g.__path__): importlib.import_module(f'tokenmill.gateway.{m.name}')\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or "
            "m.startswith(('tokenmill.engine', 'tokenmill.server')))))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True,
                                       check=True).stdout)
    assert loaded == []


def test_gateway_command_serves_a_backend_and_exits_zero_on_sigterm() -> None:
    fake = FakeReplica().start()
    port = free_port()
    command = [sys.executable, "-m", "tokenmill", "gateway", "--backend", fake.url, "--port", str(port),
               "--probe-interval", "0.1", "--log-level", "warning"]
    proc = subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url), timeout_s=60, what="the gateway process")
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert response.status_code == 200 and response.headers["x-tokenmill-replica"] == fake.url[7:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stdout.read().decode() if proc.stdout else ""
    finally:
        proc.kill()
        fake.stop()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_health_probes_are_not_logged_at_the_default_level() -> None:
    """httpx logs each request at INFO: at --probe-interval 0.05 that would be ~20 lines a second."""
    fake = FakeReplica().start()
    port = free_port()
    command = [sys.executable, "-m", "tokenmill", "gateway", "--backend", fake.url, "--port", str(port),
               "--probe-interval", "0.05"]
    proc = subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url), timeout_s=60, what="the gateway process")
        wait_until(lambda: fake.behaviour.num_probes >= 20, timeout_s=30, what="twenty health probes")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        output = proc.stdout.read().decode() if proc.stdout else ""
    finally:
        proc.kill()
        fake.stop()
    assert "gateway on http://" in output  # INFO lines of the gateway itself still show
    assert "HTTP Request" not in output and "/ready" not in output, output[-2000:]
