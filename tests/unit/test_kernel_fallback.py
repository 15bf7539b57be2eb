"""Where the native CPU kernels cannot be built, tokenmill falls back to PyTorch, and says so once."""

from __future__ import annotations

import logging

import pytest
import torch

import tokenmill.kernels as kernels
from tokenmill.errors import TokenmillError
from tokenmill.layers.attention import decode_kernel
from tokenmill.layers.linear import kernel_name, linear_kernel


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
    assert decode_kernel("auto", torch.device("cuda")) is None
