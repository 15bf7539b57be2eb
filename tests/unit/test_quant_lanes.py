"""Scale and offset lanes of the packed formats: fp16 where GGUF stored fp16, Q4_K's two levels (uint8
multipliers with fp16 lanes per 8 blocks), float32 for re-roundings, and how lanes of different kinds join:
always the values the float32 lanes would hold, so the kernels give the same bits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gguf import GGMLQuantizationType

from tests.fixtures.gguf_blocks import gguf_blocks
from tests.fixtures.quant_paths import ISAS, kernels, run
from tokenmill.layers import gguf_quant as gq
from tokenmill.layers import quant_formats as qf

T = GGMLQuantizationType
PASSES = [1, 2]
pytestmark = pytest.mark.skipif(kernels is None, reason="native quantized kernels cannot be built here")


def gguf_format(ggml_type: GGMLQuantizationType) -> qf.QuantFormat:
    return gq.GGUF_MAPPING[ggml_type][0]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q5_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_gguf_fp16_scales_stay_fp16_and_give_the_float32_result_exactly(isa: int,
                                                                       ggml_type: GGMLQuantizationType) -> None:
    """Types whose blocks store fp16 scales pack them as fp16: half the scale bytes, the same values."""
    raw = gguf_blocks(ggml_type, 37, 768, seed=4)
    mat = gq.from_gguf(raw, ggml_type, 768, gguf_format(ggml_type))
    assert mat.scale.dtype == torch.float16 and (mat.fmt == "q8" or mat.offset.dtype == torch.float16)
    wide = dataclasses.replace(mat, scale=mat.scale.float(), offset=mat.offset.float())
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(4))
    assert torch.equal(run(mat, x, isa), run(wide, x, isa))
    assert mat.nbytes < wide.nbytes


def test_q4_k_keeps_two_level_lanes_q8_rerounding_float32_and_a_q4_rerounding_fp16() -> None:
    """Q4_K's d·sc products are not fp16 values: its lanes stay in the file's two levels (uint8 sc and m a
    block, fp16 d and -dmin per 8 blocks); Q6_K → q8 (auto's near-lossless re-rounding) keeps float32;
    Q8_0 → q4 (a q4 draft, `--quantization q4`) rounds onto fp16 lanes."""
    for ggml_type, fmt, lanes in ((T.Q4_K, gguf_format(T.Q4_K), torch.uint8), (T.Q6_K, "q8", torch.float32),
                                  (T.Q8_0, "q4", torch.float16)):
        mat = gq.from_gguf(gguf_blocks(ggml_type, 8, 256, 2), ggml_type, 256, fmt)  # type: ignore[arg-type]
        assert mat.scale.dtype == lanes, ggml_type
        assert mat.two_level == (ggml_type == T.Q4_K)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("out_features", [8, 37, 72])
@pytest.mark.parametrize(("ggml_type", "fmt"), [(T.Q4_K, "q4"), (T.Q5_K, "q5")], ids=["Q4_K", "Q5_K"])
def test_two_level_lanes_give_the_float32_lanes_result_bit_for_bit(isa: int, out_features: int,
                                                                   ggml_type: T, fmt: qf.QuantFormat) -> None:
    """Q4_K (Q5_K) kept in two levels: each lane is sc · d formed in the kernel, the float32 lane's exact
    value, so the outputs equal the multiplied-out matrix's bit for bit on every tile (1-17 and 64 rows:
    the 1-row, duo, 256- and 512-bit tiles, a partial last group, an odd group), at 0.58 (0.70) bytes a
    weight against 0.75 (0.875). Four super-blocks a row (K = 1024), so a wrong super-block index shows."""
    raw = gguf_blocks(ggml_type, out_features, 1024, seed=out_features + 7)
    mat = gq.from_gguf(raw, ggml_type, 1024, fmt)
    flat = qf.expand_lanes(mat)
    assert mat.two_level and not flat.two_level and flat.scale.dtype == torch.float32
    assert torch.equal(mat.dequantize(), flat.dequantize())
    groups, fifth = -(-out_features // 8), (1 / 8 if fmt == "q5" else 0)
    assert mat.nbytes == groups * 8 * 1024 * (0.5 + fifth + 2 / 32 + 4 / 256)  # nibbles, bits, sc + m, d + dmin
    assert flat.nbytes == groups * 8 * 1024 * (0.5 + fifth + 8 / 32)
    duos = (0, 9, 17) if isa == 2 else (-1,)
    for rows in [*range(1, 18), 64]:
        x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows))
        for passes in PASSES:
            for duo_rows in duos:
                assert torch.equal(run(mat, x, isa, passes, duo_rows=duo_rows),
                                   run(flat, x, isa, passes, duo_rows=duo_rows)), (rows, passes, duo_rows)


def test_two_level_lanes_slice_and_join_by_whole_groups() -> None:
    """Row groups of two-level matrices concatenate (their super lanes with them); joined with another
    kind of lanes they are multiplied out into float32; the repack of a partial group keeps the values."""
    a = gq.from_gguf(gguf_blocks(T.Q4_K, 16, 512, 1), T.Q4_K, 512, "q4")
    b = gq.from_gguf(gguf_blocks(T.Q4_K, 5, 512, 2), T.Q4_K, 512, "q4")
    (joined,) = qf.concat([a, b])
    assert joined.two_level and joined.supers.shape == (2, 3, 16)
    assert torch.equal(joined.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    (regrouped,) = qf.concat([b, a])  # b ends mid-group: rows regrouped through float32 lanes
    assert torch.equal(regrouped.dequantize(), torch.cat([b.dequantize(), a.dequantize()]))
    q4_1 = gq.from_gguf(gguf_blocks(T.Q4_1, 8, 512, 3), T.Q4_1, 512, "q4")
    (mixed,) = qf.concat([q4_1, a])
    assert not mixed.two_level and mixed.scale.dtype == torch.float32
    assert torch.equal(mixed.dequantize(), torch.cat([q4_1.dequantize(), a.dequantize()]))


def test_two_level_lanes_without_their_super_lanes_are_an_error() -> None:
    assert kernels is not None
    mat = gq.from_gguf(gguf_blocks(T.Q4_K, 8, 256, 2), T.Q4_K, 256, "q4")
    with pytest.raises(RuntimeError, match="need supers"):
        kernels.quant_linear(torch.randn(2, 256), [mat.qs], [mat.scale], [mat.offset], [mat.rows], 2, 0)
    with pytest.raises(RuntimeError, match="need supers"):
        kernels.quant_linear(torch.randn(2, 256), [mat.qs], [mat.scale], [mat.offset], [mat.rows], 2, 0,
                             supers=[mat.supers[:, :, :4].contiguous()])


@pytest.mark.parametrize("fmt", qf.QUANT_FORMATS)
def test_a_scale_past_fp16s_range_keeps_float32(fmt: qf.QuantFormat) -> None:
    """Weights near 1e7 need scales over fp16's 65504: the matrix keeps float32 lanes, half a step."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)) * 1e7
    mat = qf.quantize(w, fmt)
    assert mat.scale.dtype == torch.float32
    blocks = w.view(16, 2, 32)
    lo, hi = blocks.aminmax(dim=-1)
    step = (hi - lo) / 15 if fmt == "q4" else blocks.abs().amax(-1) / (127 if fmt == "q8" else 15)
    assert ((mat.dequantize().view(16, 2, 32) - blocks).abs().amax(-1) <= step * (0.5 + 1e-5)).all()


def test_parts_of_one_format_with_fp16_and_float32_scales_join_as_float32() -> None:
    """One segment per run of a format (the repack cache counts them so); the values survive."""
    q4_0 = gq.from_gguf(gguf_blocks(T.Q4_0, 8, 256, 1), T.Q4_0, 256, "q4")
    q4_k = gq.from_gguf(gguf_blocks(T.Q4_K, 5, 256, 2), T.Q4_K, 256, "q4")
    (joined,) = qf.concat([q4_0, q4_k])
    assert joined.scale.dtype == torch.float32 and joined.offset.dtype == torch.float32
    assert torch.equal(joined.dequantize(), torch.cat([q4_0.dequantize(), q4_k.dequantize()]))
    (same,) = qf.concat([q4_0, q4_0])
    assert same.scale.dtype == torch.float16
