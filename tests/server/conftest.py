"""Live tokenmill servers over a tiny random model: real uvicorn on a free 127.0.0.1 port, in a thread.

One engine serves the whole session; tests that need other server settings (small queues, an
API key) start another app over the same engine, which costs milliseconds.
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import openai
import pytest
from safetensors.torch import load_file, save_file

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.errors import ModelNotInstalledError
from tokenmill.server.app import EngineLoader
from tokenmill.server.serve import DrainingServer, make_server
from tokenmill.server.state import ServerState

MODEL = "tiny"
NUM_KV_BLOCKS = 256
EMBEDDING_SCALE = 0.5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class LiveServer:
    server: DrainingServer
    thread: threading.Thread
    url: str

    @property
    def engine(self) -> AsyncEngine:
        engine = self.server.state.engine
        assert engine is not None, "the model is still loading"
        return engine

    @property
    def state(self) -> ServerState:
        return self.server.state

    def client(self, api_key: str = "unused", **kwargs: object) -> openai.OpenAI:
        # No retries: a test must see the first answer (the client retries 429 and 5xx by default).
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **kwargs)  # type: ignore[arg-type]

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def start_server(engine: AsyncEngine | EngineLoader, config: ServerConfig) -> LiveServer:
    config = replace(config, port=free_port())
    server = make_server(engine, config, access_log=False, log_level="warning")
    thread = threading.Thread(target=server.run, name=f"uvicorn-{config.port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return LiveServer(server, thread, f"http://127.0.0.1:{config.port}")


def serve_real_model(model: str, num_blocks: int) -> Iterator[LiveServer]:
    """A live server on an installed catalog model for a module fixture; skips the module when the
    model is not installed."""
    try:
        engine = AsyncEngine.from_config(EngineConfig(ModelConfig(model), CacheConfig(num_blocks=num_blocks)))
    except ModelNotInstalledError:
        pytest.skip(f"{model} is not installed: run `tokenmill pull {model}`")
    server = start_server(engine, ServerConfig(served_model_name=model))
    yield server
    server.stop()
    engine.shutdown()


def tiny_engine_config(model_dir: Path) -> EngineConfig:
    return EngineConfig(ModelConfig(str(model_dir), dtype="float32", device="cpu"),
                        CacheConfig(block_size=16, num_blocks=NUM_KV_BLOCKS), SchedulerConfig(max_num_seqs=64))


def flattened_copy(model_dir: Path, out_dir: Path, scale: float = EMBEDDING_SCALE) -> Path:
    """The model with its (tied) embeddings scaled down: flatter logits, so seeds make a difference.

    The stock tiny model is so peaked (top logprob ≈ 0, runner-up ≈ -15) that every seed samples
    the same text; at half scale the runner-up sits within a few nats, and greedy gaps stay far
    above float32 noise, so batched and one-by-one greedy runs still agree.
    """
    shutil.copytree(model_dir, out_dir)
    weights = load_file(out_dir / "model.safetensors")
    weights["model.embed_tokens.weight"] *= scale
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_hf_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return flattened_copy(tiny_hf_dir("llama"), tmp_path_factory.mktemp("server_model") / MODEL)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: Path) -> Iterator[AsyncEngine]:
    engine = AsyncEngine.from_config(tiny_engine_config(tiny_model_dir))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def live(tiny_engine: AsyncEngine) -> Iterator[LiveServer]:
    server = start_server(tiny_engine, ServerConfig(served_model_name=MODEL))
    yield server
    server.stop()


@pytest.fixture
def client(live: LiveServer) -> openai.OpenAI:
    return live.client()


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """`tokenmill serve`'s parsed configs, captured instead of starting a server."""
    seen: dict[str, Any] = {}

    def fake_run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
        seen.update(engine=engine_config, server=server_config)
        return 0

    monkeypatch.setattr("tokenmill.server.serve.run_server", fake_run_server)
    monkeypatch.setattr("tokenmill.server.request_log.configure_logging", lambda *a, **k: None)
    return seen
