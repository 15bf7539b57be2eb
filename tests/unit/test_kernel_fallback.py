"""Where the native CPU kernels cannot be built, tokenmill falls back to PyTorch, and says so once."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import tokenmill.kernels as kernels
from tokenmill.errors import TokenmillError
from tokenmill.layers.attention import decode_kernel
from tokenmill.layers.dense_kernels import kernel_name, linear_kernel


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.utils.cpp_extension

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Ninja is required to load C++ extensions\nmore detail")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fail)
    monkeypatch.setattr(kernels, "_state", {})  # forget the module this session already built


def test_build_failure_is_one_warning_and_none(no_compiler: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tokenmill.kernels"):
        assert kernels.cpu_kernels() is None
        assert kernels.cpu_kernels() is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["native CPU kernels unavailable, using the PyTorch paths: "
                        "Ninja is required to load C++ extensions"]


def test_auto_falls_back_and_native_is_a_clear_error(no_compiler: None) -> None:
    assert decode_kernel("auto", torch.device("cpu")) is None
    assert decode_kernel("sdpa", torch.device("cpu")) is None
    with pytest.raises(TokenmillError, match="use --attention-backend sdpa"):
        decode_kernel("native", torch.device("cpu"))
    assert not kernel_name(linear_kernel(torch.zeros(8, 8))).startswith("native")


def test_gpu_auto_never_builds_the_cpu_kernel() -> None:
    """On CUDA, auto is the Triton kernel (or SDPA where triton is missing), never the CPU module."""
    kernel = decode_kernel("auto", torch.device("cuda"))
    assert kernel is None or type(kernel).__name__ == "TritonDecodeKernels"


@pytest.fixture
def recorded_load(monkeypatch: pytest.MonkeyPatch, tmp_path):  # type: ignore[no-untyped-def]
    import torch.utils.cpp_extension

    calls: list[dict[str, object]] = []

    def build_directory(name: str, verbose: bool) -> str:
        path = tmp_path / "extensions" / name
        path.mkdir(parents=True, exist_ok=True)
        return str(path)

    def load(**kwargs: object) -> object:
        calls.append(kwargs)
        assert not (Path(str(kwargs["build_directory"])) / "lock").exists(), "torch would wait on this lock forever"
        return "module"

    monkeypatch.setattr(torch.utils.cpp_extension, "_get_build_directory", build_directory)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    return calls


def test_a_killed_builds_lock_is_removed_and_two_checkouts_share_one_build(
        recorded_load: list[dict[str, object]], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sources = []
    for checkout in ("main", "ci-clone"):
        source = tmp_path / checkout / "kernel.cpp"
        source.parent.mkdir()
        source.write_text("// the same kernel in two checkouts\n")
        for header in kernels._HEADERS:
            (source.parent / header).write_text("// the shared header\n")
        sources.append(source)
    name = kernels._build_name("k", sources[0])
    stale = tmp_path / "extensions" / name / "lock"
    stale.parent.mkdir(parents=True)
    stale.write_text("")  # what a builder killed mid-build leaves behind
    with caplog.at_level(logging.WARNING, logger="tokenmill.kernels"):
        assert kernels._build("k", sources[0], [], "k", "none") == "module"
    assert not stale.exists()
    assert any("stale build lock" in r.getMessage() for r in caplog.records)
    assert kernels._build("k", sources[1], [], "k", "none") == "module"
    # The same build arguments from both checkouts: torch keeps one build instead of alternating.
    assert recorded_load[0]["sources"] == recorded_load[1]["sources"] == [str(stale.parent / "kernel.cpp")]
    assert (stale.parent / "kernel.cpp").read_text() == sources[0].read_text()
    assert (stale.parent / "c_api.h").read_text() == "// the shared header\n"  # beside it for #include
    # A changed shared header (a C entry point's signature) names a new build of every module.
    (sources[0].parent / "c_api.h").write_text("// a changed signature\n")
    assert kernels._build_name("k", sources[0]) != name


@pytest.mark.slow
def test_a_variant_build_loads_beside_the_default_one(tmp_path: Path) -> None:
    """benchmarks/kernel_ab.py loads another revision's modules next to this tree's: a variant is its own
    module (another cached name), built from the sources it was given."""
    default = kernels.glue_kernels()
    if default is None:
        pytest.skip("no compiler here")
    for name in ("glue_kernels.cpp", "c_api.h", "quant_amx.h"):
        text = (Path(kernels.__file__).parent / name).read_text()
        if name == "glue_kernels.cpp":  # a visibly different variant: its norm doubles the output
            text = text.replace("rms_row(xp + t * D, wp, yp + t * D, D, static_cast<float>(eps));",
                                "{ rms_row(xp + t * D, wp, yp + t * D, D, static_cast<float>(eps)); "
                                "for (int64_t i = 0; i < D; ++i) yp[t * D + i] *= 2.f; }")
        (tmp_path / name).write_text(text)
    variant = kernels.build_variant("glue", tmp_path, "testvariant")
    assert variant is not None and variant is not default
    x, w = torch.randn(3, 64), torch.rand(64)
    torch.testing.assert_close(variant.rms_norm(x, w, 1e-6), 2 * default.rms_norm(x, w, 1e-6))
    assert kernels.glue_kernels() is default
