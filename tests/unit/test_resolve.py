"""resolve_model, installed_models and the `pull`/`models` CLI, on tmp dirs only."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tokenmill import cli
from tokenmill.errors import ModelFormatError, ModelNotFoundError, ModelNotInstalledError
from tokenmill.models import pull as pull_mod
from tokenmill.models.catalog import CATALOG, CatalogEntry, Layout, PackagedFile
from tokenmill.models.resolve import ModelSource, installed_models, resolve_model

CONTENT = b"GGUF" + bytes(range(256)) * 8


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / "models"


@pytest.fixture
def packaged_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, home: Path) -> Path:
    """A catalog entry whose package is already on sys.path; pip is stubbed out."""
    site = tmp_path / "site"
    (site / "tmfake_resolve").mkdir(parents=True)
    gguf = site / "tmfake_resolve" / "m.gguf"
    gguf.write_bytes(CONTENT)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(pull_mod, "_run_pip", lambda args, *, progress, what: None)
    entry = CatalogEntry(
        name="fake-resolve",
        description="fake",
        architecture="llama",
        params="1K",
        license="MIT",
        layout=Layout.IN_PLACE,
        files=(PackagedFile("tmfake-resolve==1.0", "tmfake_resolve", "m.gguf"),),
        sha256=hashlib.sha256(CONTENT).hexdigest(),
        size_bytes=len(CONTENT),
    )
    monkeypatch.setitem(CATALOG, entry.name, entry)
    return gguf


def test_pulled_catalog_name_resolves_without_rehashing(packaged_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pull_mod.pull("fake-resolve", progress=False)
    monkeypatch.setattr(pull_mod, "_sha256_of", lambda *a, **k: pytest.fail("rehashed"))
    assert resolve_model("fake-resolve") == ModelSource("fake-resolve", packaged_model, "gguf")
    assert installed_models() == {"fake-resolve": packaged_model}


def test_catalog_name_not_pulled(home: Path) -> None:
    message = "model 'smollm2-135m' is not installed: run `tokenmill pull smollm2-135m`"
    with pytest.raises(ModelNotInstalledError) as info:
        resolve_model("smollm2-135m")
    assert str(info.value) == message
    assert installed_models() == {}


def test_file_changed_after_pull_is_not_installed(packaged_model: Path) -> None:
    pull_mod.pull("fake-resolve", progress=False)
    packaged_model.write_bytes(CONTENT[::-1])
    with pytest.raises(ModelNotInstalledError, match="tokenmill pull fake-resolve"):
        resolve_model("fake-resolve")


def test_gguf_path(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(CONTENT)
    assert resolve_model(str(path)) == ModelSource("tiny", path, "gguf")


def test_gguf_without_magic(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"<html>")
    with pytest.raises(ModelFormatError, match="GGUF magic"):
        resolve_model(str(path))


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(CONTENT)
    with pytest.raises(ModelFormatError, match=r"not a \.gguf file"):
        resolve_model(str(path))


def test_hf_directory(tmp_path: Path) -> None:
    for name in ("config.json", "model-00001-of-00002.safetensors", "tokenizer.json"):
        (tmp_path / name).write_text("{}")
    assert resolve_model(str(tmp_path)) == ModelSource(tmp_path.name, tmp_path, "hf")


def test_hf_directory_names_missing_pieces(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelFormatError, match=r"missing \*\.safetensors, tokenizer\.json") as info:
        resolve_model(str(tmp_path))
    assert "config.json," not in str(info.value).split("missing")[1].split("(")[0]


def test_unknown_name_lists_the_catalog(home: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("llama-70b")
    message = str(info.value)
    assert all(name in message for name in CATALOG)
    assert "tokenmill models" in message


# --- CLI ---


def test_cli_models_lists_the_catalog(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "arch", "params", "size", "license", "installed"]
    assert lines[1].startswith("smollm2-135m*")  # the default is marked
    assert all(line.endswith("not installed") for line in lines[1:])


def test_cli_models_shows_installed_path(packaged_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["pull", "fake-resolve", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(packaged_model)
    cli.main(["models"])
    assert any(line.endswith(str(packaged_model)) for line in capsys.readouterr().out.splitlines())


def test_cli_error_is_one_line(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["pull", "nope"]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("error: unknown model 'nope'")
    assert captured.err.count("\n") == 1
    assert captured.out == ""


def test_cli_interrupt_returns_130(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: object, **kwargs: object) -> Path:
        raise KeyboardInterrupt

    monkeypatch.setattr(pull_mod, "pull", interrupted)
    assert cli.main(["pull", "smollm2-135m"]) == 130
