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
    assert line.startswith("error: model 'no-such-model' is neither a catalog name (smollm2-135m, ")
    assert line.endswith("nor an existing path: run `tokenmill models` to list models")


def test_a_prompt_after_an_option_is_still_the_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    """`tokenmill generate MODEL --chat PROMPT` (the README's example): the model and the prompt both reach the
    command (here the model lookup's error, not argparse's usage error); an unknown option stays an error."""
    line = _run(["generate", "no-such-model", "--chat", "hello there", "--max-tokens", "4"], capsys)
    assert line.startswith("error: model 'no-such-model' is neither a catalog name")
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "no-such-model", "--chat", "hello", "--warp-drive"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --warp-drive" in capsys.readouterr().err


def test_not_installed_catalog_model(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tokenmill.models.resolve.verified_path", lambda entry: None)
    line = _run(["generate", "qwen2.5-coder-1.5b", "hello"], capsys)
    assert line == "error: model 'qwen2.5-coder-1.5b' is not installed: run `tokenmill pull qwen2.5-coder-1.5b`"


def test_truncated_gguf(tmp_path: Path, tiny_gguf_path: Callable[[str], Path],
                        capsys: pytest.CaptureFixture[str]) -> None:
    src = tiny_gguf_path("llama")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    line = _run(["generate", str(cut), "hello"], capsys)
    assert line.startswith(f"error: cannot read GGUF file {cut}: ") and line.endswith("; re-download the model")


def test_not_a_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a model at all" * 100)
    line = _run(["generate", str(bogus), "hello"], capsys)
    assert line == f"error: {bogus} lacks the GGUF magic: the file is corrupt, copy or download it again"


def test_unsupported_architecture(tmp_path: Path, tiny_hf_dir: Callable[[str], Path],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_hf_dir("llama"), model)
    config = (model / "config.json").read_text().replace("LlamaForCausalLM", "MambaForCausalLM")
    (model / "config.json").write_text(config.replace('"llama"', '"mamba"'))
    line = _run(["generate", str(model), "hello"], capsys)
    assert line == (f"error: {model}: unsupported architecture ['MambaForCausalLM']; "
                    "tokenmill runs Llama, Qwen2 and Gemma 3 models")


def test_prompt_longer_than_context(tiny_hf_dir: Callable[[str], Path], capsys: pytest.CaptureFixture[str]) -> None:
    line = _run(["generate", str(tiny_hf_dir("llama")), "x " * 400, "--max-model-len", "64",
                 "--quiet-stats"], capsys)
    assert "context is 64" in line and "shorten the prompt by 737 tokens" in line


def test_bad_sampling_value(tiny_hf_dir: Callable[[str], Path], capsys: pytest.CaptureFixture[str]) -> None:
    line = _run(["generate", str(tiny_hf_dir("llama")), "hi", "--top-p", "0"], capsys)
    assert line == "error: top_p must be in (0, 1]"
