"""The load log's weights line: bytes a step against the file, and the methods `auto` chose per layer."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tokenmill.engine.loader import weights_summary


class _Model:
    def __init__(self, methods: list[str], nbytes: int) -> None:
        self._linears = {f"l{i}": SimpleNamespace(method=m) for i, m in enumerate(methods)}
        self._bytes = nbytes

    def linears(self) -> dict[str, Any]:
        return self._linears

    def weight_bytes(self) -> int:
        return self._bytes


def test_summary_counts_methods_and_compares_with_the_file(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"\0" * 1000)
    line = weights_summary(_Model(["q4", "q6+q4", "q4", "q8"], 1250), path)
    assert line.startswith("linear weights 0.00 GB (1.25x the 0.00 GB file): q4 x 2, ")
    assert "q6+q4 x 1" in line and "q8 x 1" in line


def test_a_directory_checkpoint_has_no_file_ratio(tmp_path: Path) -> None:
    line = weights_summary(_Model(["aten"], 2_000_000_000), tmp_path)
    assert line == "linear weights 2.00 GB: aten x 1"
    assert weights_summary(SimpleNamespace(), tmp_path) == "no linear-layer summary for this model"
