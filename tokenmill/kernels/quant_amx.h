// The AMX tiles of the quant kernel (the `amx` path): included by quant_kernels.cpp inside its
// anonymous namespace, after the vnni tiles whose helpers (lanes8, lanes16) and types (Weights, Act,
// QK, RG, kFine) it uses. Not a standalone header. Dispatch (amx_min_rows, amx_bf16_rows, amx_usable)
// stays in quant_kernels.cpp.
#pragma once

// ---- AMX-INT8 tiles: the VNNI path's integer sums and float steps, from 16 x 16 tile products -------
// From amx_min_rows() activation rows up (where a CPU and OS grant AMX), each 16-row tile of output
// rows times 16 activation rows is one TDPBSSD (q8) or TDPBSUD (q4/q5: unsigned weights) per 32-block
// and activation pass, into int32 tiles: pass 1's sums C1 and pass 2's C2, so the block sum
// 254 C1 + C2 is the very integer vpdpwssd forms from the combined int16 activation (|C1| <= 32*127*127,
// no overflow). The float steps after it are tile2's, lane for lane and in order, so the output is
// bit-identical to the avx512vnni path (and to every path): batch composition never changes a token.
// The weights are regrouped once per 16 output rows into TDP's B layout (row r = k 4r..4r+3 of each
// of 16 columns) in an L1/L2 buffer that every 16-row activation tile then reads.
//
//   B tile of block b (8 rows x 64 bytes):   row r: | n0 k4r..4r+3 | n1 ... | ... | n15 k4r..4r+3 |
//   from the layout's pairs (16 bytes: n0 k2p,2p+1 | n1 ... | n7), for group g then g + 1:
//   unpacklo/hi_epi16(pair 2r, pair 2r + 1) = n0..3 / n4..7 of quad row r.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")
namespace amx {
constexpr int64_t kTileRows = 16;   // activation rows (and output rows) per tile
constexpr int64_t kBBytes = 512;    // one B tile: 8 quad rows x 64 bytes

// The first 64-byte boundary at or after p (tile loads and stores of the thread-local buffers).
inline uint8_t* align64(uint8_t* p) {
  return reinterpret_cast<uint8_t*>((reinterpret_cast<std::uintptr_t>(p) + 63) & ~static_cast<std::uintptr_t>(63));
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tmm0/1 and 5/6: two sets of C1/C2 (16 x 16 int32); tmm2/3: pass 1/2 activations (16 rows x 32
// int8); tmm4 and 7: the weights, one per set.
// The config lives in static storage and is loaded behind a compiler barrier: GCC's _tile_loadconfig
// tells the compiler it reads only 8 bytes, so the stores to a stack copy's later bytes may be dropped
// as dead (seen: a garbage config, and SIGILL at the first tilezero).
void load_config(const TileConfig* cfg) {
  __asm__ volatile("" ::: "memory");
  _tile_loadconfig(cfg);
}

void configure() {
  static const TileConfig cfg = [] {
    TileConfig c{};
    c.palette = 1;
    for (int t = 0; t < 4; ++t) { c.rows[t] = 16; c.colsb[t] = t < 2 ? 64 : 32; }
    c.rows[4] = c.rows[7] = 8;
    c.colsb[4] = c.colsb[7] = 64;
    c.rows[5] = c.rows[6] = 16;
    c.colsb[5] = c.colsb[6] = 64;
    return c;
  }();
  load_config(&cfg);
}

// Pair p (16 bytes: 8 rows x 2 weights, as 8-bit integers) of block b of group g.
template <bool Q4, bool Q5>
inline __m128i pair_bytes(const Weights& w, int64_t g, int64_t b, int p) {
  const uint8_t* blk = w.block(g, b);
  if (!Q4) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * p));
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * (p % 8)));
  const __m128i low = _mm_set1_epi8(0x0F);
  __m128i v = p < 8 ? _mm_and_si128(raw, low) : _mm_and_si128(_mm_srli_epi16(raw, 4), low);
  if (Q5) {  // word 2c: chunk c's low nibbles, 2c + 1 its high ones; bit i = byte i's fifth bit
    uint16_t mask;
    std::memcpy(&mask, w.high_block(g, b) + 2 * (2 * (p % 8) + (p < 8 ? 0 : 1)), sizeof mask);
    v = _mm_mask_add_epi8(v, static_cast<__mmask16>(mask), v, _mm_set1_epi8(16));
  }
  return v;
}

// The B tiles of groups g and g + 1 (zeros where g + 1 is past the matrix), every block: buf[nb][512].
template <bool Q4, bool Q5>
void regroup(const Weights& w, int64_t g, bool two, uint8_t* buf) {
  for (int64_t b = 0; b < w.nb; ++b) {
    uint8_t* tile = buf + b * kBBytes;
    for (int half = 0; half < 2; ++half) {
      if (half == 1 && !two) {
        for (int r = 0; r < 8; ++r) std::memset(tile + r * 64 + 32, 0, 32);
        continue;
      }
      __m128i pr[16];
      for (int p = 0; p < 16; ++p) pr[p] = pair_bytes<Q4, Q5>(w, g + half, b, p);
      for (int r = 0; r < 8; ++r) {
        uint8_t* row = tile + r * 64 + 32 * half;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(row), _mm_unpacklo_epi16(pr[2 * r], pr[2 * r + 1]));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 16), _mm_unpackhi_epi16(pr[2 * r], pr[2 * r + 1]));
      }
    }
  }
}

inline __m512 lanes(const Weights& w, const Lanes& p, int64_t g, int64_t b, bool two) {
  if (two) return vnni::lanes16(w, p, w.lanes(g, b), w.lanes(g + 1, b));
  return _mm512_zextps256_ps512(vnni::lanes8(w, p, w.lanes(g, b)));
}

// Block b's tile products (pass 1, and pass 2 when P = 2) into register set S (tmm0/1 + weights in
// tmm4, or tmm5/6 + tmm7; activations in tmm2/3 for both), stored to cbuf (C1 at 0, C2 at 256 int32).
// Two sets, so that block b + 1's products can run on the AMX unit while the vector ports take block
// b's float steps (measured +3-10% at 16 rows, neutral from 48: docs/quantization.md). A macro: the
// tile intrinsics take register numbers as literals.
#define TM_PRODUCTS(c1, c2, bw)                                        \
  do {                                                                 \
    _tile_zero(c1);                                                    \
    _tile_loadd(bw, bt, 64);                                           \
    _tile_loadd(2, qb, stride);                                        \
    if (Q4) _tile_dpbsud(c1, 2, bw); else _tile_dpbssd(c1, 2, bw);     \
    _tile_stored(c1, cbuf, 64);                                        \
    if (P == 2) {                                                      \
      _tile_zero(c2);                                                  \
      _tile_loadd(3, qb + QK, stride);                                 \
      if (Q4) _tile_dpbsud(c2, 3, bw); else _tile_dpbssd(c2, 3, bw);   \
      _tile_stored(c2, cbuf + 256, 64);                                \
    }                                                                  \
  } while (0)

template <bool Q4, int P, int S>
inline void products(const uint8_t* bt, const int8_t* qb, int64_t stride, int32_t* cbuf) {
  if constexpr (S == 0) TM_PRODUCTS(0, 1, 4);
  else TM_PRODUCTS(5, 6, 7);
}
#undef TM_PRODUCTS

// Output rows g*8 .. g*8 + 15 (groups g, g + 1) for activation rows m0 .. m0 + 15 (rows past M are
// computed from the padding and not stored). a.q: the int8 passes [rows, nb, P, 32]; a.d, a.s padded
// likewise. cbuf: two 2 KiB halves, one per register set.
template <bool Q4, bool Q5, int P>
void tile(const Weights& w, int64_t g, bool two, const uint8_t* bbuf, const Act& a, int64_t m0, int64_t M,
          float* out, int64_t ld, int32_t* cbuf) {
  __m512 acc[kTileRows];
  for (int i = 0; i < kTileRows; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t stride = a.nb * P * QK;
  const int8_t* qrow = a.q + m0 * stride;
  products<Q4, P, 0>(bbuf, qrow, stride, cbuf);
  for (int64_t b = 0; b < w.nb; ++b) {
    int32_t* cb = cbuf + (b & 1) * 512;
    if (b + 1 < w.nb) {  // the next block's products first: they overlap this block's float steps
      if (b & 1) products<Q4, P, 0>(bbuf + (b + 1) * kBBytes, qrow + (b + 1) * P * QK, stride, cbuf);
      else products<Q4, P, 1>(bbuf + (b + 1) * kBBytes, qrow + (b + 1) * P * QK, stride, cbuf + 512);
    }
    const __m512 sw = lanes(w, w.scale, g, b, two);
    const __m512 off = !Q4 ? _mm512_setzero_ps() : w.offset.p ? lanes(w, w.offset, g, b, two)
                                                              : _mm512_mul_ps(sw, _mm512_set1_ps(-16.f));  // Q5_0's
    const float* d = a.d + m0 * a.nb + b;
    const float* s = a.s + m0 * a.nb + b;
#pragma GCC unroll 16
    for (int i = 0; i < kTileRows; ++i) {
      __m512i isum = _mm512_load_si512(cb + 16 * i);
      if (P == 2)
        isum = _mm512_add_epi32(_mm512_mullo_epi32(isum, _mm512_set1_epi32(static_cast<int>(kFine))),
                                _mm512_load_si512(cb + 256 + 16 * i));
      const __m512 scale = _mm512_mul_ps(sw, _mm512_set1_ps(d[i * a.nb]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[i]);
      if (Q4) acc[i] = _mm512_fmadd_ps(off, _mm512_set1_ps(s[i * a.nb]), acc[i]);
    }
  }
  const int64_t valid = std::min<int64_t>(2 * RG, w.rows - g * RG);
  const __mmask16 mask = valid >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
  for (int i = 0; i < kTileRows && m0 + i < M; ++i) _mm512_mask_storeu_ps(out + (m0 + i) * ld + g * RG, mask, acc[i]);
}

template <bool Q4, bool Q5, int P>
void pairs(const Weights& w, const Act& a, int64_t M, int64_t t0, int64_t t1, float* out, int64_t ld) {
  thread_local std::vector<uint8_t> bstore;
  const size_t need = static_cast<size_t>(w.nb * kBBytes + 64 + 4096 + 64);
  if (bstore.size() < need) bstore.resize(need);
  uint8_t* bbuf = align64(bstore.data());
  int32_t* cbuf = reinterpret_cast<int32_t*>(align64(bbuf + w.nb * kBBytes));
  const int64_t groups = (w.rows + RG - 1) / RG;
  configure();
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t g = 2 * t;
    const bool two = g + 1 < groups;
    regroup<Q4, Q5>(w, g, two, bbuf);
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) tile<Q4, Q5, P>(w, g, two, bbuf, a, m0, M, out, ld, cbuf);
  }
  _tile_release();
}

// Tiles of 16 output rows t0 .. t1 - 1 (groups 2t, 2t + 1) for all M activation rows.
void tiles(const Weights& w, const Act& a, int64_t M, int64_t t0, int64_t t1, float* out, int64_t ld) {
  if (a.P == 2) {
    if (w.q5) pairs<true, true, 2>(w, a, M, t0, t1, out, ld);
    else if (w.q4) pairs<true, false, 2>(w, a, M, t0, t1, out, ld);
    else pairs<false, false, 2>(w, a, M, t0, t1, out, ld);
  } else {
    if (w.q5) pairs<true, true, 1>(w, a, M, t0, t1, out, ld);
    else if (w.q4) pairs<true, false, 1>(w, a, M, t0, t1, out, ld);
    else pairs<false, false, 1>(w, a, M, t0, t1, out, ld);
  }
}
}  // namespace amx
#pragma GCC pop_options

// ---- AMX-BF16 tiles for prefill-sized M: weights dequantized to bf16 in L2, fp32 accumulation ------
// From amx_bf16_rows() activation rows up the products are TDPBF16PS: the activations rounded once to
// bf16, each 32-row panel of weights dequantized (scale * q + offset, rounded to bf16) into a buffer
// that every 32-row tile of activations then multiplies, accumulating fp32 in the tiles over all of K
// (no per-block scale step: the scales are in the weights). This is not the integer paths' rounding:
// bf16 weights and activations, as a bf16 dense model computes; docs/quantization.md measures the
// quality. Prefill chunks, not decode steps, reach these row counts.
//   B tile (16 rows x 64 bytes) of block b and 16 output rows: row p = k 2p, 2p + 1 of n0 .. n15
//   = the layout's pair p of group g (n0..7) then of group g + 1 (n8..15), widened and scaled.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,amx-tile,amx-bf16")
namespace amxbf {
constexpr int64_t kTile = 16;
constexpr int64_t kBTile = 1024;  // one B tile: 16 pair rows x 64 bytes

// tmm0-3: C (2 activation tiles x 2 output tiles, 16 x 16 fp32); tmm4/5: A (16 rows x 32 bf16);
// tmm6/7: B (16 pair rows x 16 columns x 2 bf16).
void configure() {
  static const amx::TileConfig cfg = [] {
    amx::TileConfig c{};
    c.palette = 1;
    for (int t = 0; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
    return c;
  }();
  amx::load_config(&cfg);
}

// Lane 2i and 2i + 1 = lane i of the 8 scale (offset) lanes of group g, block b: one per weight of a pair.
inline __m512 pair_lanes(const Weights& w, const Lanes& p, int64_t g, int64_t b) {
  const __m512 l8 = _mm512_zextps256_ps512(vnni::lanes8(w, p, w.lanes(g, b)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), l8);
}

// pair_lanes of the offset lanes; q5 without them (Q5_0) implies -16 * scale.
inline __m512 pair_offsets(const Weights& w, __m512 scale, int64_t g, int64_t b) {
  return w.offset.p ? pair_lanes(w, w.offset, g, b) : _mm512_mul_ps(scale, _mm512_set1_ps(-16.f));
}

// Pair p of group g, block b as 16 floats (n0 k0, n0 k1, ..., n7 k1), dequantized.
template <bool Q4, bool Q5>
inline __m512 pair_float(const Weights& w, int64_t g, int64_t b, int p, __m512 scale, __m512 offset) {
  const __m128i q = amx::pair_bytes<Q4, Q5>(w, g, b, p);
  const __m512 f = _mm512_cvtepi32_ps(Q4 ? _mm512_cvtepu8_epi32(q) : _mm512_cvtepi8_epi32(q));
  return Q4 ? _mm512_fmadd_ps(f, scale, offset) : _mm512_mul_ps(f, scale);
}

// The B tiles of output rows 8g .. 8g + 15 for every block: buf[b * 2 + half? ] — see panel().
template <bool Q4, bool Q5>
void dequant_tile(const Weights& w, int64_t g, bool two, int64_t b, uint8_t* tile) {
  const __m512 s0 = pair_lanes(w, w.scale, g, b);
  const __m512 o0 = !Q4 ? s0 : pair_offsets(w, s0, g, b);
  __m512 s1 = _mm512_setzero_ps(), o1 = _mm512_setzero_ps();
  if (two) {
    s1 = pair_lanes(w, w.scale, g + 1, b);
    o1 = !Q4 ? s1 : pair_offsets(w, s1, g + 1, b);
  }
  for (int p = 0; p < 16; ++p) {
    const __m512 lo = pair_float<Q4, Q5>(w, g, b, p, s0, o0);
    const __m512 hi = two ? pair_float<Q4, Q5>(w, g + 1, b, p, s1, o1) : _mm512_setzero_ps();
    _mm512_store_si512(tile + 64 * p, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// A 16 x 16 fp32 C tile at (m0, n0): straight to y when whole, else (a partial tile at the edge of M
// or N) through `tmp`. A macro: the tile intrinsics take the register number as a literal.
#define TM_STORE_C(T, m0, n0)                                                                               \
  do {                                                                                                      \
    if ((m0) + kTile <= M && (n0) + kTile <= w.rows) { _tile_stored(T, out + (m0) * ld + (n0), ld * 4); break; } \
    if ((m0) >= M || (n0) >= w.rows) break;                                                                 \
    _tile_stored(T, tmp, 64);                                                                               \
    store_partial(out, ld, (m0), (n0), M, w.rows, tmp);                                                     \
  } while (0)

inline void store_partial(float* out, int64_t ld, int64_t m0, int64_t n0, int64_t M, int64_t N, const float* tmp) {
  const int64_t cols = std::min<int64_t>(kTile, N - n0);
  const __mmask16 mask = cols >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
  for (int64_t i = 0; i < kTile && m0 + i < M; ++i)
    _mm512_mask_storeu_ps(out + (m0 + i) * ld + n0, mask, _mm512_load_ps(tmp + 16 * i));
}

// Output panels t0 .. t1 - 1 of 32 rows (groups 4t .. 4t + 3) for all M rows of xb (bf16 [>= M + 16, K]).
template <bool Q4, bool Q5>
void panels(const Weights& w, const uint16_t* xb, int64_t M, int64_t t0, int64_t t1, float* out, int64_t ld) {
  thread_local std::vector<uint8_t> store;
  const size_t need = static_cast<size_t>(w.nb * 2 * kBTile + 1024 + 128);
  if (store.size() < need) store.resize(need);
  uint8_t* buf = amx::align64(store.data());
  float* tmp = reinterpret_cast<float*>(buf + w.nb * 2 * kBTile);
  const int64_t groups = (w.rows + RG - 1) / RG, K = w.nb * QK, stride = K * 2;
  configure();
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t g = 4 * t, n0 = g * RG;
    const bool right = g + 2 < groups;  // the panel's second 16-row tile exists
    for (int64_t b = 0; b < w.nb; ++b) {
      dequant_tile<Q4, Q5>(w, g, g + 1 < groups, b, buf + (2 * b) * kBTile);
      if (right) dequant_tile<Q4, Q5>(w, g + 2, g + 3 < groups, b, buf + (2 * b + 1) * kBTile);
    }
    for (int64_t m0 = 0; m0 < M; m0 += 2 * kTile) {
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      const uint16_t* a0 = xb + m0 * K;
      const uint16_t* a1 = a0 + kTile * K;
      const bool lower = m0 + kTile < M;  // the second activation tile has rows
      for (int64_t b = 0; b < w.nb; ++b) {
        const uint8_t* bt = buf + 2 * b * kBTile;
        _tile_loadd(4, a0 + b * QK, stride);
        _tile_loadd(6, bt, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (right) { _tile_loadd(7, bt + kBTile, 64); _tile_dpbf16ps(1, 4, 7); }
        if (lower) {
          _tile_loadd(5, a1 + b * QK, stride);
          _tile_dpbf16ps(2, 5, 6);
          if (right) _tile_dpbf16ps(3, 5, 7);
        }
      }
      TM_STORE_C(0, m0, n0);
      if (right) TM_STORE_C(1, m0, n0 + kTile);
      if (lower) {
        TM_STORE_C(2, m0 + kTile, n0);
        if (right) TM_STORE_C(3, m0 + kTile, n0 + kTile);
      }
    }
  }
  _tile_release();
}

void linear(const Weights& w, const uint16_t* xb, int64_t M, float* out, int64_t ld) {
  const int64_t groups = (w.rows + RG - 1) / RG;
  at::parallel_for(0, (groups + 3) / 4, 1, [&](int64_t t0, int64_t t1) {
    if (w.q5) panels<true, true>(w, xb, M, t0, t1, out, ld);
    else if (w.q4) panels<true, false>(w, xb, M, t0, t1, out, ld);
    else panels<false, false>(w, xb, M, t0, t1, out, ld);
  });
}

// x float32 [M, K] → bf16 (round to nearest even) [M, K]; the caller pads rows past M.
void to_bf16(const float* x, int64_t M, int64_t K, uint16_t* xb) {
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t i = m0 * K; i < m1 * K; i += 32) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
      _mm512_storeu_si512(xb + i, (__m512i)v);
    }
  });
}
#undef TM_STORE_C
}  // namespace amxbf
#pragma GCC pop_options
