"""GEMM dispatch: which kernel a weight gets, and that the kernels agree."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import ModelConfig
from tokenmill.errors import TokenmillError
from tokenmill.kernels import cpu_kernels
from tokenmill.layers.dense_kernels import ONEDNN_MIN_NUMEL, kernel_name, linear_kernel, onednn_supported

needs_onednn = pytest.mark.skipif(not onednn_supported(torch.device("cpu"), torch.float32),
                                  reason="this torch build has no oneDNN")


@needs_onednn
def test_auto_sends_only_large_cpu_weights_to_onednn() -> None:
    small = torch.zeros(64, 64)
    large = torch.zeros(-(-ONEDNN_MIN_NUMEL // 64), 64)
    native = "native+" if cpu_kernels() is not None else ""
    assert kernel_name(linear_kernel(small)) == native + "aten"
    assert kernel_name(linear_kernel(large)) == native + "onednn"
    assert kernel_name(linear_kernel(large, "aten")) == "aten"
    assert kernel_name(linear_kernel(small, "onednn")) == "onednn"


def test_float16_on_cpu_stays_on_aten() -> None:
    assert kernel_name(linear_kernel(torch.zeros(ONEDNN_MIN_NUMEL, 2, dtype=torch.float16), "onednn")) == "aten"


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("in_features", [96, 101])  # 101: the native kernel's scalar tail
def test_every_kernel_matches_aten(rows: int, with_bias: bool, in_features: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(200, in_features, generator=g)
    b = torch.randn(200, generator=g) if with_bias else None
    ref = linear_kernel(w, "aten")(x, w, b)
    for backend in ("onednn", "auto"):
        out = linear_kernel(w, backend)(x, w, b)
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


def test_unknown_backend_is_a_clear_error() -> None:
    with pytest.raises(TokenmillError, match="gemm backend 'mkl' is not supported"):
        ModelConfig("smollm2-135m", gemm_backend="mkl")
    with pytest.raises(ValueError, match="not supported"):
        linear_kernel(torch.zeros(2, 2), "mkl")


def test_bfloat16_weights_get_a_kernel_that_runs_on_this_cpu() -> None:
    """Whatever the CPU (oneDNN bf16 only with AVX512-BF16/AMX), a bf16 matmul runs and is right."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(ONEDNN_MIN_NUMEL // 64 + 64, 64, generator=g).bfloat16()  # large enough for oneDNN
    x = torch.randn(9, 64, generator=g).bfloat16()
    out = linear_kernel(weight)(x, weight, None)
    torch.testing.assert_close(out.float(), x.float() @ weight.float().T, atol=0.1, rtol=0.02)


@pytest.mark.parametrize("keep", [8, 13, 40, 97, 104])
def test_first_rows_of_a_dense_layer_are_its_rows(keep: int) -> None:
    from tokenmill.layers.linear import DenseLinear

    g = torch.Generator().manual_seed(keep)
    w, b = torch.randn(104, 96, generator=g), torch.randn(104, generator=g)
    full = DenseLinear(w, b, "auto")
    head = full.first_rows(keep)
    for rows in (1, 3, 9):
        x = torch.randn(rows, 96, generator=g)
        # BLAS blocks a narrower matrix differently: equal to rounding, not bit for bit.
        torch.testing.assert_close(head(x), full(x)[:, :keep], rtol=1e-5, atol=1e-5)
    assert head.out_features == keep and head.weight.data_ptr() == w.data_ptr()  # a view, no copy
    with pytest.raises(ValueError, match="first_rows"):
        full.first_rows(105)


@pytest.mark.skipif(cpu_kernels() is None or __import__("tokenmill.kernels").kernels.quant_kernels() is None,
                    reason="native quantized kernels cannot be built here")
@pytest.mark.parametrize("keep", [8, 13, 40, 61, 100])
@pytest.mark.parametrize("fmts", [("q8",), ("q4",), ("q5",), ("q4", "q8")])  # two segments: rows 0-59, 60-103
def test_first_rows_of_a_quantized_layer_are_its_rows_bit_for_bit(keep: int, fmts: tuple[str, ...]) -> None:
    from tokenmill.kernels import available_quant_isas, quant_kernels
    from tokenmill.layers import quant_formats as qf
    from tokenmill.layers.linear import QuantLinear

    g = torch.Generator().manual_seed(keep)
    w = torch.randn(104, 256, generator=g)
    parts = [w] if len(fmts) == 1 else [w[:60], w[60:]]
    segments = qf.concat([qf.quantize(part, fmt) for part, fmt in zip(parts, fmts, strict=True)])  # type: ignore[arg-type]
    bias = torch.randn(104, generator=g)
    for isa in available_quant_isas():
        full = QuantLinear(segments, bias, torch.float32, quant_kernels(), isa)
        head = full.first_rows(keep)
        assert head.out_features == keep
        assert head.method == (fmts[0] if keep <= 60 or len(fmts) == 1 else full.method)  # segments past `keep` go
        for rows in (1, 4, 7):
            x = torch.randn(rows, 256, generator=g)
            assert torch.equal(head(x), full(x)[:, :keep]), (isa, rows)
        assert head.qs[0].data_ptr() == full.qs[0].data_ptr()  # views of the same packed bytes
