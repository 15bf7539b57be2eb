"""Multi-node: tokenmill replicas as a Ray Serve deployment, the OpenAI API at Serve's HTTP ingress.

    client ──HTTP──▶ Ray Serve proxy (every node, :8000) ──▶ TokenmillReplica × N (any node)
                                                              each: AsyncEngine + the tokenmill FastAPI app

- Each replica loads the engine in its constructor (Ray counts it STARTING until then) and
  serves the very app `tokenmill serve` runs: same endpoints, streaming, errors, /metrics.
- Autoscaling: min_replicas is the warm buffer (replicas kept loaded even when idle), Ray adds
  replicas while ongoing requests per replica exceed `target_ongoing_requests`, up to max.
- Health: Ray calls `check_health` every period; it fails when the model failed to load or the
  engine has stayed unready (restarting) longer than `unhealthy_after_s`, and Ray replaces it.
- Shutdown: Ray stops routing to a replica, waits for its in-flight requests
  (graceful_shutdown_timeout_s), then `__del__` stops the engine.

Ray is optional (`pip install "ray[serve]"`): it is imported only when a deployment is built.
Run it with `tokenmill deploy ray MODEL`, or from a Serve config file with the import path
`tokenmill.deploy.ray_serve:app_builder` (docs/deploy.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

from tokenmill.errors import TokenmillError

log = logging.getLogger(__name__)

APP_NAME = "tokenmill"


@dataclass(frozen=True, slots=True)
class RayDeploySettings:
    """Everything a replica needs, as plain values: Ray pickles it to every node."""

    model: str
    served_model_name: str | None = None
    # engine (as `tokenmill serve` flags)
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    threads: int | None = None
    # scaling
    min_replicas: int = 1  # the warm buffer: loaded even with no traffic
    max_replicas: int = 4
    target_ongoing_requests: float = 16.0
    max_ongoing_requests: int = 256  # beyond this Ray queues at the proxy instead of sending
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 60.0
    # placement
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    # health and shutdown
    health_check_period_s: float = 5.0
    health_check_timeout_s: float = 30.0
    unhealthy_after_s: float = 30.0
    graceful_shutdown_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise TokenmillError("need 0 <= min_replicas <= max_replicas and max_replicas >= 1")
        if self.target_ongoing_requests <= 0 or self.max_ongoing_requests < 1:
            raise TokenmillError("target_ongoing_requests and max_ongoing_requests must be positive")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RayDeploySettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise TokenmillError(f"unknown Ray deploy settings {unknown}: use {sorted(known)}")
        return cls(**values)

    def autoscaling_config(self) -> dict[str, Any]:
        return {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "initial_replicas": max(1, self.min_replicas),
                "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s}

    def deployment_options(self) -> dict[str, Any]:
        return {"name": "TokenmillReplica", "autoscaling_config": self.autoscaling_config(),
                "max_ongoing_requests": self.max_ongoing_requests,
                "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
                "health_check_period_s": self.health_check_period_s,
                "health_check_timeout_s": self.health_check_timeout_s,
                "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s}


class TokenmillReplica:
    """One replica: the engine and the server app. Wrapped by Ray's ingress in `build_application`."""

    clock: Callable[[], float] = staticmethod(time.monotonic)  # tests step a fake one

    def __init__(self, settings: RayDeploySettings) -> None:
        from tokenmill.engine.async_engine import AsyncEngine
        from tokenmill.server.app import build_app

        self.settings = settings
        started = time.monotonic()
        self.engine = AsyncEngine.from_config(_engine_config(settings))
        # Not `self.app`: Ray's ingress wrapper, which this class becomes a base of, owns that name.
        self.server_app = build_app(self.engine, _server_config(settings))
        self.server_state = self.server_app.state.tokenmill
        self._unready_since: float | None = None
        log.info("tokenmill replica ready in %.1f s", time.monotonic() - started)

    def __serve_build_asgi_app__(self) -> Any:
        return self.server_app  # Ray serves it and runs its lifespan (the engine monitor)

    def check_health(self) -> None:
        """Raise to have Ray replace this replica; a short engine restart is not a reason."""
        reason = self.server_state.not_ready_reason()
        if reason is None or reason == "draining":
            self._unready_since = None
            return
        now = self.clock()
        self._unready_since = self._unready_since if self._unready_since is not None else now
        if now - self._unready_since > self.settings.unhealthy_after_s:
            raise RuntimeError(f"tokenmill replica unready for {now - self._unready_since:.0f} s: {reason}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def _engine_config(settings: RayDeploySettings) -> Any:
    from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    return EngineConfig(ModelConfig(settings.model, settings.dtype, settings.device, settings.max_model_len),
                        CacheConfig(num_blocks=settings.num_kv_blocks),
                        SchedulerConfig(max_num_seqs=settings.max_num_seqs), num_threads=settings.threads)


def _server_config(settings: RayDeploySettings) -> Any:
    from tokenmill.config import ServerConfig
    from tokenmill.models.resolve import resolve_model

    name = settings.served_model_name or resolve_model(settings.model).name
    # Host and port are Ray's (its proxy owns the socket); the draining is Ray's graceful shutdown. No
    # /v1/responses store: Ray's router does not send a continuation to the replica that stored its
    # response (tokenmill's gateway does), so a per-replica store would answer previous_response_id at
    # random; without one it is a clear 400 (send the whole conversation).
    return ServerConfig(served_model_name=name, drain_timeout_s=settings.graceful_shutdown_timeout_s,
                        responses_store_size=0)


def build_application(settings: RayDeploySettings) -> Any:
    """The bound Serve application: `serve.run(build_application(settings), route_prefix="/")`."""
    serve = _import_serve()
    replica_class = serve.ingress()(TokenmillReplica)
    return serve.deployment(replica_class, **settings.deployment_options()).bind(settings)


def app_builder(args: dict[str, Any]) -> Any:
    """For Serve config files: `import_path: tokenmill.deploy.ray_serve:app_builder`, `args: {model: ...}`."""
    return build_application(RayDeploySettings.from_dict(dict(args)))


def deploy(settings: RayDeploySettings, *, address: str | None, host: str, port: int,
           ray_init_options: dict[str, Any] | None = None) -> str:
    """Connect to (or start) a Ray cluster, start Serve's HTTP proxy, run the application; its URL."""
    import ray

    serve = _import_serve()
    ray.init(address=address, ignore_reinit_error=True, **(ray_init_options or {}))
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_application(settings), name=APP_NAME, route_prefix="/", blocking=False)
    log.info("deployed %s: %s", APP_NAME, asdict(settings))
    return f"http://{host}:{port}"


def shutdown() -> None:
    import ray

    serve = _import_serve()
    serve.shutdown()
    ray.shutdown()


def _import_serve() -> Any:
    try:
        from ray import serve
    except ImportError as exc:
        raise TokenmillError('Ray Serve is not installed: pip install "ray[serve]"') from exc
    return serve
