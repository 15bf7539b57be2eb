"""What the endpoints share: the engine (once loaded), admission, metrics, readiness, request logs."""

from __future__ import annotations

import asyncio
import logging

from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.request import SamplingParams
from tokenmill.engine.service_class import ServiceClass
from tokenmill.models.loading.tokenizer import Tokenizer
from tokenmill.server.admission import Admission
from tokenmill.server.background import BackgroundJobs
from tokenmill.server.class_metrics import ClassMetrics
from tokenmill.server.conversations import ConversationStore
from tokenmill.server.errors import ApiError
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.request_log import log_request
from tokenmill.server.response_store import ResponseStore
from tokenmill.server.written_calls import WrittenCalls

log = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 30.0


class TokenTexts:
    """The text of single tokens, for logprobs: responses ask for the same ids again and again."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)

    def utf8(self, token_id: int) -> list[int]:
        return list(self.text(token_id).encode("utf-8", errors="replace"))


class ServerState:
    def __init__(self, config: ServerConfig, engine: AsyncEngine | None = None) -> None:
        self.config = config
        self.admission = Admission(config.max_queue_requests, config.max_queue_tokens, config.retry_after_s,
                                   config.interactive_queue_reserve)
        self.engine: AsyncEngine | None = None
        self.metrics: ServerMetrics | None = None
        self.class_metrics: ClassMetrics | None = None  # per service class, on the same registry
        self.texts: TokenTexts | None = None
        self.responses = ResponseStore(config.responses_store_size, config.responses_store_mb << 20) \
            if config.responses_store_size else None
        # Conversations (/v1/conversations), bounded as the response store and kept where it is
        self.conversations = ConversationStore(config.responses_store_size, config.responses_store_mb << 20) \
            if config.responses_store_size else None
        # Background responses and their event logs, bounded as the store (only where responses are stored)
        self.background = BackgroundJobs(config.responses_store_size, config.responses_store_mb << 20) \
            if config.responses_store_size else None
        self.written_calls = WrittenCalls()  # chat answers with calls as the model wrote them (written_calls.py)
        self.load_error: str | None = None
        self.is_engine_healthy = True
        self._seen_restarts = 0
        if engine is not None:
            self.attach_engine(engine)

    def attach_engine(self, engine: AsyncEngine) -> None:
        self.metrics = ServerMetrics(self.config.served_model_name, max_model_len=engine.max_model_len)
        # The engine's frozen config: the SLO targets the scheduler protects are the ones metrics judge.
        service_classes = engine.loaded.core.config.scheduler.service_classes
        self.class_metrics = ClassMetrics(self.metrics.registry, self.config.served_model_name, service_classes)
        engine.add_stats_listener(self.metrics.on_step)
        engine.add_stats_listener(self.class_metrics.on_step)
        self.texts = TokenTexts(engine.tokenizer)
        self._seen_restarts = engine.num_restarts
        self.engine = engine

    # ------------------------------------------------------------------------ per request

    def require_engine(self) -> AsyncEngine:
        if self.engine is None:
            raise ApiError(503, self.load_error or "the model is still loading: retry shortly", code="loading")
        return self.engine

    def require_texts(self) -> TokenTexts:
        self.require_engine()
        assert self.texts is not None
        return self.texts

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.config.served_model_name:
            raise ApiError(404, f"the model '{requested}' does not exist: this server serves "
                           f"'{self.config.served_model_name}' (see GET /v1/models)", param="model",
                           code="model_not_found")

    def on_rejected(self, service_class: ServiceClass = ServiceClass.STANDARD) -> None:
        if self.metrics is not None:
            self.metrics.on_rejected()
        if self.class_metrics is not None:
            self.class_metrics.on_rejected(service_class)

    def on_finished(self, output: RequestOutput, request_id: str, received: float | None,
                    service_class: ServiceClass = ServiceClass.STANDARD) -> None:
        """`received`: time.monotonic() when the HTTP request arrived, so logs show tokenize + admission."""
        if self.class_metrics is not None:
            self.class_metrics.on_finished(output, service_class)
        log_request(output, request_id=request_id, model=self.config.served_model_name,
                    mode=self.config.log_requests, received=received, service_class=service_class)

    # -------------------------------------------------------------------------- readiness

    def not_ready_reason(self) -> str | None:
        """None when ready; else why not (loading, draining, engine failed)."""
        if self.admission.is_draining:
            return "draining"
        if self.engine is None:
            return "failed to load" if self.load_error else "loading"
        self.note_restarts()
        return None if self.is_engine_healthy else "engine restarting"

    def note_restarts(self) -> None:
        """Count engine restarts since the last look; any marks the engine unhealthy until a probe passes."""
        if self.engine is None or self.engine.num_restarts == self._seen_restarts:
            return
        num_new = self.engine.num_restarts - self._seen_restarts
        self._seen_restarts = self.engine.num_restarts
        self.is_engine_healthy = False
        for _ in range(num_new):
            if self.metrics is not None:
                self.metrics.on_restart()

    async def probe_engine(self) -> bool:
        """One greedy token through the engine: does a step run again after a failure?"""
        engine = self.require_engine()
        restarts_before = engine.num_restarts
        prompt = engine.tokenizer.encode("ok", add_special_tokens=False) or [0]
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        try:
            async with asyncio.timeout(_PROBE_TIMEOUT_S):
                async for _ in engine.generate(prompt, params, priority=-(2**31)):
                    pass
        except Exception as exc:  # any failure: stay unready and try again later
            log.warning("engine probe failed: %s", exc)
            return False
        finally:
            self.note_restarts()
        return engine.num_restarts == restarts_before


async def monitor_engine(state: ServerState, interval_s: float = 0.2) -> None:
    """Keep readiness honest: unready after an engine restart until a probe step succeeds."""
    while True:
        await asyncio.sleep(interval_s)
        if state.engine is None:
            continue
        state.note_restarts()
        if not state.is_engine_healthy and await state.probe_engine():
            state.is_engine_healthy = True

