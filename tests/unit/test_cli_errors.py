"""Bad input at the CLI: one line on stderr that names the fix, exit status 1, never a traceback."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tokenmill.cli import main


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()  # drop whatever fixtures printed while building models
    assert main(argv) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_unknown_model_name(capsys: pytest.CaptureFixture[str]) -> None:
    line = _run(["generate", "no-such-model", "hello"], capsys)
    assert "tokenmill models" in line


def test_not_installed_catalog_model(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tokenmill.models.resolve.verified_path", lambda entry: None)
    line = _run(["generate", "qwen2.5-coder-1.5b", "hello"], capsys)
    assert "tokenmill pull qwen2.5-coder-1.5b" in line


def test_truncated_gguf(tmp_path: Path, tiny_gguf_path: Callable[[str], Path],
                        capsys: pytest.CaptureFixture[str]) -> None:
    src = tiny_gguf_path("llama")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    _run(["generate", str(cut), "hello"], capsys)


def test_not_a_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a model at all" * 100)
    _run(["generate", str(bogus), "hello"], capsys)


def test_unsupported_architecture(tmp_path: Path, tiny_hf_dir: Callable[[str], Path],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_hf_dir("llama"), model)
    config = (model / "config.json").read_text().replace("LlamaForCausalLM", "MambaForCausalLM")
    (model / "config.json").write_text(config.replace('"llama"', '"mamba"'))
    line = _run(["generate", str(model), "hello"], capsys)
    assert "mamba" in line.lower()


def test_prompt_longer_than_context(tiny_hf_dir: Callable[[str], Path], capsys: pytest.CaptureFixture[str]) -> None:
    line = _run(["generate", str(tiny_hf_dir("llama")), "x " * 400, "--max-model-len", "64",
                 "--quiet-stats"], capsys)
    assert "context is 64" in line and "shorten the prompt by 737 tokens" in line


def test_bad_sampling_value(tiny_hf_dir: Callable[[str], Path], capsys: pytest.CaptureFixture[str]) -> None:
    line = _run(["generate", str(tiny_hf_dir("llama")), "hi", "--top-p", "0"], capsys)
    assert "top_p" in line
