"""How GGUF's stored blocks become the packed formats of layers/quant_formats.py.

GGUF types map without a second rounding where the arithmetic allows:
    Q8_0 → q8 (scale = d)                Q5_0 → q8 (q - 16 fits int8; scale = d), or q5 (scale = d)
                                         under --quantization q5 or where q5_0_format() says so
    Q4_0 → q4 (scale d, offset -8d)      Q4_1 → q4 (scale d, offset m)
    Q4_K → q4 (each 32-weight sub-block: scale d*sc, offset -dmin*m; fp16 x 6-bit is exact in fp32),
           kept in two levels as the file has them (uint8 sc, m a block; fp16 d, -dmin per 8 blocks)
    Q5_1 → q5 (scale d, offset m)        Q5_K → q5 (Q4_K's two levels, plus the fifth bits)
           (under $TOKENMILL_Q5_K=q8 both re-round to q8 instead, for A/B runs)
    Q6_K → q6 (each 16-weight sub-block: scale d*sc, q - 32; int8 sc and fp16 d kept) where q6_k_format()
           says so, else dequantized, then re-quantized to q8 (one rounding, measured in the tests)
    Q3_K → q6 (each 16-weight sub-block: scale d·(sc − 32), q3 − 4 = q6 − 32 with q6 = q3 + 28; exact, 0.82
           bytes a weight: no kernel reads 3 bits, and q8's re-rounding failed the release gate, top-1 0.988)
    IQ4_NL → iq4 (the nibbles as stored, the type's 16-entry int8 table, scale = d: exact), IQ4_XS → iq4 (the
           same, scale = d·(ls − 32) a 32-block in float32: exact); 0.5625 / 0.625 bytes a weight against the
           files' 0.5625 / 0.53. Under --quantization q8 both unpack to q8 (exact too)
    Q2_K → q8 (dequantized, then re-rounded: its 16-weight sub-blocks have offsets, which no format holds at
           that grain; dense float32 would be ~11x the file's bytes; GGUF_REROUNDED, with one warning)
Any other type has no native mapping (callers dequantize it to a dense matrix).
Exact mappings move GGUF's own bytes (no float round trip); the rest go through gguf's reference
dequantizer and `quant_formats.quantize`, in slices of rows.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize

from tokenmill.errors import TokenmillError
from tokenmill.kernels import cpu_vendor_family
from tokenmill.layers import quant_formats as qf
from tokenmill.layers.quant_formats import ROW_GROUP, QuantFormat, QuantMatrix, concat, interleave, quantize

_T = GGMLQuantizationType
# GGUF type → (format, exact). Exact: the packed weights equal gguf's own dequantization bit for bit.
# The portable default; gguf_format() is what a load uses (it depends on the kernel path).
GGUF_MAPPING: dict[GGMLQuantizationType, tuple[QuantFormat, bool]] = {
    _T.Q8_0: ("q8", True), _T.Q5_0: ("q8", True),
    _T.Q4_0: ("q4", True), _T.Q4_1: ("q4", True), _T.Q4_K: ("q4", True),
    _T.Q5_1: ("q5", True), _T.Q5_K: ("q5", True), _T.Q6_K: ("q8", False),
    _T.Q3_K: ("q6", True), _T.Q2_K: ("q8", False), _T.IQ4_NL: ("iq4", True), _T.IQ4_XS: ("iq4", True),
}  # fmt: skip
# Types with no kernel at their own bit width that `auto` re-rounds to q8 rather than expanding to dense float
# (Q2_K files); the load warns once a type.
GGUF_REROUNDED = frozenset({_T.Q2_K})
# Where `auto` packs Q5_0 as q5 (0.69 bytes a weight) rather than q8 (1.06): the same integers either
# way, so a question of speed only, which depends on the microarchitecture, not just the path. Qwen2.5-
# Coder-0.5B's whole decode step, q5 against q8 (docs/quantization.md, "q5 (Q5_0 kept at 5 bits)"):
# AMD Zen 5 (family 26), avx512vnni: 1.06x at batch 1, 1.13x at 4, 1.08x at 16 — full-width 512-bit
# units leave the fifth bits' masked adds time to hide under the stream; Zen 4 (family 25, 512-bit ops
# as two halves): 0.92x at batch 1; Zen 3, avx2: 1.09x at batch 1 but 0.78x at 16. Intel hosts are
# unmeasured and keep q8. $TOKENMILL_Q5_0 = q5 | q8 overrides (A/B runs); `--quantization q5` packs
# every tensor as q5.
Q5_0_ENV = "TOKENMILL_Q5_0"
# Where `auto` keeps Q6_K at 6 bits (q6: 0.82 bytes a weight, exact) rather than re-rounding it to q8 (1.125):
# Zen 5's avx512vnni path, whose duo and 512-bit q6 tiles decode the two extra bits under the stream
# (Qwen2.5-Coder-1.5B against q8 in one build: batch 1 1.05-1.15x, batch 16 1.07x, a 512-token prefill
# 0.98x; docs/quantization.md). Elsewhere q6 has only the 256-bit tiles: through the AVX2 path on the same
# CPU batch 1 ran 0.75x of q8, 0.915x after the byte-level decode (avx2::kByteBits). $TOKENMILL_Q6_K = q6 | q8
# overrides (A/B runs).
Q6_K_ENV = "TOKENMILL_Q6_K"
# Q5_1 and Q5_K (Q5_K_M files) stay at 5 bits everywhere: q8 would be a second rounding and 1.6x the
# file's bytes (1.125 bytes a weight against 0.69), past the 1.2x resident-memory budget; speed against q8
# in docs/quantization.md ("q5 with offsets"). $TOKENMILL_Q5_K = q5 | q8 overrides (A/B runs).
Q5_K_ENV = "TOKENMILL_Q5_K"


@functools.cache
def _host_vendor_family() -> tuple[str, int]:
    return cpu_vendor_family()  # /proc/cpuinfo once a process, not once a tensor


def q5_0_format(isa: str, vendor: str, family: int) -> QuantFormat:
    """The format `auto` packs Q5_0 into on quant path `isa` of a CPU (vendor_id, cpu family)."""
    return _override(Q5_0_ENV, ("q5", "q8")) or ("q5" if _full_width_vnni(isa, vendor, family) else "q8")


def q6_k_format(isa: str, vendor: str, family: int) -> QuantFormat:
    """The format `auto` packs Q6_K into on quant path `isa` of a CPU (vendor_id, cpu family)."""
    return _override(Q6_K_ENV, ("q6", "q8")) or ("q6" if _full_width_vnni(isa, vendor, family) else "q8")


def _override(env: str, allowed: tuple[QuantFormat, ...]) -> QuantFormat | None:
    """The format `env` forces (A/B runs), None when unset; a value outside `allowed` is an error."""
    forced = os.environ.get(env, "").strip().lower()
    if not forced:
        return None
    for fmt in allowed:
        if forced == fmt:
            return fmt
    raise TokenmillError(f"{env}={forced!r}: use {' or '.join(allowed)}")


def _full_width_vnni(isa: str, vendor: str, family: int) -> bool:
    """AMD Zen 5 (family 26) on the avx512vnni path: 512-bit units at full width and the duo tiles."""
    return isa == "avx512vnni" and vendor == "AuthenticAMD" and family >= 26


def gguf_format(ggml_type: GGMLQuantizationType, isa: str) -> tuple[QuantFormat, bool] | None:
    """(format, exact) a GGUF type packs to under quant path `isa` on this CPU; None: no native mapping."""
    if ggml_type == _T.Q5_0:
        return (q5_0_format(isa, *_host_vendor_family()), True)
    if ggml_type == _T.Q6_K:
        fmt = q6_k_format(isa, *_host_vendor_family())
        return (fmt, fmt == "q6")
    if ggml_type in (_T.Q5_1, _T.Q5_K):
        fmt = _override(Q5_K_ENV, ("q5", "q8")) or "q5"
        return (fmt, fmt == "q5")
    return GGUF_MAPPING.get(ggml_type)


# ---- GGUF blocks → packed ---------------------------------------------------------------------------


def gguf_dequantize(blocks: np.ndarray, ggml_type: GGMLQuantizationType, cols: int) -> torch.Tensor:
    """float32 [rows, cols] from raw GGUF rows (uint8 [rows, row_bytes]), gguf's own reference code.

    Q8_0 and Q5_0 (the embedding tables of the catalog models, read a few rows per decode step) are
    spelled out: gguf's generic path costs 0.25-0.5 ms a call in fixed overhead for one row, a few
    percent of a batch-1 step; the float32 products are the same (q * fp32(d))."""
    exact = _exact_q8(blocks, ggml_type)
    if exact is not None:
        q, d = exact
        return torch.from_numpy((q.astype(np.float32) * d.astype(np.float32)).reshape(-1, cols))
    return torch.from_numpy(np.ascontiguousarray(_gguf_dequantize(blocks, ggml_type)).reshape(-1, cols))


def _exact_q8(blocks: np.ndarray, ggml_type: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray] | None:
    """(q int8 [blocks, 32], d fp16 [blocks, 1]) with w = d * q, for the types q8 holds exactly; else None."""
    if ggml_type == GGMLQuantizationType.Q8_0:
        b = _blocks(blocks, 34)
        return np.ascontiguousarray(b[:, 2:]).view(np.int8), _half(b[:, :2])
    if ggml_type == GGMLQuantizationType.Q5_0:
        b = _blocks(blocks, 22)
        low = np.concatenate([b[:, 6:] & 0x0F, b[:, 6:] >> 4], axis=1)
        return (low | (_q5_0_high(b) << 4)).astype(np.int8) - np.int8(16), _half(b[:, :2])
    return None


def from_gguf(blocks: np.ndarray, ggml_type: GGMLQuantizationType, cols: int, fmt: QuantFormat) -> QuantMatrix:
    """Raw GGUF rows → `fmt`: exact where GGUF_MAPPING says so and the format matches, else through float."""
    exact = _EXACT.get((ggml_type, fmt))
    convert: Callable[[np.ndarray], QuantMatrix]
    if exact is not None:
        def convert(part: np.ndarray) -> QuantMatrix:
            return exact(np.ascontiguousarray(part), cols)
    else:
        # Through float, in slices: a vocabulary-sized Q6_K head would otherwise need a few GB of
        # float32 temporaries at once (the load's peak resident memory).
        def convert(part: np.ndarray) -> QuantMatrix:
            return quantize(gguf_dequantize(part, ggml_type, cols), fmt)
    rows = blocks.shape[0]
    # Whole row groups a slice (concat appends their bytes); exact mappings too, which keeps their
    # temporaries small (Qwen2.5-Coder-1.5B: load within noise of whole matrices, peak RSS 2.98 against
    # 3.05 GB). A thread pool over the slices gained 0.2-0.9 s of ~8.5 but cost 0.75 GB of peak RSS
    # (per-thread malloc arenas): not used.
    step = max(1, _SLICE_ELEMENTS // cols // ROW_GROUP) * ROW_GROUP
    return concat([convert(blocks[i:i + step]) for i in range(0, rows, step)])[0]


_SLICE_ELEMENTS = 1 << 22  # weights per slice (16 MB as float32)


def _half(raw: np.ndarray) -> np.ndarray:
    """GGUF's fp16 fields as stored (packed as fp16 scales: exact, half the bytes of float32)."""
    return np.ascontiguousarray(raw).view(np.float16)


def _blocks(blocks: np.ndarray, block_bytes: int) -> np.ndarray:
    return blocks.reshape(-1, block_bytes)


def _q8_0(blocks: np.ndarray, cols: int) -> QuantMatrix:
    return _exact_q8_matrix(blocks, GGMLQuantizationType.Q8_0, cols)


def _q5_0(blocks: np.ndarray, cols: int) -> QuantMatrix:
    return _exact_q8_matrix(blocks, GGMLQuantizationType.Q5_0, cols)


def _q5_0_q5(blocks: np.ndarray, cols: int) -> QuantMatrix:
    # Block: d (fp16), qh (uint32, bit j = fifth bit of weight j), 16 bytes of nibbles j | j+16 << 4
    # (q4's own pairing).
    rows, b = blocks.shape[0], _blocks(blocks, 22)
    return _matrix("q5", b[:, 6:].reshape(rows, cols // 2), _half(b[:, :2]).reshape(rows, -1), None,
                   _q5_0_high(b).reshape(rows, cols))


def _exact_q8_matrix(blocks: np.ndarray, ggml_type: GGMLQuantizationType, cols: int) -> QuantMatrix:
    exact = _exact_q8(blocks, ggml_type)
    assert exact is not None
    q, d = exact
    rows = blocks.shape[0]
    return _matrix("q8", q.reshape(rows, cols), d.reshape(rows, -1), None)


# IQ4_NL's and IQ4_XS's non-linear 4-bit code: nibble → int8 (ggml's kvalues_iq4nl).
_IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _iq4_nl_iq4(blocks: np.ndarray, cols: int) -> QuantMatrix:
    # Block of 32 (18 bytes): d fp16, 16 bytes of nibbles j | j + 16 << 4; w = d · table[nibble].
    rows, b = blocks.shape[0], _blocks(blocks, 18)
    return _iq4_matrix(b[:, 2:].reshape(rows, cols // 2), _half(b[:, :2]).reshape(rows, -1))


def _iq4_xs_iq4(blocks: np.ndarray, cols: int) -> QuantMatrix:
    # Super-block of 256 (136 bytes): d fp16, scales_h uint16, scales_l[4], then 8 x 16 bytes of nibbles as
    # IQ4_NL's; w = d · (ls − 32) · table[nibble] (ggml's dequantize_row_iq4_xs).
    rows, b = blocks.shape[0], _blocks(blocks, 136)
    return _iq4_matrix(b[:, 8:].reshape(rows, cols // 2), _iq4_xs_scales(b).reshape(rows, -1))


def _iq4_matrix(nibbles: np.ndarray, scale: np.ndarray) -> QuantMatrix:
    """iq4 from row-major nibble bytes (j | j + 16 << 4 a 32-block: q4's own pairing) and scale lanes."""
    lane_type = np.float16 if scale.dtype == np.float16 else np.float32
    return qf.interleave("iq4", torch.from_numpy(np.ascontiguousarray(nibbles)),
                         torch.from_numpy(np.ascontiguousarray(scale, dtype=lane_type)), None,
                         torch.from_numpy(_IQ4_VALUES.copy()))


def _iq4_xs_scales(b: np.ndarray) -> np.ndarray:
    """IQ4_XS super-blocks [n, 136] → float32 [n, 8]: each 32-block's d · (ls − 32) (exact in float32), block
    i's 6-bit ls = low nibble i of scales_l (byte i / 2) | bits 2i, 2i + 1 of scales_h << 4."""
    d = _half(b[:, :2]).astype(np.float32)
    sh = np.ascontiguousarray(b[:, 2:4]).view(np.uint16).astype(np.int32)
    i = np.arange(8)
    low = (b[:, 4 + i // 2].astype(np.int32) >> (4 * (i % 2))) & 0x0F
    ls = low | (((sh >> (2 * i)) & 3) << 4)
    return d * (ls - 32).astype(np.float32)


def _q4_0(blocks: np.ndarray, cols: int) -> QuantMatrix:
    rows, b = blocks.shape[0], _blocks(blocks, 18)
    d = _half(b[:, :2]).reshape(rows, -1)
    with np.errstate(over="ignore"):
        offset = d * np.float16(-8.0)  # exact (a power of two) unless |d| > 8188 overflows fp16
    if not np.isfinite(offset).all():
        d, offset = d.astype(np.float32), d.astype(np.float32) * -8.0
    return _matrix("q4", b[:, 2:].reshape(rows, cols // 2), d, offset)


def _q4_1(blocks: np.ndarray, cols: int) -> QuantMatrix:
    rows, b = blocks.shape[0], _blocks(blocks, 20)
    return _matrix("q4", b[:, 4:].reshape(rows, cols // 2), _half(b[:, :2]).reshape(rows, -1),
                   _half(b[:, 2:4]).reshape(rows, -1))


def _q6_k(blocks: np.ndarray, cols: int) -> QuantMatrix:
    # Super-block of 256 (210 bytes): ql[128] low nibbles, qh[64] high bit pairs, scales[16] int8 (one a 16-weight
    # sub-block, in order), d fp16. Each half of 128 weights n: y[l] from ql[64n + l] & 0xF and qh[32n + l] bits
    # 0-1, y[l + 32] from ql[64n + 32 + l] & 0xF and bits 2-3, y[l + 64] from ql[64n + l] >> 4 and bits 4-5,
    # y[l + 96] from ql[64n + 32 + l] >> 4 and bits 6-7 (ggml's dequantize_row_q6_K), l < 32.
    rows, b = blocks.shape[0], _blocks(blocks, 210)
    ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
    low = np.concatenate([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)
    high = np.concatenate([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, qh >> 6], axis=-1)  # [sb, 2, 128] each
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8)
    d = _half(b[:, 208:210])
    nibbles = torch.from_numpy(np.ascontiguousarray(low.reshape(rows, cols)))
    return qf.interleave_q6(qf.pack_nibbles(nibbles), torch.from_numpy(np.ascontiguousarray(sc.reshape(rows, -1))),
                         torch.from_numpy(np.ascontiguousarray(d.reshape(rows, -1))),
                         torch.from_numpy(np.ascontiguousarray(high.reshape(rows, cols))))


def _q5_1_q5(blocks: np.ndarray, cols: int) -> QuantMatrix:
    # Block: d, m (fp16), qh (uint32, bit j = fifth bit of weight j), 16 bytes of nibbles j | j+16 << 4.
    rows, b = blocks.shape[0], _blocks(blocks, 24)
    return _matrix("q5", b[:, 8:].reshape(rows, cols // 2), _half(b[:, :2]).reshape(rows, -1),
                   _half(b[:, 2:4]).reshape(rows, -1), _fifth_bits(b[:, 4:8]).reshape(rows, cols))


def _q5_0_high(b: np.ndarray) -> np.ndarray:
    """Q5_0 blocks [n, 22] → uint8 [n, 32], weight j's fifth bit (bit j of the block's qh word)."""
    return _fifth_bits(b[:, 2:6])


def _fifth_bits(qh_bytes: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 qh words (uint8 [n, 4], little-endian) → uint8 [n, 32]: bit j, weight j's fifth bit."""
    qh = np.ascontiguousarray(qh_bytes).view(np.uint32)
    return ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _q3_k(blocks: np.ndarray, cols: int) -> QuantMatrix:
    # Super-block of 256 (110 bytes): hmask[32], qs[64], 12 bytes of 6-bit scales, d fp16 (ggml's
    # dequantize_row_q3_K). Weight 128n + 32j + l (n < 2, j < 4, l < 32): q3 = (qs[32n + l] >> 2j) & 3, plus 4 where
    # bit 4n + j of hmask[l] is set; w = d · (sc_k − 32) · (q3 − 4), k = its 16-weight sub-block. In q6's terms
    # (w = lane · (q6 − 32), an int8 multiplier a 16-column half): q6 = q3 + 28, multiplier sc_k − 32.
    rows, b = blocks.shape[0], _blocks(blocks, 110)
    hmask, qs, s, d = b[:, :32], b[:, 32:96].reshape(-1, 2, 1, 32), b[:, 96:108], _half(b[:, 108:110])
    low = (qs >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3  # [sb, n, j, l]
    bit = np.arange(8, dtype=np.uint8).reshape(1, 2, 4, 1)
    q6 = (low | (((hmask[:, None, None, :] >> bit) & 1) << 2)) + 28  # [sb, n, j, l] in [28, 35]
    lo, t = s[:, :8], s[:, 8:12]
    sc = np.concatenate([(lo[:, :4] & 0x0F) | ((t & 3) << 4), (lo[:, 4:] & 0x0F) | (((t >> 2) & 3) << 4),
                         (lo[:, :4] >> 4) | (((t >> 4) & 3) << 4), (lo[:, 4:] >> 4) | ((t >> 6) << 4)], axis=1)
    q6 = q6.reshape(rows, cols)
    return qf.interleave_q6(qf.pack_nibbles(torch.from_numpy(q6 & 0x0F)),
                            torch.from_numpy((sc.astype(np.int16) - 32).astype(np.int8).reshape(rows, -1)),
                            torch.from_numpy(np.ascontiguousarray(d.reshape(rows, -1))), torch.from_numpy(q6 >> 4))


def _q4_k(blocks: np.ndarray, cols: int) -> QuantMatrix:
    # Super-block of 256: d, dmin (fp16), 12 bytes of 6-bit (sc, m) for 8 sub-blocks, 128 bytes of
    # nibbles where bytes [32p, 32p + 32) hold sub-block 2p in low and 2p + 1 in high nibbles.
    return _k_quant(_blocks(blocks, 144), blocks.shape[0], cols, 16, None)


def _q5_k(blocks: np.ndarray, cols: int) -> QuantMatrix:
    # Super-block of 256 (176 bytes): Q4_K's d, dmin, 12 scale bytes, then qh[32] (bit s of qh[l] = the
    # fifth bit of weight l of sub-block s), then Q4_K's 128 nibble bytes (ggml's dequantize_row_q5_K).
    b = _blocks(blocks, 176)
    qh = b[:, 16:48]
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [sb, sub-block, 32]
    return _k_quant(b, blocks.shape[0], cols, 48, high)


def _k_quant(b: np.ndarray, rows: int, cols: int, nibbles_at: int, high: np.ndarray | None) -> QuantMatrix:
    """Q4_K / Q5_K super-blocks [n, bytes] → q4 / q5 in their two levels (high: Q5_K's fifth bits, [n, 8, 32])."""
    d, dmin = _half(b[:, :2]), _half(b[:, 2:4])
    s = b[:, 4:16].reshape(-1, 3, 4)
    sc = np.concatenate([s[:, 0] & 0x3F, (s[:, 2] & 0x0F) | ((s[:, 0] >> 2) & 0x30)], axis=1)
    mn = np.concatenate([s[:, 1] & 0x3F, (s[:, 2] >> 4) | ((s[:, 1] >> 2) & 0x30)], axis=1)
    # q4's byte e of a sub-block is w(e) | w(e + 16) << 4: from the halves x0 (weights 0-15) and x1 (16-31)
    # of group p, sub-block 2p takes both low nibbles, 2p + 1 both high ones (4.7x faster than unpacking
    # every nibble to a byte and packing again).
    x = b[:, nibbles_at:].reshape(-1, 4, 2, 16)
    x0, x1 = x[:, :, 0], x[:, :, 1]
    packed = np.stack([(x0 & 0x0F) | ((x1 & 0x0F) << 4), (x0 >> 4) | (x1 & 0xF0)], axis=2)  # [sb, p, 2, 16]
    # Two-level lanes, as the file stores them: sc and m a sub-block (uint8), d and -dmin a super-block (fp16);
    # the kernel forms d·sc and -dmin·m in float32 (exact), so a step reads 0.58 bytes a weight, not 0.75.
    mat = _matrix("q4" if high is None else "q5", packed.reshape(rows, cols // 2), sc.reshape(rows, -1),
                  mn.reshape(rows, -1), None if high is None else high.reshape(rows, cols))
    return qf.two_level(mat, torch.from_numpy(d.reshape(rows, -1)), torch.from_numpy(-dmin.reshape(rows, -1)))


_EXACT = {(_T.Q8_0, "q8"): _q8_0, (_T.Q5_0, "q8"): _q5_0, (_T.Q5_0, "q5"): _q5_0_q5, (_T.Q4_0, "q4"): _q4_0,
          (_T.Q4_1, "q4"): _q4_1, (_T.Q4_K, "q4"): _q4_k, (_T.Q5_1, "q5"): _q5_1_q5, (_T.Q5_K, "q5"): _q5_k,
          (_T.Q6_K, "q6"): _q6_k, (_T.Q3_K, "q6"): _q3_k,
          (_T.IQ4_NL, "iq4"): _iq4_nl_iq4, (_T.IQ4_XS, "iq4"): _iq4_xs_iq4,
          # --quantization q8: the table applied to the same nibbles (exact)
          (_T.IQ4_NL, "q8"): lambda b, c: qf.iq4_as_q8(_iq4_nl_iq4(b, c)),
          (_T.IQ4_XS, "q8"): lambda b, c: qf.iq4_as_q8(_iq4_xs_iq4(b, c))}


def _matrix(fmt: QuantFormat, qs: np.ndarray, scale: np.ndarray, offset: np.ndarray | None,
            high: np.ndarray | None = None) -> QuantMatrix:
    """Pack row-major blocks (high: q5's fifth bits, 0/1 a weight); fp16 scale (and offset) arrays stay fp16,
    uint8 ones (two-level multipliers) uint8, anything else becomes float32."""
    lane_type = scale.dtype if scale.dtype in (np.float16, np.uint8) else np.float32
    return interleave(fmt, torch.from_numpy(np.ascontiguousarray(qs)),
                      torch.from_numpy(np.ascontiguousarray(scale, dtype=lane_type)),
                      None if offset is None else torch.from_numpy(np.ascontiguousarray(offset, lane_type)),
                      None if high is None else torch.from_numpy(np.ascontiguousarray(high, np.uint8)))
