"""Run the app under uvicorn, with a SIGTERM that drains instead of cutting requests off.

SIGTERM (what Kubernetes and systemd send):
    1. stop admitting: /ready turns 503 so load balancers move away, new requests get 503;
    2. wait for in-flight requests to finish, up to `drain_timeout_s`;
    3. stop uvicorn and the engine; exit 0.
A second SIGTERM skips the wait. SIGINT (Ctrl-C) keeps uvicorn's immediate shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn

from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.loader import freeze_loaded_heap
from tokenmill.server.app import EngineLoader, build_app
from tokenmill.server.state import ServerState

log = logging.getLogger(__name__)

# After the drain, uvicorn gives stragglers this long before cancelling them (which aborts them).
_GRACEFUL_SHUTDOWN_S = 5


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM:
            super().handle_exit(sig, frame)
        elif self._loop is None or self.state.admission.is_draining:
            self.should_exit = True  # not serving yet, or a second SIGTERM: stop now
        else:
            # A signal handler may not touch the loop directly; hand the drain over to it.
            self._loop.call_soon_threadsafe(self.start_drain)

    def start_drain(self) -> None:
        """Begin the SIGTERM sequence; call on the server's event loop."""
        self.state.admission.start_draining()
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        num_in_flight = self.state.admission.num_in_flight
        log.info("SIGTERM: draining %d in-flight requests (up to %.0f s)", num_in_flight, self.drain_timeout_s)
        if not await self.state.admission.wait_idle(self.drain_timeout_s):
            log.warning("drain timeout: %d requests still in flight are aborted", self.state.admission.num_in_flight)
        self.should_exit = True


def make_server(app_engine: AsyncEngine | EngineLoader, config: ServerConfig, *, access_log: bool = True,
                log_level: str = "info") -> DrainingServer:
    app = build_app(app_engine, config)
    # log_config=None: uvicorn's records go through the handlers tokenmill set up (request_log).
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_config=None, log_level=log_level,
                               access_log=access_log, timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S, lifespan="on")
    return DrainingServer(uv_config, app.state.tokenmill, config.drain_timeout_s)


def run_server(engine_config: EngineConfig, config: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT; the exit status (1 when the model failed to load)."""
    server: DrainingServer | None = None

    def load() -> AsyncEngine:
        try:
            engine = AsyncEngine.from_config(engine_config)
            freeze_loaded_heap()  # this process serves this one engine until it exits
            return engine
        except BaseException:
            assert server is not None
            server.exit_code = 1
            server.should_exit = True  # nothing to serve: stop rather than stay unready forever
            raise

    server = make_server(load, config)
    log.info("serving %s on http://%s:%d/v1", config.served_model_name, config.host, config.port)
    server.run()
    return server.exit_code
