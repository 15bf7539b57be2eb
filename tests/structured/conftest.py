"""A live server over the tiny random model (the server tests' helpers), for the HTTP tests here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.server.conftest import MODEL, LiveServer, flattened_copy, start_server, tiny_engine_config
from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def structured_live(tiny_hf_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:  # type: ignore[no-untyped-def]
    model_dir: Path = flattened_copy(tiny_hf_dir("llama"), tmp_path_factory.mktemp("structured") / MODEL)
    engine = AsyncEngine.from_config(tiny_engine_config(model_dir))
    server = start_server(engine, ServerConfig(served_model_name=MODEL))
    yield server
    server.stop()
    engine.shutdown()


@pytest.fixture
def client(structured_live: LiveServer) -> openai.OpenAI:
    return structured_live.client()
