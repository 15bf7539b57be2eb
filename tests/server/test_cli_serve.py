"""`tokenmill serve` argument wiring: defaults, the API key from the environment, engine settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tokenmill import cli
from tokenmill.config import SHARED_PREFIX_WAIT_TOKENS, EngineConfig, ServerConfig


def test_defaults_bind_loopback_and_name_the_model(captured: dict[str, Any], tiny_model_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    assert cli.main(["serve", str(tiny_model_dir)]) == 0
    server: ServerConfig = captured["server"]
    assert (server.host, server.port, server.api_key) == ("127.0.0.1", 8000, None)
    assert server.served_model_name == tiny_model_dir.name
    assert captured["engine"].scheduler.shared_prefix_wait_tokens == SHARED_PREFIX_WAIT_TOKENS


def test_api_key_from_the_environment_and_engine_flags(captured: dict[str, Any], tiny_model_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_API_KEY", "from-env")
    argv = ["serve", str(tiny_model_dir), "--port", "9001", "--max-model-len", "128", "--dtype", "float32",
            "--num-kv-blocks", "32", "--max-num-seqs", "4", "--max-queue-requests", "7", "--max-queue-tokens", "99",
            "--log-requests", "ids+text", "--responses-store-size", "12", "--responses-store-mb", "3",
            "--shared-prefix-wait-tokens", "0"]
    assert cli.main(argv) == 0
    server: ServerConfig = captured["server"]
    engine: EngineConfig = captured["engine"]
    assert server.api_key == "from-env" and server.port == 9001
    assert (server.max_queue_requests, server.max_queue_tokens, server.log_requests) == (7, 99, "ids+text")
    assert (server.responses_store_size, server.responses_store_mb) == (12, 3)
    assert (engine.model.max_model_len, engine.model.dtype) == (128, "float32")
    assert (engine.cache.num_blocks, engine.scheduler.max_num_seqs) == (32, 4)
    assert engine.scheduler.shared_prefix_wait_tokens == 0  # off


def test_unknown_model_is_one_line_error(captured: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "/no/such/model"]) == 1
    assert "error:" in capsys.readouterr().err and not captured
