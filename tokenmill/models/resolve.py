"""Turn what the user typed (a catalog name or a path) into a model file or directory to load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tokenmill.errors import ModelFormatError, ModelNotFoundError, ModelNotInstalledError
from tokenmill.models.catalog import CATALOG
from tokenmill.models.pull import verified_path

_GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True, slots=True)
class ModelSource:
    name: str
    path: Path  # the .gguf file, or the Hugging Face directory
    format: Literal["gguf", "hf"]


def resolve_model(name_or_path: str) -> ModelSource:
    """A catalog name (must be pulled), a .gguf file, or a Hugging Face safetensors directory."""
    if name_or_path in CATALOG:
        return _resolve_catalog(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return _resolve_gguf(path)
    if path.is_dir():
        return _resolve_hf_dir(path)
    names = ", ".join(CATALOG)
    raise ModelNotFoundError(
        f"model {name_or_path!r} is neither a catalog name ({names}) nor an existing path: "
        "run `tokenmill models` to list models"
    )


def installed_models() -> dict[str, Path]:
    """Catalog name → verified .gguf path, for the models that `pull` has finished."""
    found = {name: verified_path(entry) for name, entry in CATALOG.items()}
    return {name: path for name, path in found.items() if path is not None}


def _resolve_catalog(name: str) -> ModelSource:
    # Trust the marker pull wrote (size + mtime unchanged): rehashing 1 GB on every start is too slow.
    path = verified_path(CATALOG[name])
    if path is None:
        raise ModelNotInstalledError(f"model {name!r} is not installed: run `tokenmill pull {name}`")
    return ModelSource(name=name, path=path, format="gguf")


def _resolve_gguf(path: Path) -> ModelSource:
    if path.suffix != ".gguf":
        raise ModelFormatError(
            f"{path} is not a .gguf file: pass a .gguf file, a Hugging Face directory or a catalog name"
        )
    with path.open("rb") as handle:
        magic = handle.read(len(_GGUF_MAGIC))
    if magic != _GGUF_MAGIC:
        raise ModelFormatError(f"{path} lacks the GGUF magic: the file is corrupt, copy or download it again")
    return ModelSource(name=path.stem, path=path, format="gguf")


def _resolve_hf_dir(path: Path) -> ModelSource:
    missing = [piece for piece, present in _hf_pieces(path).items() if not present]
    if missing:
        raise ModelFormatError(
            f"{path} is not a Hugging Face model directory: missing {', '.join(missing)} "
            "(it needs config.json, *.safetensors and tokenizer.json)"
        )
    return ModelSource(name=path.resolve().name, path=path, format="hf")


def _hf_pieces(path: Path) -> dict[str, bool]:
    return {
        "config.json": (path / "config.json").is_file(),
        "*.safetensors": any(path.glob("*.safetensors")),
        "tokenizer.json": (path / "tokenizer.json").is_file(),
    }
