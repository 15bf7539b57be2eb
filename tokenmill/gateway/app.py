"""The gateway process: the fleet and its background loops (`Gateway`), the FastAPI app in front.

    /health   the gateway answers                /ready  200 while at least one replica is routable
    /metrics  the gateway's own Prometheus       anything else (/v1/completions, /v1/chat/completions,
                                                 /v1/models, /tokenize, ...) is proxied to a replica

The gateway imports nothing from the engine or the server: replicas are base URLs it talks to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from types import FrameType

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.gateway.autoscaler import Autoscaler
from tokenmill.gateway.config import AutoscaleConfig, GatewayConfig
from tokenmill.gateway.health import Prober
from tokenmill.gateway.local import LocalLauncher
from tokenmill.gateway.metrics import GatewayMetrics
from tokenmill.gateway.policies import make_policy
from tokenmill.gateway.proxy import Proxy
from tokenmill.gateway.replica import Replica
from tokenmill.gateway.replica_set import ReplicaSet

log = logging.getLogger(__name__)

_PROXIED_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]
# SIGTERM: uvicorn lets open streams finish this long, then the replicas are drained.
GRACEFUL_SHUTDOWN_S = 30


class Gateway:
    def __init__(self, config: GatewayConfig, launcher: LocalLauncher | None = None) -> None:
        """`launcher`: how local replicas start (default: `tokenmill serve` per config.local)."""
        self.config = config
        self._launcher = launcher
        self.metrics = GatewayMetrics()
        self.replicas = ReplicaSet()
        health = config.health
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(health.read_timeout_s, connect=health.connect_timeout_s),
            # Streams hold a connection each for their whole life: no small pool limit.
            limits=httpx.Limits(max_connections=4096, max_keepalive_connections=256))
        self.policy = make_policy(config)
        self.proxy = Proxy(self.replicas, self.policy, self.client, config, self.metrics)
        self.prober = Prober(self.replicas, self.client, config.health, self.metrics)
        self.autoscaler = self._make_autoscaler()
        self._tasks: list[asyncio.Task[None]] = []

    def _make_autoscaler(self) -> Autoscaler | None:
        if self.config.local is None:
            return None
        # Without autoscaling the fleet is fixed, but a dead replica is still replaced.
        fixed = AutoscaleConfig(self.config.initial_replicas, self.config.initial_replicas)
        launcher = self._launcher or LocalLauncher(self.config.local)
        return Autoscaler(self.replicas, launcher, self.config.autoscale or fixed, self.config.breaker, self.metrics)

    async def start(self) -> None:
        for url in self.config.backends:
            self.replicas.add(Replica(url, self.config.breaker))
        tasks = [self.prober.run()]
        if self.autoscaler is not None:
            self.autoscaler.start(self.config.initial_replicas)  # all at once: they load in parallel
            tasks.append(self.autoscaler.run())
        self._tasks = [asyncio.create_task(task) for task in tasks]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.autoscaler is not None:
            await self.autoscaler.stop_all()
        await self.client.aclose()

    def not_ready_reason(self) -> str | None:
        if self.replicas.routable():
            return None
        if any(replica.is_live for replica in self.replicas):
            return "no replica is ready yet"
        return "no replicas"


def build_app(gateway: Gateway) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="tokenmill gateway", lifespan=lifespan)
    app.state.gateway = gateway

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        reason = gateway.not_ready_reason()
        if reason is None:
            return JSONResponse({"status": "ready", "num_routable": len(gateway.replicas.routable())})
        return JSONResponse({"status": "not ready", "reason": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        gateway.metrics.set_replica_counts(list(gateway.replicas))
        body, content_type = gateway.metrics.render()
        return Response(body, media_type=content_type)

    @app.api_route("/{path:path}", methods=_PROXIED_METHODS)
    async def proxied(request: Request) -> Response:
        return await gateway.proxy.forward(request)

    return app


class GatewayServer(uvicorn.Server):
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.should_exit:
            # A graceful stop, not a crash: uvicorn would re-raise the signal after shutting
            # down (exit status -15); a drained gateway exits 0, as `tokenmill serve` does.
            self.should_exit = True
            return
        super().handle_exit(sig, frame)


def make_server(config: GatewayConfig, *, gateway: Gateway | None = None, log_level: str = "info",
                access_log: bool = False) -> uvicorn.Server:
    app = build_app(gateway or Gateway(config))
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_config=None, log_level=log_level,
                               access_log=access_log, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="on")
    return GatewayServer(uv_config)


def run_gateway(config: GatewayConfig, *, log_level: str = "info") -> int:
    """Serve until SIGTERM/SIGINT: open streams finish, then local replicas are drained."""
    quiet_http_client_logs(log_level)
    server = make_server(config, log_level=log_level)
    log.info("gateway on http://%s:%d/v1 (policy %s)", config.host, config.port, config.policy)
    server.run()
    return 0


# httpx logs every request it sends at INFO; the gateway sends one health probe per replica per
# probe interval, so at the default level they would drown everything else.
HTTP_CLIENT_LOGGERS = ("httpx", "httpcore")


def quiet_http_client_logs(log_level: str) -> None:
    """The HTTP client's per-request lines show only at `--log-level debug` (the verbose setting)."""
    level = logging.DEBUG if log_level.lower() == "debug" else logging.WARNING
    for name in HTTP_CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(level)
