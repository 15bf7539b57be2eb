"""The two internal weight formats of quantized linear layers, and how GGUF blocks map onto them.

All are blocks of 32 consecutive weights of one output row (K = in_features = 32 * nb):

    q8:  w = scale * q             q int8 in [-127, 127]
    q4:  w = scale * q + offset    q in [0, 15], two per byte
    q5:  w = scale * (q - 16)      q in [0, 31]: q4's nibbles plus a plane of fifth bits (GGUF Q5_0),
         or scale * q + offset     with offset lanes as q4's (GGUF Q5_1; Q5_K in its two levels)
    iq4: w = scale * T[q]          q in [0, 15]: q4's nibbles through a 16-entry int8 table T (GGUF IQ4_NL, IQ4_XS)

Kernel layout (what quant_kernels.cpp reads): rows in groups of 8 (ROW_GROUP; the last group
padded with zero rows), each group's blocks back to back, and inside a block the 8 rows interleaved
in pairs of neighbouring weights, so that one 16-byte load widened to int16 is [row 0: w_2p w_2p+1 |
row 1: w_2p w_2p+1 | ... | row 7: ...]: 8 output rows in the 8 int32 lanes of one `madd`, no
horizontal sums (the kernel's comment has the arithmetic).

    group g = rows 8g .. 8g+7, block b = columns 32b .. 32b+31, w(r, j) = weight of row 8g+r, column 32b+j
    qs     q8: [G, nb * 256] int8    block (g, b) = 16 pairs p x 8 rows r x 2:  w(r, 2p), w(r, 2p+1)
           q4: [G, nb * 128] uint8   block (g, b) = 8 pairs c x 8 rows r x 2 bytes, byte e of (c, r) =
                                     w(r, 2c+e) | w(r, 2c+e+16) << 4  (low nibbles: pairs 0-7, high: 8-15)
    scale  [G, nb * 8] float32       block (g, b) = the 8 rows' scales; fp16 where the GGUF block stored an
                                     fp16 scale that is the packed scale exactly (Q8_0, Q5_0, Q4_0, Q4_1):
                                     half the bytes, the same values; uint8 for two-level lanes (Q4_K's own
                                     form: scale = sc · d, sc a 6-bit multiplier a block, d fp16 per 8 blocks)
    offset [G, nb * 8] like scale    q4, and q5 from Q5_1 / Q5_K; same order and dtype as scale (a q5
                                     without offset lanes has -16 * scale, implied)
    supers [2, G, nb] fp16           two-level lanes only (q4 from Q4_K, q5 from Q5_K; nb a multiple of 8):
                                     per (g, super-block t = b // 8)
                                     the 8 rows' d (index 0: the scale's, 1: the offset's, -dmin), at
                                     g·nb + 8t + r; a lane is then multiplier · d, exact in float32
    high   [G, nb * 32] uint8        q5 only: per (g, b), 8 chunks c x (low, high nibbles) of a
                                     little-endian uint16 whose bit 2r + e is the fifth bit of the
                                     weight in lane 2r + e of that chunk's widened int16 vector,
                                     i.e. of w(r, 2c+e) (low) and w(r, 2c+e+16) (high). One mask
                                     register load ORs 16 into the lanes that have it (AVX-512BW).

                 block b of group g (q8: 256 bytes)
          pair 0            pair 1                 pair 15
       ┌───────────────┬───────────────┬─── ... ─┬───────────────┐
       │r0 r1 ... r7   │r0 r1 ... r7   │         │r0 r1 ... r7   │   each rN = 2 weights (cols 2p, 2p+1)
       └───────────────┴───────────────┴─── ... ─┴───────────────┘
         16 bytes → vpmovsxbw → 8 lanes x (2 x int16) → madd with the broadcast activation pair

(The q4 byte keeps GGUF Q4_0/Q4_1's own nibble pairing j | j+16, so GGUF rows move as whole bytes.)

How GGUF blocks map onto these formats: layers/gguf_quant.py.
Rows are independent, so fused matrices (q/k/v, gate/up) are row concatenations of packed rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch
from gguf import GGMLQuantizationType

from tokenmill.layers.quant_bits import (
    BLOCK,
    HIGH_BYTES,
    ROW_GROUP,
    pack_high,
    pack_nibbles,
    unpack_high,
    unpack_nibbles,
)

QuantFormat = Literal["q8", "q4", "q5", "q6", "iq4"]
QUANT_FORMATS: tuple[QuantFormat, ...] = ("q8", "q4", "q5")  # `--quantization` modes (any float matrix rounds to them)
PACKED_FORMATS: tuple[QuantFormat, ...] = (*QUANT_FORMATS, "q6", "iq4")  # q6, iq4: GGUF blocks only (Q6_K/Q3_K, IQ4_*)
# 16-byte chunks per (group, block), each 8 rows x 2 bytes: q8 16 (a column pair of int8 per row),
# q4 and q5 8 (two column pairs per row, in the bytes' low and high nibbles).
_PAIRS: dict[str, int] = {"q8": 16, "q4": 8, "q5": 8, "q6": 8, "iq4": 8}
SUPER = 8  # blocks per two-level super-block (Q4_K's 256 weights)
QUANT_LAYOUT_VERSION = 6  # bump when packed bytes change meaning: it keys the on-disk cache (loading/repack_cache.py)
@dataclass(frozen=True, slots=True)
class RawBlocks:
    """A GGUF tensor's stored blocks, rows in Hugging Face order: uint8 [rows, row_bytes]."""

    ggml_type: GGMLQuantizationType
    shape: tuple[int, int]
    data: np.ndarray


_EMPTY_U8 = torch.empty(0, dtype=torch.uint8)
_EMPTY_F16 = torch.empty(0, dtype=torch.float16)


@dataclass(frozen=True, slots=True)
class QuantMatrix:
    """One packed [rows, cols] matrix in the kernel's interleaved layout (module docstring)."""

    fmt: QuantFormat
    qs: torch.Tensor  # q8: int8 [G, nb * 256]; q4, q5, q6: uint8 [G, nb * 128]   (G = ceil(rows / 8))
    scale: torch.Tensor  # float32 or float16 [G, nb * 8]; uint8 multipliers for two-level lanes; q6: int8 [G, nb * 16]
    offset: torch.Tensor  # [G, nb * 8] for q4 (and q5 from Q5_1 / Q5_K), scale's dtype; else empty
    rows: int  # true output rows (the last group's padding excluded)
    high: torch.Tensor = _EMPTY_U8  # q5: uint8 [G, nb * 32] fifth bits; q6: [G, nb * 64] (bits 4, 5); iq4: int8 [16] T
    supers: torch.Tensor = _EMPTY_F16  # two-level lanes (q4/q5 from Q4_K/Q5_K): fp16 [2, G, nb]; q6: [1, G, nb]

    @property
    def cols(self) -> int:
        return int(self.qs.shape[1]) // (_PAIRS[self.fmt] * ROW_GROUP * 2) * BLOCK

    @property
    def two_level(self) -> bool:
        """q4/q5 lanes in Q4_K's / Q5_K's two levels (q6's are always two-level: int8 a half-block, fp16 supers)."""
        return self.fmt in ("q4", "q5") and self.supers.numel() > 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scale, self.offset, self.high, self.supers))

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols]: the weights the kernel multiplies by."""
        rm = row_major(self)
        nb = rm.scale.shape[1]
        q = rm.qs if self.fmt == "q8" else unpack_nibbles(rm.qs)
        if self.fmt == "iq4":  # w = scale * T[q]
            w = self.high[q.long()].reshape(self.rows, nb, BLOCK).float() * rm.scale.float().unsqueeze(-1)
            return w.reshape(self.rows, self.cols)
        if rm.high is not None:
            q = q | (rm.high << 4)
        if self.fmt == "q6":  # scale per 16-column half: w = scale * (q - 32)
            w = (q.reshape(self.rows, nb, 16).float() - 32.0) * rm.scale.float().unsqueeze(-1)
            return w.reshape(self.rows, self.cols)
        w = q.reshape(self.rows, nb, BLOCK).float() * rm.scale.float().unsqueeze(-1)
        if rm.offset is not None:
            w = w + rm.offset.float().unsqueeze(-1)
        elif self.fmt == "q5":  # the kernel's implied offset: -16 * scale (exact: a power of two)
            w = w + (rm.scale.float() * -16.0).unsqueeze(-1)
        return w.reshape(self.rows, self.cols)


@dataclass(frozen=True, slots=True)
class RowMajor:
    """A matrix's packed values in row order: qs (q8: int8 [rows, cols]; q4/q5/q6: uint8 [rows, cols / 2],
    byte j of a block = q_j | q_(j+16) << 4, low 4 bits), scale/offset [rows, nb] (q6: float32 scale
    [rows, 2 nb], one a 16-column half), high (q5: uint8 [rows, cols] of 0/1, the fifth bits; q6: q >> 4,
    0-3; iq4: its int8 [16] table; else None)."""

    qs: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    high: torch.Tensor | None = None


def packed_shapes(fmt: QuantFormat, rows: int, cols: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(qs shape, scale/offset shape) of a [rows, cols] matrix in the kernel layout."""
    groups, nb = -(-rows // ROW_GROUP), cols // BLOCK
    return (groups, nb * _PAIRS[fmt] * ROW_GROUP * 2), (groups, nb * ROW_GROUP * (2 if fmt == "q6" else 1))


def high_shape(rows: int, cols: int, fmt: QuantFormat = "q5") -> tuple[int, int]:
    """q5's fifth-bit plane (q6's two planes) in the kernel layout."""
    return (-(-rows // ROW_GROUP), cols // BLOCK * HIGH_BYTES * (2 if fmt == "q6" else 1))


def interleave(fmt: QuantFormat, qs: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
               high: torch.Tensor | None = None) -> QuantMatrix:
    """Row-major packed rows (RowMajor's fields) → the kernel layout. A pure permutation of bytes (and,
    for q5's fifth bits, of bits)."""
    rows, nb = scale.shape
    qs, scale = _pad(qs, rows), _pad(scale, rows)
    groups = qs.shape[0] // ROW_GROUP
    if fmt == "iq4":  # high: the table itself, not per row
        if high is None or high.dtype != torch.int8 or high.numel() != 16 or offset is not None:
            raise ValueError("iq4 takes its 16-entry int8 table as high, and no offset")
        return QuantMatrix(fmt, _interleaved_qs(qs, fmt, groups, nb), _by_group(scale, groups), torch.empty(0), rows,
                           high.contiguous())
    offset = None if offset is None else _pad(offset, rows)
    high = None if high is None else _pad(high, rows)
    if (fmt == "q5") != (high is not None):
        raise ValueError("q5, and only q5, has fifth bits")
    return QuantMatrix(fmt, _interleaved_qs(qs, fmt, groups, nb), _by_group(scale, groups),
                       torch.empty(0) if offset is None else _by_group(offset, groups), rows,
                       _EMPTY_U8 if high is None else pack_high(high, groups, nb))


def interleave_q6(qs: torch.Tensor, scale: torch.Tensor, d: torch.Tensor, high: torch.Tensor) -> QuantMatrix:
    """Row-major q6 parts → the kernel layout (w = scale_h · d · (q − 32), q in [0, 63], GGUF Q6_K's own blocks):
    qs uint8 [rows, cols / 2] q4-paired low nibbles; scale int8 [rows, 2 nb] (block b's 16-column halves at
    2b, 2b + 1); d fp16 [rows, nb / 8] (one a 256-weight super-block); high uint8 [rows, cols] = q >> 4.

    Packed: qs as q4; scale int8 [G, nb * 16], per (g, b) the 8 rows' low-half lanes then their high-half
    lanes; high [G, nb * 64], per (g, b) q5's mask plane of bit 4 then that of bit 5; supers fp16 [1, G, nb]
    as two-level q4's."""
    rows, nb = scale.shape[0], scale.shape[1] // 2
    if nb % SUPER:
        raise ValueError("q6 needs K a multiple of 256")
    qs, scale, d, high = _pad(qs, rows), _pad(scale, rows), _pad(d, rows), _pad(high, rows)
    groups = qs.shape[0] // ROW_GROUP
    planes = torch.stack([pack_high(high & 1, groups, nb).view(groups, nb, HIGH_BYTES),
                          pack_high(high >> 1, groups, nb).view(groups, nb, HIGH_BYTES)], dim=2)
    return QuantMatrix("q6", _interleaved_qs(qs, "q6", groups, nb), _by_group(scale, groups), torch.empty(0), rows,
                       planes.reshape(groups, nb * 2 * HIGH_BYTES).contiguous(),
                       _by_group(d.to(torch.float16), groups).unsqueeze(0))


def _pad(part: torch.Tensor, rows: int) -> torch.Tensor:
    """A row-major part of `rows` rows with zero rows appended up to a whole 8-row group."""
    pad = -rows % ROW_GROUP
    return torch.cat([part, part.new_zeros(pad, part.shape[1])]) if pad else part


def _interleaved_qs(qs: torch.Tensor, fmt: QuantFormat, groups: int, nb: int) -> torch.Tensor:
    # [G, 8 rows, nb, pairs, 2] → [G, nb, pairs, 8 rows, 2]: (16 pairs of int8 | 8 pairs of nibble bytes).
    # A pair's two bytes move together, so they move as one int16: a third of a byte-wise permute's time.
    packed = _pairs_as_int16(qs).reshape(groups, ROW_GROUP, nb, _PAIRS[fmt]).permute(0, 2, 3, 1)
    return packed.reshape(groups, -1).contiguous().view(qs.dtype)


def _by_group(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Row-major lanes [G * 8, n] (padded) → the kernel's [G, n * 8]: lane j of rows 8g .. 8g + 7 side by side."""
    return t.reshape(groups, ROW_GROUP, -1).transpose(1, 2).reshape(groups, -1).contiguous()


def _by_row(t: torch.Tensor, groups: int) -> torch.Tensor:
    """_by_group's inverse: [G, n * 8] → [G * 8, n] (padding rows included)."""
    return t.reshape(groups, -1, ROW_GROUP).transpose(1, 2).reshape(groups * ROW_GROUP, -1)


def _pairs_as_int16(qs: torch.Tensor) -> torch.Tensor:
    """Byte pairs (a row's two weights of one pair, or its two nibble bytes) as int16 elements."""
    return qs.contiguous().view(torch.int16)


def row_major(mat: QuantMatrix) -> RowMajor:
    """interleave's inverse, padding rows dropped (two-level lanes come back as their float32 values)."""
    mat = expand_lanes(mat)
    groups, nb = mat.qs.shape[0], mat.cols // BLOCK
    pairs = _PAIRS[mat.fmt]
    qs = _pairs_as_int16(mat.qs).reshape(groups, nb, pairs, ROW_GROUP).permute(0, 3, 1, 2)
    qs = qs.reshape(groups * ROW_GROUP, -1).contiguous().view(mat.qs.dtype)

    def rows_of(t: torch.Tensor) -> torch.Tensor:
        return _by_row(t, groups)[:mat.rows]

    if mat.fmt == "q6":
        sc, d = _by_row(mat.scale, groups), _by_row(mat.supers[0], groups)
        lanes = sc.float() * d.float().repeat_interleave(2 * SUPER, dim=1)  # exact: int8 x fp16
        planes = mat.high.reshape(groups, nb, 2, HIGH_BYTES)
        bit4, bit5 = (unpack_high(planes[:, :, i].reshape(groups, -1), nb) for i in (0, 1))
        return RowMajor(qs[:mat.rows], lanes[:mat.rows], None, (bit4 | (bit5 << 1))[:mat.rows])
    offset = rows_of(mat.offset) if mat.offset.numel() else None
    high = unpack_high(mat.high, nb)[:mat.rows] if mat.fmt == "q5" else mat.high if mat.fmt == "iq4" else None
    return RowMajor(qs[:mat.rows], rows_of(mat.scale), offset, high)


def iq4_as_q8(mat: QuantMatrix) -> QuantMatrix:
    """An iq4 matrix with its table applied: q8 of the same int8 values and scales (exact; 2x the bytes)."""
    rm = row_major(mat)
    return interleave("q8", mat.high[unpack_nibbles(rm.qs).long()], rm.scale, None)


def two_level(mat: QuantMatrix, scale_d: torch.Tensor, offset_d: torch.Tensor) -> QuantMatrix:
    """A q4 (or q5 with offset lanes) matrix interleaved with uint8 lanes (its blocks' multipliers) given its
    super-blocks' fp16 lanes, row-major [rows, nb / 8] each: the lanes are multiplier · d (Q4_K's and Q5_K's
    d · sc and -dmin · m, exact in float32), at 0.5625 + 0.0156 bytes a weight (q4) where float32 lanes
    took 0.75."""
    groups, nb = mat.qs.shape[0], mat.cols // BLOCK
    if mat.fmt not in ("q4", "q5") or mat.scale.dtype != torch.uint8 or not mat.offset.numel() or nb % SUPER:
        raise ValueError("two-level lanes are uint8 multipliers (scale and offset) of a q4 or q5 matrix whose "
                         "K is a multiple of 256")

    scale_d, offset_d = _pad(scale_d.to(torch.float16), mat.rows), _pad(offset_d.to(torch.float16), mat.rows)
    return replace(mat, supers=torch.stack([_by_group(scale_d, groups), _by_group(offset_d, groups)]))


def expand_lanes(mat: QuantMatrix) -> QuantMatrix:
    """The same matrix with two-level lanes multiplied out into float32 lanes (the same values); others as they are."""
    if not mat.two_level:
        return mat
    groups, nb = mat.qs.shape[0], mat.cols // BLOCK

    def lanes(mult: torch.Tensor, d: torch.Tensor) -> torch.Tensor:  # [G, nb/8, 8 blocks, 8 rows] x [G, nb/8, 1, 8]
        return (mult.reshape(groups, nb // SUPER, SUPER, ROW_GROUP).float()
                * d.reshape(groups, nb // SUPER, 1, ROW_GROUP).float()).reshape(groups, nb * ROW_GROUP)

    return replace(mat, scale=lanes(mat.scale, mat.supers[0]), offset=lanes(mat.offset, mat.supers[1]),
                   supers=_EMPTY_F16)


def concat(mats: list[QuantMatrix]) -> list[QuantMatrix]:
    """Row-concatenate neighbouring matrices of one format (a fused q/k/v of mixed types stays in
    segments). Parts whose scales differ in dtype join as float32, which holds every fp16 value."""
    segments: list[list[QuantMatrix]] = []
    for mat in mats:
        if segments and segments[-1][-1].fmt == mat.fmt:
            segments[-1].append(mat)
        else:
            segments.append([mat])
    return [group[0] if len(group) == 1 else _cat(group) for group in segments]


def _cat(group: list[QuantMatrix]) -> QuantMatrix:
    fmt, rows = group[0].fmt, sum(m.rows for m in group)
    if fmt == "q6" and any(m.rows % ROW_GROUP for m in group[:-1]):
        # A q6 part ending mid-group: no row-major repack for q6; its exact values round to q8 (Q6_K's old path).
        return _cat([quantize(m.dequantize(), "q8") for m in group])
    if len({m.two_level for m in group}) > 1:  # two-level lanes join others as float32
        group = [expand_lanes(m) for m in group]
    if len({bool(m.offset.numel()) for m in group}) > 1:  # q5 of Q5_0 beside Q5_1 / Q5_K: its offsets spelled out
        group = [m if m.offset.numel() else _with_implied_offset(m) for m in group]
    if len({m.scale.dtype for m in group}) > 1:
        group = [replace(m, scale=m.scale.float(), offset=m.offset.float()) for m in group]
    if all(m.rows % ROW_GROUP == 0 for m in group[:-1]):  # whole groups: the packed bytes simply follow
        supers = torch.cat([m.supers for m in group], dim=1) if group[0].supers.numel() else _EMPTY_F16
        high = group[0].high if fmt == "iq4" else torch.cat([m.high for m in group])  # iq4: one table (GGUF's)
        return QuantMatrix(fmt, torch.cat([m.qs for m in group]), torch.cat([m.scale for m in group]),
                           torch.cat([m.offset for m in group]), rows, high, supers)
    parts = [row_major(m) for m in group]  # a part ends mid-group: regroup the rows
    highs = parts[0].high if fmt == "iq4" else _cat_present([p.high for p in parts])
    return interleave(fmt, torch.cat([p.qs for p in parts]), torch.cat([p.scale for p in parts]),
                      _cat_present([p.offset for p in parts]), highs)


def _with_implied_offset(mat: QuantMatrix) -> QuantMatrix:
    """A q5 matrix without offset lanes (Q5_0: -16 · scale, implied) with them written out, float32 (exact)."""
    scale = mat.scale.float()
    return replace(mat, scale=scale, offset=scale * -16.0)


def _cat_present(values: list[torch.Tensor | None]) -> torch.Tensor | None:
    """One format's optional field (all None or all tensors), concatenated."""
    present = [v for v in values if v is not None]
    return torch.cat(present) if present else None


# ---- float → packed -------------------------------------------------------------------------------


def quantize(weight: torch.Tensor, fmt: QuantFormat) -> QuantMatrix:
    """Round a float [rows, cols] matrix (cols a multiple of 32) to `fmt`, round-to-nearest per block.

    q8 (the near-lossless format: `auto`'s Q5_K/Q6_K, `--quantization q8`) keeps float32 lanes: its
    scale amax/127 reproduces each block's largest weight exactly, and rounding that scale to fp16
    (1.0625 instead of 1.125 bytes a weight) moved Qwen2.5-0.5B's release gate from top-1 0.997 and
    perplexity -0.06% to 0.995 and +0.12% for 0.6% fewer bytes a step (docs/quantization.md). q4 and q5
    lanes are fp16: each block's scale is rounded up to an fp16 value (q4: its minimum rounded down
    first, the scale then spanning from it to the block's maximum) and the weights are rounded against
    the stored values, so every weight is within half of its block's fp16 step, which exceeds the exact
    step by at most 2⁻¹⁰ of it or 2⁻²⁴ (a near-zero block's subnormal), and nothing clips; that is
    ~1/60 of a 4-bit step, and q4 reads 0.625 bytes a weight where float32 lanes took 0.75 (a q4 draft
    model streams 17% fewer bytes a forward). Lanes past fp16's range (65504) keep float32."""
    rows, cols = weight.shape
    if cols % BLOCK:
        raise ValueError(f"in_features {cols} is not a multiple of {BLOCK}")
    if fmt in ("q6", "iq4"):
        raise ValueError(f"{fmt} holds GGUF blocks only (exact); float weights round to q8, q5 or q4")
    w = weight.detach().float().reshape(rows, cols // BLOCK, BLOCK)
    if fmt == "q8":
        amax = w.abs().amax(-1)
        scale = amax / 127.0
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        q = torch.round(w * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return interleave("q8", q.reshape(rows, cols), scale, None)
    if fmt == "q5":  # symmetric, q - 16 in [-15, 15]
        scale = _fp16_lanes(w.abs().amax(-1) / 15.0, up=True)
        inv = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
        q5 = (torch.round(w * inv.unsqueeze(-1)).clamp(-15, 15) + 16).to(torch.uint8).reshape(rows, cols)
        return interleave("q5", pack_nibbles(q5 & 0x0F), scale, None, q5 >> 4)
    lo, hi = w.amin(-1), w.amax(-1)
    lo = _fp16_lanes(lo, up=False)
    scale = _fp16_lanes((hi - lo.float()) / 15.0, up=True)
    if lo.dtype != scale.dtype:  # one lane dtype a matrix
        lo, scale = lo.float(), scale.float()
    inv = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
    q = torch.round((w - lo.float().unsqueeze(-1)) * inv.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    return interleave("q4", pack_nibbles(q.reshape(rows, cols)), scale, lo)


_FP16_MAX = 65504.0


def _fp16_lanes(values: torch.Tensor, up: bool) -> torch.Tensor:
    """`values` as fp16, each rounded toward +inf (`up`) or -inf; float32 unchanged where any would
    leave fp16's range."""
    if bool((values.abs() > _FP16_MAX).any()):
        return values
    half = values.half()
    off = half.float() < values if up else half.float() > values
    toward = torch.full_like(half, float("inf") if up else float("-inf"))
    return torch.where(off, torch.nextafter(half, toward), half)
