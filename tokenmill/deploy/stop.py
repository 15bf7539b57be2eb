"""Keep a foreground command up until SIGINT or SIGTERM, whatever signal dispositions it inherited.

A process started in the background by a non-interactive shell (`cmd &`, many supervisors) inherits
SIGINT *ignored*, and Python then installs no KeyboardInterrupt handler: "Ctrl-C to stop" would be
a lie and `kill -INT` would do nothing. So both handlers are installed explicitly: before the
deploy (a signal during it is kept) and again after `ray.init`, which sets its own SIGTERM handler
when it starts a local cluster.

A second signal while the first one's shutdown runs exits at once (status 128 + signal number),
for a shutdown that hangs; Ray's processes may then outlive the command (`ray stop`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SignalHandler = Callable[[int, FrameType | None], None]


class StopSignals:
    """`install()`, then `wait()` returns the number of the first stop signal received.

    `install_handler` and `force_exit` are `signal.signal` and `os._exit` except in tests.
    """

    def __init__(self, install_handler: Callable[[int, SignalHandler], Any] = signal.signal,
                 force_exit: Callable[[int], Any] = os._exit) -> None:
        self._install_handler = install_handler
        self._force_exit = force_exit
        self._stopped = threading.Event()
        self.received: int | None = None

    def install(self) -> None:
        for signum in STOP_SIGNALS:
            self._install_handler(signum, self._on_signal)

    def wait(self, poll_s: float = 0.5) -> int:
        # A timed wait: the main thread returns to the interpreter at least every poll_s, so the
        # handler runs promptly even on platforms where a blocking wait is not interrupted.
        while not self._stopped.wait(poll_s):
            pass
        assert self.received is not None
        return self.received

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            log.warning("second %s while stopping: exiting now", signal.Signals(signum).name)
            self._force_exit(128 + signum)
            return
        self.received = signum
        self._stopped.set()
