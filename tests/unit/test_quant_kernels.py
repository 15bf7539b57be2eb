"""The native q8/q4/q5 kernels against a float reference, on every code path this CPU runs.

Reference: the weights as gguf's own `dequantize` reads the GGUF blocks, times the activations
after the kernel's rounding (`quantize_activations`, itself checked against a torch model of that
rounding: one int8 pass, or two, the second the first's residual at a 254x finer step). With both
roundings held fixed, the kernel must agree to float summation error; every case runs both passes.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tests.fixtures.gguf_blocks import gguf_blocks
from tests.fixtures.quant_paths import AMX, ISAS, RUNNABLE, kernels, run
from tokenmill.layers import gguf_quant as gq
from tokenmill.layers import quant_formats as qf

T = GGMLQuantizationType
# Every type in the four packaged files, Q5_1 and Q5_K (Q5_K_M files: q5 with offset lanes), Q3_K (Q3_K_M: q6),
# IQ4_NL and IQ4_XS (iq4: their nibbles and table).
GGUF_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K, T.Q5_1, T.Q5_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS]
# (GGUF type, format) pairs a load can pick: each type's default mapping, and Q5_0 → q5 (--quantization
# q5, or gguf_format() where q5_0_format() picks it; every path computes it).
CASES = [pytest.param(t, gq.GGUF_MAPPING[t][0], id=t.name) for t in GGUF_TYPES] + [
    pytest.param(T.Q5_0, "q5", id="Q5_0-q5"), pytest.param(T.Q6_K, "q6", id="Q6_K-q6")]
# $TOKENMILL_Q5_K=q8 (A/B runs), and `auto`'s Q2_K (no format holds it exactly): one re-rounding
REROUNDED = [pytest.param(T.Q5_K, "q8", id="Q5_K-q8"), pytest.param(T.Q2_K, "q8", id="Q2_K-q8")]
ROWS = [1, 2, 3, 4, 5, 6, 7, 10, 16, 64]  # 5, 6, 10: tiles of 5-6 rows (a 1-2-row rest joins)
PASSES = [1, 2]
FINE = 254.0

pytestmark = pytest.mark.skipif(kernels is None, reason="native quantized kernels cannot be built here")


def is_exact(ggml_type: GGMLQuantizationType, fmt: qf.QuantFormat) -> bool:
    return fmt in ("q5", "q6") or (gq.GGUF_MAPPING[ggml_type] == (fmt, True))


def combined(qa: torch.Tensor) -> torch.Tensor:
    """The integer activation of each weight: q1 (one pass) or 254·q1 + q2 (two), [M, nb, 32]."""
    q = qa.to(torch.int32)
    return q[:, :, 0] if q.shape[2] == 1 else FINE * q[:, :, 0] + q[:, :, 1]


def rounded_activations(x: torch.Tensor, isa: int, passes: int) -> torch.Tensor:
    assert kernels is not None
    qa, d, _ = kernels.quantize_activations(x, passes, isa)
    return (combined(qa).double() * d.double().unsqueeze(-1)).view_as(x)


@pytest.mark.parametrize(("ggml_type", "fmt"), CASES + REROUNDED)
def test_exact_types_pack_to_gguf_dequantization(ggml_type: GGMLQuantizationType, fmt: qf.QuantFormat) -> None:
    rows, cols = 5, 512
    raw = gguf_blocks(ggml_type, rows, cols, seed=1)
    mat = gq.from_gguf(raw, ggml_type, cols, fmt)
    reference = torch.from_numpy(dequantize(raw, ggml_type)).reshape(rows, cols)
    if is_exact(ggml_type, fmt):
        assert torch.equal(mat.dequantize(), reference)  # no second rounding
    else:
        # Q6_K (Q5_K) → q8: one re-rounding, at most half an 8-bit step of each block's range.
        step = reference.view(rows, -1, 32).abs().amax(-1, keepdim=True) / 127
        err = (mat.dequantize().view(rows, -1, 32) - reference.view(rows, -1, 32)).abs()
        assert (err <= step * (0.5 + 1e-5)).all()
        assert err.max() > 0


@pytest.mark.parametrize("ggml_type", GGUF_TYPES, ids=lambda t: t.name)
def test_row_dequantization_equals_gguf_reference(ggml_type: GGMLQuantizationType) -> None:
    # The embedding's per-step row lookup (Q8_0 has its own fast path) gives gguf's floats exactly.
    raw = gguf_blocks(ggml_type, 3, 512, seed=2)
    reference = torch.from_numpy(dequantize(raw, ggml_type)).reshape(3, 512)
    assert torch.equal(gq.gguf_dequantize(raw, ggml_type, 512), reference)
    assert torch.equal(gq.gguf_dequantize(raw[1:2], ggml_type, 512), reference[1:2])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("passes", PASSES)
def test_activation_rounding_is_round_to_nearest_per_block(isa: int, passes: int) -> None:
    assert kernels is not None
    x = torch.randn(3, 96) * torch.tensor([1.0, 50.0, 1e-3]).repeat_interleave(32)
    x[1, 32:64] = 0  # an all-zero block: scale 0, quants 0
    qa, d, s = kernels.quantize_activations(x, passes, isa)
    assert qa.shape == (3, 3, passes, 32)
    blocks = x.view(3, 3, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    d1 = amax / 127
    r1 = torch.round(blocks * inv)
    assert torch.equal(qa[:, :, 0], r1.to(torch.int8))
    if passes == 1:
        torch.testing.assert_close(d, d1.squeeze(-1), rtol=0, atol=0)
    else:
        # Pass 2 rounds the residual of pass 1 (float32 steps as the kernel takes them) at step d1 / 254.
        resid = blocks - r1 * d1
        r2 = torch.round(resid * (FINE * inv)).clamp(-127, 127)
        assert torch.equal(qa[:, :, 1], r2.to(torch.int8))
        assert r2.abs().max() >= 100  # the second pass uses its range
        torch.testing.assert_close(d, (d1 / FINE).squeeze(-1), rtol=0, atol=0)
        # 15-bit activations: error at most half a fine step (plus float rounding of the residual).
        err = (rounded_activations(x, isa, passes).view(3, 3, 32) - blocks.double()).abs()
        assert (err <= d1.double() / (2 * FINE) * 1.01 + 1e-12).all()
    torch.testing.assert_close(s, d * combined(qa).float().sum(-1), rtol=0, atol=0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("passes", PASSES)
@pytest.mark.parametrize(("ggml_type", "fmt"), CASES)
@pytest.mark.parametrize("rows", ROWS)
def test_kernel_matches_float_reference(isa: int, passes: int, ggml_type: GGMLQuantizationType, fmt: qf.QuantFormat,
                                        rows: int) -> None:
    # Odd N (37 output rows); K is 256 * 3 = 768 (K-quants need whole 256-blocks; 768 is not a power of 2).
    out_features, in_features = 37, 768
    raw = gguf_blocks(ggml_type, out_features, in_features, seed=rows)
    mat = gq.from_gguf(raw, ggml_type, in_features, fmt)
    weight = torch.from_numpy(dequantize(raw, ggml_type)).reshape(out_features, in_features)
    if not is_exact(ggml_type, fmt):
        weight = mat.dequantize()  # the re-rounding is tested above; here the kernel's own math
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    y = run(mat, x, isa, passes)
    expected = rounded_activations(x, isa, passes) @ weight.double().T
    scale = expected.abs().max().item()
    assert y.shape == (rows, out_features)
    assert (y.double() - expected).abs().max().item() <= 2e-6 * scale
    # And against the unrounded activations: one int8 pass costs under 2% of the output range, two
    # passes under 0.02% (a 254x finer second step).
    unrounded = x.double() @ weight.double().T
    assert (y.double() - unrounded).abs().max().item() <= (0.02 if passes == 1 else 2e-4) * scale


@pytest.mark.parametrize("isa", ISAS)
def test_segments_of_mixed_formats_fill_one_output(isa: int) -> None:
    """A fused q/k/v whose parts are 4- and 8-bit: one call, each segment's rows in place."""
    assert kernels is not None
    a = gq.from_gguf(gguf_blocks(T.Q4_K, 9, 256, 3), T.Q4_K, 256, "q4")
    b = gq.from_gguf(gguf_blocks(T.Q8_0, 5, 256, 4), T.Q8_0, 256, "q8")
    c = gq.from_gguf(gguf_blocks(T.Q4_0, 3, 256, 5), T.Q4_0, 256, "q4")
    d = gq.from_gguf(gguf_blocks(T.Q5_0, 11, 256, 6), T.Q5_0, 256, "q5")
    e = gq.from_gguf(gguf_blocks(T.Q5_K, 4, 256, 7), T.Q5_K, 256, "q5")
    f = gq.from_gguf(gguf_blocks(T.Q5_1, 8, 256, 8), T.Q5_1, 256, "q5")
    segments = qf.concat([a, b, c, d, e, f])
    # Q5_0's implied offsets (-16 · scale) written out beside Q5_K's and Q5_1's: one q5 segment
    assert [s.fmt for s in segments] == ["q4", "q8", "q4", "q5"]
    assert segments[-1].offset.numel() and segments[-1].scale.dtype == torch.float32
    x = torch.randn(6, 256)
    for bf16_rows in (0, 1):  # (amx: its int8 tiles, then its bf16 tiles)
        y = kernels.quant_linear(x, [s.qs for s in segments], [s.scale for s in segments],
                                 [s.offset for s in segments], [s.rows for s in segments], 2, isa,
                                 [s.high for s in segments], amx_rows=1, bf16_rows=bf16_rows,
                                 supers=[s.supers for s in segments])
        expected = torch.cat([run(m, x, isa, bf16_rows=bf16_rows) for m in (a, b, c, d, e, f)], dim=1)
        torch.testing.assert_close(y, expected, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", qf.QUANT_FORMATS)
def test_float_quantization_round_trip(fmt: qf.QuantFormat) -> None:
    """Safetensors weights (and re-quantized GGUF types): round to nearest, half a step at most. q8
    keeps float32 lanes (its exact step); q4 and q5 round against fp16 lanes, half of the block's fp16
    step, which exceeds its exact step by 2⁻¹⁰ of it or a subnormal's 2⁻²⁴ (q4: the minimum rounded
    down first widens the span by 2⁻¹¹ of it). Row 3's second block is near zero (its scale an fp16
    subnormal)."""
    w = torch.randn(33, 160, generator=torch.Generator().manual_seed(5))
    w[3, 32:64] *= 1e-4
    blocks = w.view(33, 5, 32)
    lo, hi = blocks.aminmax(dim=-1)
    if fmt == "q8":
        step, shift = blocks.abs().amax(-1) / 127, 0.0
    elif fmt == "q5":
        step, shift = blocks.abs().amax(-1) / 15, 0.0
    else:
        step, shift = (hi - lo) / 15, (lo.abs() * 2**-11 + 2**-24) / 15
    mat = qf.quantize(w, fmt)
    err = (mat.dequantize().view(33, 5, 32) - blocks).abs().amax(-1)
    if fmt == "q8":
        assert mat.scale.dtype == torch.float32
        assert (err <= step / 2 + 1e-6).all()
    else:
        assert mat.scale.dtype == torch.float16  # 2 bytes a block's scale (and minimum), not 4
        assert (err <= (step + shift + 2**-24) * (0.5 + 2**-10)).all()
    assert (err > step * 0.45).any()  # the bound is not loose


@pytest.mark.parametrize("passes", PASSES)
def test_paths_agree_with_each_other(passes: int) -> None:
    assert kernels is not None
    mat = gq.from_gguf(gguf_blocks(T.Q4_1, 70, 512, 9), T.Q4_1, 512, "q4")
    x = torch.randn(13, 512)
    rounded = [kernels.quantize_activations(x, passes, isa) for isa in sorted(RUNNABLE)]
    for qa, d, s in rounded[1:]:  # one rounding on every path, bit for bit
        assert torch.equal(qa, rounded[0][0]) and torch.equal(d, rounded[0][1]) and torch.equal(s, rounded[0][2])
    outs = [run(mat, x, isa, passes) for isa in sorted(RUNNABLE)]
    for out in outs[1:]:  # same integer sums; only the float accumulation order differs
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-5 * outs[0].abs().max().item())


@pytest.mark.skipif(not {1, 2} <= RUNNABLE, reason="needs the avx2 and avx512vnni paths on this CPU")
@pytest.mark.parametrize(("ggml_type", "fmt"), [(T.Q4_0, "q4"), (T.Q4_1, "q4"), (T.Q8_0, "q8"), (T.Q4_K, "q4"),
                                               (T.Q6_K, "q8"), (T.Q5_0, "q5"), (T.Q6_K, "q6"), (T.Q5_1, "q5"),
                                               (T.Q5_K, "q5"), (T.Q3_K, "q6"), (T.IQ4_NL, "iq4"), (T.IQ4_XS, "iq4")],
                         ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("out_features", [8, 37, 64, 72])
@pytest.mark.parametrize("duo_rows", [0, 9, 17], ids=["no-duo", "duo", "duo-streams"])
def test_512_bit_tiles_equal_the_256_bit_path_bit_for_bit(ggml_type: GGMLQuantizationType, fmt: qf.QuantFormat,
                                                         out_features: int, duo_rows: int) -> None:
    """avx512vnni puts two row groups in one zmm (16 rows a vpdpwssd) and up to 8 activation rows in a
    tile, or (duo tiles, 1-8 rows; "duo-streams": 9-16 rows as two whole-range duo passes, what a matrix
    past kStreamBytes takes) two column pairs of one group, permuted row by row; every lane still
    takes the 256-bit tile's integer sums and float steps in order, so the outputs are equal bit for
    bit: an odd group left over (37 and 72 rows: 5 and 9 groups), a partial last group, every
    remainder of rows under the tile height, fp16 (Q4_0, Q8_0) and float32 scales."""
    assert kernels is not None
    raw = gguf_blocks(ggml_type, out_features, 512, seed=out_features)
    mat = gq.from_gguf(raw, ggml_type, 512, fmt)
    for rows in [*range(1, 18), 64]:
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        for passes in PASSES:
            assert torch.equal(run(mat, x, 2, passes, duo_rows=duo_rows), run(mat, x, 1, passes)), (rows, passes)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("ggml_type", "fmt"), CASES)
def test_a_row_gets_the_same_bits_whatever_rows_share_its_call(isa: int, ggml_type: GGMLQuantizationType,
                                                               fmt: qf.QuantFormat) -> None:
    """Row i of an M-row call equals the 1-row call of row i bit for bit, for M = 1..11 (tiles of 1-6
    rows on the 256-bit path, up to 8 on the 512-bit one): greedy speculation verifies 1 + k rows of
    a request where plain decoding scores one, and must pick the same tokens."""
    raw = gguf_blocks(ggml_type, 37, 512, seed=11)
    mat = gq.from_gguf(raw, ggml_type, 512, fmt)
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(11))
    alone = torch.cat([run(mat, x[i:i + 1], isa) for i in range(11)])
    for rows in range(1, 12):
        assert torch.equal(run(mat, x[:rows], isa), alone[:rows]), rows


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("ggml_type", [T.IQ4_NL, T.IQ4_XS], ids=lambda t: t.name)
def test_iq4_equals_its_tables_unpacked_into_q8_bit_for_bit(isa: int, ggml_type: GGMLQuantizationType) -> None:
    """iq4 looks each nibble up in the table inside the tile (vpshufb before the widening); q8 holds the same
    int8 values unpacked at load: the same integer sums and float steps, so the same bits, at half the bytes."""
    raw = gguf_blocks(ggml_type, 37, 512, seed=5)
    iq4, q8 = gq.from_gguf(raw, ggml_type, 512, "iq4"), gq.from_gguf(raw, ggml_type, 512, "q8")
    assert iq4.nbytes < 0.6 * q8.nbytes
    unpacked = qf.iq4_as_q8(iq4)  # kernel_ab's base conversion: the load's own q8 bytes
    assert torch.equal(unpacked.qs, q8.qs) and torch.equal(unpacked.scale, q8.scale)
    # --quantization q8 (and kernel_ab's base conversion) applies the table at load: gguf's floats exactly
    assert torch.equal(q8.dequantize(), torch.from_numpy(dequantize(raw, ggml_type)).reshape(37, 512))
    duos = (0, 9, 17) if isa == 2 else (-1,)
    for rows in [*range(1, 18), 64]:
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        for duo_rows in duos:
            same = torch.equal(run(iq4, x, isa, duo_rows=duo_rows), run(q8, x, isa, duo_rows=duo_rows))
            assert same, (rows, duo_rows)


def test_bad_inputs_are_errors_not_crashes() -> None:
    assert kernels is not None
    mat = qf.quantize(torch.randn(4, 64), "q8")
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.quant_linear(torch.randn(2, 40), [mat.qs], [mat.scale], [mat.offset], [mat.rows], 2, 0)
    with pytest.raises(RuntimeError, match="qs shape"):
        kernels.quant_linear(torch.randn(2, 96), [mat.qs], [mat.scale], [mat.offset], [mat.rows], 2, 0)
    with pytest.raises(RuntimeError, match="unknown quant ISA"):
        kernels.quant_linear(torch.randn(2, 64), [mat.qs], [mat.scale], [mat.offset], [mat.rows], 2, 7)
    with pytest.raises(RuntimeError, match="passes must be 1 or 2"):
        kernels.quant_linear(torch.randn(2, 64), [mat.qs], [mat.scale], [mat.offset], [mat.rows], 3, 0)


AMX_CASES = [(T.Q4_0, "q4"), (T.Q4_1, "q4"), (T.Q8_0, "q8"), (T.Q4_K, "q4"), (T.Q6_K, "q8"), (T.Q5_0, "q5"),
             (T.Q5_1, "q5"), (T.Q5_K, "q5")]
needs_amx = pytest.mark.skipif(AMX not in RUNNABLE, reason="this CPU (or OS) grants no AMX")


@needs_amx
@pytest.mark.parametrize(("ggml_type", "fmt"), AMX_CASES, ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("out_features", [8, 37, 72])
def test_amx_int8_tiles_equal_the_vnni_path_bit_for_bit(ggml_type: GGMLQuantizationType, fmt: qf.QuantFormat,
                                                        out_features: int) -> None:
    """The AMX-INT8 tiles form each block's integer sum from one tile product per activation pass
    (254 C1 + C2) and then take vpdpwssd's float steps lane for lane: the same bits at every M (a
    partial 16-row tile of activations, an odd group, a partial group, fp16 and float32 scales)."""
    raw = gguf_blocks(ggml_type, out_features, 512, seed=out_features)
    mat = gq.from_gguf(raw, ggml_type, 512, fmt)
    for rows in [1, 2, 15, 16, 17, 31, 33, 64]:
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        for passes in PASSES:
            assert torch.equal(run(mat, x, AMX, passes), run(mat, x, 2, passes)), (rows, passes)


@needs_amx
@pytest.mark.parametrize(("ggml_type", "fmt"), AMX_CASES, ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("out_features", [8, 37, 72, 100])
def test_amx_bf16_tiles_match_a_bf16_reference(ggml_type: GGMLQuantizationType, fmt: qf.QuantFormat,
                                               out_features: int) -> None:
    """The bf16 tiles compute bf16(x) . bf16(dequantized W) with fp32 sums: against that product in
    double, to fp32 summation error plus the odd bf16 tie that the reference's own fp32 weight
    (scale * q + offset, two roundings where the kernel fuses them) rounds the other way; and against
    the unrounded product, bf16's error. Partial tiles in M (17, 33, 100 rows) and N (37, 72, 100)."""
    in_features = 768
    raw = gguf_blocks(ggml_type, out_features, in_features, seed=out_features + 1)
    mat = gq.from_gguf(raw, ggml_type, in_features, fmt)
    weight = mat.dequantize().double()
    for rows in [1, 16, 17, 33, 64, 100]:
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
        y = run(mat, x, AMX, bf16_rows=1).double()
        expected = x.bfloat16().double() @ weight.bfloat16().double().T
        scale = expected.abs().max().item()
        assert y.shape == (rows, out_features)
        assert (y - expected).abs().max().item() <= 2e-4 * scale, rows
        assert (y - x.double() @ weight.T).abs().max().item() <= 1e-2 * scale, rows


@needs_amx
def test_amx_path_picks_its_tiles_by_rows() -> None:
    """isa amx: the VNNI tiles below amx_min_rows(), the int8 tiles (same bits) up to amx_bf16_rows(),
    the bf16 tiles from there; the thresholds are the CPU's defaults unless a call names its own."""
    assert kernels is not None
    mat = gq.from_gguf(gguf_blocks(T.Q4_K, 40, 512, 11), T.Q4_K, 512, "q4")
    assert kernels.amx_min_rows() >= 1 and kernels.amx_bf16_rows() > kernels.amx_min_rows()

    def default(x: torch.Tensor) -> torch.Tensor:
        assert kernels is not None
        return kernels.quant_linear(x, [mat.qs], [mat.scale], [mat.offset], [mat.rows], 2, AMX, [mat.high],
                                    supers=[mat.supers])

    small = torch.randn(kernels.amx_min_rows() - 1 or 1, 512)
    assert torch.equal(default(small), run(mat, small, 2))
    big = torch.randn(kernels.amx_bf16_rows(), 512)
    assert torch.equal(default(big), run(mat, big, AMX, bf16_rows=1))
    assert not torch.equal(default(big), run(mat, big, 2))  # bf16 rounding, not the integer paths'
