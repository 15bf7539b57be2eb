"""Local replicas: `tokenmill serve MODEL` subprocesses, each on its own free 127.0.0.1 port.

Children are tied to the gateway's life: on Linux the kernel sends them SIGTERM when the
gateway dies (PR_SET_PDEATHSIG), so even a SIGKILLed gateway leaves no replica behind.
Stopping one is a drain: SIGTERM (the replica finishes in-flight requests and exits 0), then
SIGKILL if it has not exited after its drain timeout and a margin.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import IO

from tokenmill.gateway.config import LocalReplicaConfig

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_KILL_MARGIN_S = 10.0  # beyond the replica's drain timeout: uvicorn's own graceful shutdown, engine stop


def free_port() -> int:
    """A port free now; a rare race with another process makes the replica exit, and it is replaced."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class LocalProcess:
    def __init__(self, popen: subprocess.Popen[bytes], port: int, log_file: IO[bytes] | None) -> None:
        self.popen = popen
        self.port = port
        self._log_file = log_file

    @property
    def pid(self) -> int:
        return self.popen.pid

    def has_exited(self) -> bool:
        return self.popen.poll() is not None

    def signal(self, sig: signal.Signals) -> None:
        if not self.has_exited():
            self.popen.send_signal(sig)

    async def wait_exit(self, timeout_s: float) -> bool:
        """Poll for the exit without blocking the loop; True when it exited in time."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.has_exited():
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.05)
        self.close_log()
        return True

    def close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


class LocalLauncher:
    def __init__(self, config: LocalReplicaConfig) -> None:
        self.config = config

    def command(self, port: int) -> list[str]:
        return [self.config.python, "-m", "tokenmill", "serve", self.config.model, "--host", "127.0.0.1",
                "--port", str(port), "--drain-timeout", str(self.config.drain_timeout_s),
                *(["--quantization", self.config.quantization] if self.config.quantization else []),
                *self.config.serve_args]

    def spawn(self) -> tuple[str, LocalProcess]:
        """Start one replica; returns its base URL and process (not ready yet: the prober says when)."""
        port = free_port()
        log_file = self._open_log(port)
        output = log_file if log_file is not None else subprocess.DEVNULL
        popen = subprocess.Popen(self.command(port), stdin=subprocess.DEVNULL, stdout=output,
                                 stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        log.info("started replica pid %d on 127.0.0.1:%d", popen.pid, port)
        return f"http://127.0.0.1:{port}", LocalProcess(popen, port, log_file)

    async def stop(self, process: LocalProcess) -> None:
        """Drain: SIGTERM, wait, then SIGKILL a replica that outstays its drain timeout."""
        process.signal(signal.SIGTERM)
        if not await process.wait_exit(self.config.drain_timeout_s + _KILL_MARGIN_S):
            log.warning("replica pid %d did not drain in time: killing it", process.pid)
            process.signal(signal.SIGKILL)
            await process.wait_exit(_KILL_MARGIN_S)
        process.close_log()

    def _open_log(self, port: int) -> IO[bytes] | None:
        if self.config.log_dir is None:
            return None
        directory = Path(self.config.log_dir)
        directory.mkdir(parents=True, exist_ok=True)
        return (directory / f"replica-{port}.log").open("ab")
