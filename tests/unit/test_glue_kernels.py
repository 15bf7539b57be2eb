"""The native norm/RoPE glue (kernels/glue_kernels.cpp) against the ATen math it replaces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import glue_kernels
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary

glue = glue_kernels()
pytestmark = pytest.mark.skipif(glue is None, reason="native glue kernels cannot be built here")


@pytest.mark.parametrize("shape", [(1, 576), (7, 896), (3, 5, 64)])
def test_rms_norm_matches_aten(shape: tuple[int, ...]) -> None:
    assert glue is not None
    x, w = torch.randn(*shape) * 3, torch.randn(shape[-1])
    torch.testing.assert_close(glue.rms_norm(x, w, 1e-6), F.rms_norm(x, (shape[-1],), w, 1e-6), rtol=1e-5, atol=1e-5)


def test_add_rms_norm_updates_the_residual_in_place() -> None:
    assert glue is not None
    x, residual, w = torch.randn(4, 256), torch.randn(4, 256), torch.randn(256)
    expected_sum = residual + x
    y = glue.add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(residual, expected_sum)
    torch.testing.assert_close(y, F.rms_norm(expected_sum, (256,), w, 1e-5), rtol=1e-5, atol=1e-5)


def test_rms_norm_module_uses_native_and_aten_alike() -> None:
    norm = RMSNorm(128, 1e-6)
    norm.load(torch.randn(128), torch.float32)
    assert norm.native is not None
    x = torch.randn(3, 128)
    native = norm(x)
    norm.native = None
    torch.testing.assert_close(native, norm(x), rtol=1e-5, atol=1e-5)
    residual_a, residual_b = torch.randn(3, 128), None
    residual_b = residual_a.clone()
    aten = norm.add_forward(x, residual_a)
    norm.native = glue
    torch.testing.assert_close(norm.add_forward(x, residual_b), aten, rtol=1e-5, atol=1e-5)
    assert torch.equal(residual_a, residual_b)


def test_rope_in_place_on_a_strided_view_matches_aten() -> None:
    """q and k rotate as one view into the fused q/k/v output: rows strided, v left alone."""
    rope = RotaryEmbedding(64, 128, 10000.0, 1.0, torch.float32, torch.device("cpu"))
    positions = torch.tensor([0, 5, 17, 127])
    cos, sin = rope.tables(positions)
    heads = torch.randn(4, 9 + 2 * 3, 64)
    qk = heads[:, :12]
    expected = apply_rotary(qk.clone(), cos, sin)
    v_before = heads[:, 12:].clone()
    out = apply_rotary(qk, cos, sin, glue)
    assert out.data_ptr() == heads.data_ptr()  # in place
    torch.testing.assert_close(heads[:, :12], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(heads[:, 12:], v_before)


def test_bad_inputs_are_errors() -> None:
    assert glue is not None
    with pytest.raises(RuntimeError, match="weight must be float32"):
        glue.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="head_dim must be even"):
        glue.rope_(torch.randn(2, 1, 7), torch.randn(2, 7), torch.randn(2, 7))
