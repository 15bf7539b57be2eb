"""Session-wide fixtures shared by every test package."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

# Without a GPU, Triton kernels (kernels/triton_attention.py) run under Triton's interpreter. It is
# chosen when triton is first imported, so before any test can import it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if TYPE_CHECKING:
    from tests.fixtures.tiny_models import TinyArch


class TinyModels:
    """Builds each tiny checkpoint the first time a test asks for it, once per session.

    transformers is imported only then: it costs seconds, and most tests never need it.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def hf_dir(self, arch: TinyArch) -> Path:
        from tests.fixtures.tiny_models import make_tiny_hf

        path = self.root / "hf" / arch
        return path if (path / "config.json").is_file() else make_tiny_hf(arch, path)

    def gguf_path(self, arch: TinyArch) -> Path:
        from tests.fixtures.tiny_models import make_tiny_gguf

        path = self.root / "gguf" / f"tiny-{arch}.gguf"
        return path if path.is_file() else make_tiny_gguf(arch, path)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def tiny_hf_dir(tiny_models: TinyModels) -> Callable[[TinyArch], Path]:
    """`tiny_hf_dir("gemma3")` → a Hugging Face model directory (safetensors + tokenizer.json)."""
    return tiny_models.hf_dir


@pytest.fixture(scope="session")
def tiny_gguf_path(tiny_models: TinyModels) -> Callable[[TinyArch], Path]:
    """`tiny_gguf_path("gemma3")` → a GGUF file with the same weights as `tiny_hf_dir("gemma3")`."""
    return tiny_models.gguf_path


@pytest.fixture(scope="session")
def quant_gguf(tmp_path_factory: pytest.TempPathFactory) -> Callable[[TinyArch], Path]:
    """`quant_gguf(arch)`: the tiny model of `arch` written with 4/8-bit GGUF matrices."""
    from tests.fixtures.tiny_models import QUANT_LAYER_TYPES, make_tiny_gguf

    root = tmp_path_factory.mktemp("quant_gguf")
    made: dict[str, Path] = {}

    def make(arch: TinyArch) -> Path:
        if arch not in made:
            made[arch] = make_tiny_gguf(arch, root / f"tiny-{arch}-q.gguf", layer_types=QUANT_LAYER_TYPES)
        return made[arch]

    return make


@pytest.fixture(scope="session", autouse=True)
def native_cpu_kernels() -> None:
    """Build the native CPU kernels once, up front: on a fresh machine the first build takes about a
    minute, which must not land inside a test that waits seconds for a server to come up."""
    from tokenmill.kernels import cpu_kernels, glue_kernels, quant_kernels, stack_kernels

    cpu_kernels()
    glue_kernels()
    quant_kernels()
    stack_kernels()
