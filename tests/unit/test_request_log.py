"""The per-request JSON log line: modes, timeline, and the JSON formatter."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator

import pytest

from tokenmill.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.engine.request import FinishReason
from tokenmill.server.request_log import REQUEST_LOGGER, JsonFormatter, configure_logging, log_request


def _output() -> RequestOutput:
    completion = CompletionOutput(0, "hello", [7, 8, 9], None, FinishReason.STOP)
    metrics = RequestMetrics(arrival=10.0, first_scheduled=10.25, first_token=11.0, finished=13.0,
                             num_cached_tokens=16)
    return RequestOutput("engine-1", "say hi", [1, 2, 3, 4], [completion], True, metrics, num_cached_tokens=16)


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """The request logger's output, formatted as JSON lines."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger(REQUEST_LOGGER)
    previous_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield stream
    logger.removeHandler(handler)
    logger.setLevel(previous_level)


def _lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_ids_mode_logs_one_line_with_ids_timeline_and_counts(captured: io.StringIO) -> None:
    log_request(_output(), request_id="req-abc", model="tiny", mode="ids")
    (line,) = _lines(captured)
    assert line["request_id"] == "req-abc"
    assert line["model"] == "tiny"
    assert line["logger"] == REQUEST_LOGGER
    assert line["finish_reason"] == "stop"
    assert (line["num_prompt_tokens"], line["num_output_tokens"], line["num_cached_tokens"]) == (4, 3, 16)
    assert line["prompt_token_ids"] == [1, 2, 3, 4]
    assert line["completions"] == [{"index": 0, "finish_reason": "stop", "num_tokens": 3, "token_ids": [7, 8, 9]}]
    assert "prompt" not in line
    assert (line["queue_s"], line["prefill_s"], line["decode_s"], line["ttft_s"], line["e2e_s"]) == \
        (0.25, 0.75, 2.0, 1.0, 3.0)
    assert line["timeline_s"] == {"received": None, "arrival": 0.0, "first_scheduled": 0.25, "first_token": 1.0,
                                  "finished": 3.0}


def test_ids_text_mode_adds_prompt_and_output_text(captured: io.StringIO) -> None:
    log_request(_output(), request_id="r", model="tiny", mode="ids+text")
    (line,) = _lines(captured)
    assert line["prompt"] == "say hi"
    assert line["completions"][0]["text"] == "hello"  # type: ignore[index]


def test_meta_mode_has_no_ids_or_text(captured: io.StringIO) -> None:
    log_request(_output(), request_id="r", model="tiny", mode="meta")
    (line,) = _lines(captured)
    assert "prompt_token_ids" not in line
    assert line["completions"] == [{"index": 0, "finish_reason": "stop", "num_tokens": 3}]


def test_off_mode_logs_nothing(captured: io.StringIO) -> None:
    log_request(_output(), request_id="r", model="tiny", mode="off")
    assert captured.getvalue() == ""


def test_unknown_mode_is_refused(captured: io.StringIO) -> None:
    with pytest.raises(ValueError, match="ids\\+text"):
        log_request(_output(), request_id="r", model="tiny", mode="everything")


def test_received_time_moves_the_origin_before_engine_arrival(captured: io.StringIO) -> None:
    log_request(_output(), request_id="r", model="tiny", mode="meta", received=9.5)
    (line,) = _lines(captured)
    assert line["timeline_s"] == {"received": 0.0, "arrival": 0.5, "first_scheduled": 0.75, "first_token": 1.5,
                                  "finished": 3.5}
    assert line["e2e_s"] == 3.5


def test_json_formatter_wraps_ordinary_records_and_exceptions() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.LogRecord("tokenmill.engine", logging.ERROR, __file__, 1, "step %d failed", (3,),
                                   sys.exc_info())
    line = json.loads(JsonFormatter().format(record))
    assert (line["level"], line["logger"], line["message"]) == ("error", "tokenmill.engine", "step 3 failed")
    assert "RuntimeError: boom" in line["exception"]


def test_configure_logging_replaces_its_own_handler() -> None:
    root = logging.getLogger()
    before = list(root.handlers)
    level = root.level
    try:
        configure_logging("INFO", json=True)
        handler = configure_logging("DEBUG", json=False)
        ours = [h for h in root.handlers if h.get_name() == "tokenmill"]
        assert ours == [handler]
        assert root.level == logging.DEBUG
    finally:
        for h in root.handlers[:]:
            if h not in before:
                root.removeHandler(h)
        root.setLevel(level)
