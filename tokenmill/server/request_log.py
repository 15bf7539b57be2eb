"""One structured JSON line per finished request, and the logging set-up of `tokenmill serve`.

The line carries the request's timeline so a slow request can be traced to its cause:

    arrival ──queue_s──▶ first_scheduled ──prefill_s──▶ first_token ──decode_s──▶ finished
    └──────────────────────────────── e2e_s ───────────────────────────────────────┘

`received` (when the server read the HTTP request, if it says) precedes `arrival` (when the
engine queued it); the gap is tokenization and admission. Timeline points are seconds after
`received` (or `arrival`), plus `arrival_unix` as wall-clock time for joining with other logs.

Modes: `off` writes nothing; `meta` writes timings and counts only; `ids` adds the prompt and
output token ids; `ids+text` adds the prompt and output text too.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Literal, get_args

from tokenmill.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.engine.service_class import ServiceClass

RequestLogMode = Literal["off", "meta", "ids", "ids+text"]
REQUEST_LOG_MODES: tuple[str, ...] = get_args(RequestLogMode)
REQUEST_LOGGER = "tokenmill.requests"
FIELDS_ATTR = "tokenmill_fields"  # LogRecord attribute holding a structured payload

log = logging.getLogger(REQUEST_LOGGER)


def log_request(output: RequestOutput, *, request_id: str, model: str, mode: str,
                received: float | None = None, service_class: ServiceClass | None = None) -> None:
    """Log a finished request. `received` is the time.monotonic() at which the HTTP request arrived."""
    if mode == "off" or not log.isEnabledFor(logging.INFO):
        return
    if mode not in REQUEST_LOG_MODES:
        raise ValueError(f"request log mode {mode!r} is unknown: use one of {', '.join(REQUEST_LOG_MODES)}")
    fields = request_fields(output, request_id=request_id, model=model, mode=mode, received=received,
                            service_class=service_class)
    log.info("%s", json.dumps(fields, separators=(",", ":")), extra={FIELDS_ATTR: fields})


def request_fields(output: RequestOutput, *, request_id: str, model: str, mode: str,
                   received: float | None = None, service_class: ServiceClass | None = None) -> dict[str, Any]:
    """The log line as a dict (also what tests check)."""
    first = output.outputs[0] if output.outputs else None
    fields: dict[str, Any] = {
        "event": "request_finished",
        "request_id": request_id,
        "model": model,
        "service_class": None if service_class is None else service_class.value,
        "finish_reason": _reason(first),
        "num_prompt_tokens": len(output.prompt_token_ids),
        "num_output_tokens": sum(len(c.token_ids) for c in output.outputs),
        "num_cached_tokens": output.num_cached_tokens,
    }
    if output.metrics is not None:
        fields.update(_timings(output.metrics, received))
        if output.metrics.spec_mean_accepted_length is not None:
            fields["spec_mean_accepted_length"] = round(output.metrics.spec_mean_accepted_length, 3)
        if output.metrics.accepted_prediction_tokens or output.metrics.rejected_prediction_tokens:
            fields["accepted_prediction_tokens"] = output.metrics.accepted_prediction_tokens
            fields["rejected_prediction_tokens"] = output.metrics.rejected_prediction_tokens
    if mode in ("ids", "ids+text"):
        fields["prompt_token_ids"] = output.prompt_token_ids
    if mode == "ids+text":
        fields["prompt"] = output.prompt
    fields["completions"] = [_completion_fields(c, mode) for c in output.outputs]
    return fields


def _reason(completion: CompletionOutput | None) -> str | None:
    if completion is None or completion.finish_reason is None:
        return None
    return completion.finish_reason.value


def _completion_fields(completion: CompletionOutput, mode: str) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "index": completion.index,
        "finish_reason": _reason(completion),
        "num_tokens": len(completion.token_ids),
    }
    if completion.stop_reason is not None:
        fields["stop_reason"] = completion.stop_reason
    if mode in ("ids", "ids+text"):
        fields["token_ids"] = completion.token_ids
    if mode == "ids+text":
        fields["text"] = completion.text
    return fields


def _timings(m: RequestMetrics, received: float | None) -> dict[str, Any]:
    # A stop-string finish is decided after the engine step, before the engine stamps `finished`.
    finished = m.finished if m.finished is not None else time.monotonic()
    origin = received if received is not None else m.arrival
    return {
        "arrival_unix": round(time.time() - (time.monotonic() - m.arrival), 6),
        "timeline_s": {
            "received": 0.0 if received is not None else None,
            "arrival": _since(origin, m.arrival),
            "first_scheduled": _since(origin, m.first_scheduled),
            "first_token": _since(origin, m.first_token),
            "finished": _since(origin, finished),
        },
        "queue_s": _round(m.queue_s),
        "prefill_s": _round(m.prefill_s),
        "decode_s": None if m.first_token is None else _round(finished - m.first_token),
        "ttft_s": _round(m.ttft_s),
        "e2e_s": _round(finished - origin),
    }


def _since(origin: float, moment: float | None) -> float | None:
    return None if moment is None else _round(moment - origin)


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)  # microseconds: enough, and short lines


# ------------------------------------------------------------------------------ logging set-up


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, then either the structured payload a
    record carries (`extra={FIELDS_ATTR: {...}}`) or its message; exceptions as a string."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        payload = getattr(record, FIELDS_ATTR, None)
        if isinstance(payload, dict):
            entry.update(payload)
        else:
            entry["message"] = record.getMessage()
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, separators=(",", ":"), default=str)


_PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str | int = "INFO", json: bool = False) -> logging.Handler:
    """Send every log record (tokenmill's, uvicorn's, the request log) to stderr, as JSON lines
    or plain text. Calling it again replaces the handler it installed before."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json else logging.Formatter(_PLAIN_FORMAT))
    handler.set_name("tokenmill")
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "tokenmill"]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    # uvicorn installs its own handlers unless told otherwise; route its records through ours.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers.clear()
        uvicorn_logger.propagate = True
    return handler
