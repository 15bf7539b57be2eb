"""A real `tokenmill serve` of the tiny llama, as a subprocess on a free 127.0.0.1 port, for the session."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import free_port

STARTUP_TIMEOUT_S = 120.0


@pytest.fixture(scope="session")
def served_url(tiny_hf_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = (tmp_path_factory.mktemp("bench_server") / "serve.log").open("w")
    argv = [sys.executable, "-m", "tokenmill", "serve", str(tiny_hf_dir("llama")), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--device", "cpu", "--threads", "1", "--num-kv-blocks", "128",
            "--served-model-name", "tiny"]
    # One torch thread: the machine is shared and the test measures nothing.
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process)
        yield url
    finally:
        process.terminate()  # SIGTERM: the server drains and exits
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _wait_ready(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tokenmill serve exited with {process.returncode} before it was ready")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"tokenmill serve was not ready after {STARTUP_TIMEOUT_S:.0f} s")
