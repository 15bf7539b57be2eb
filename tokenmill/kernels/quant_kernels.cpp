// Quantized linear layers with integer dot products (built by tokenmill/kernels/__init__.py).
//
// Weights: blocks of 32 consecutive weights of one output row (K = 32 * nb), in the interleaved
// layout of tokenmill/layers/quant_formats.py: rows in groups of 8, and inside block b of group g
// 16 pairs of neighbouring columns, each pair stored for the 8 rows side by side:
//   q8: w = scale[n, b] * q                 (q int8 in [-127, 127], 16 bytes per pair: 8 rows x 2)
//   q4: w = scale[n, b] * q + offset[n, b]  (q in [0, 15]; a 16-byte chunk c holds pair c in its low
//                                            nibbles and pair c + 8 in its high nibbles)
//   q5: w = scale[n, b] * q + offset[n, b]  (q in [0, 31]: q4's nibbles, plus a uint16 mask per chunk
//                                            and nibble half whose bit i is the fifth bit of lane i of
//                                            the widened chunk; without offset lanes (Q5_0) the offset
//                                            is -16 * scale, implied; with them Q5_1's m or Q5_K's -dmin m)
//   q6: w = scale[n, b, h] * (q - 32)       (q in [0, 63]: q4's nibbles, plus two such mask planes for
//                                            bits 4 and 5; a scale per 16-column half h, int8 times an
//                                            fp16 lane per 8 blocks: GGUF Q6_K's own blocks)
//   iq4: w = scale[n, b] * T[q]            (q in [0, 15]: q4's nibbles, T the matrix's 16-entry int8 table, passed
//                                            as its `high`; GGUF IQ4_NL and IQ4_XS exactly, no offset)
// Scales and offsets are float32, or fp16 where the GGUF block stored them so (exact; half the bytes), or
// two-level (Q4_K: a uint8 multiplier a block times an fp16 lane per 8 blocks, formed exactly in float32).
// Activations: each row of x is quantized once per call to int8 blocks of 32. With P = 2 passes (the
// default) a block is two int8 vectors, the first rounding and its residual at a 254x finer step:
//   d1 = max|x| / 127,  q1 = round(x / d1),  q2 = round((x - d1 q1) * 254 / d1) in [-127, 127]
//   x ~ d (254 q1 + q2),  d = d1 / 254          (a 15-bit activation, error <= d1 / 508)
// and the kernel multiplies the combined int16 value a = 254 q1 + q2 (P = 1: a = q1, d = d1). The
// block sum s = d * sum_j a_j is the offset term's, so the result is exactly (rounded x) . (dequantized
// W) up to float summation order. (The sum of the rounded activations, not of x: with q4's uncentred
// q in [0, 15] the rounding errors then cancel against the offset instead of being scaled by ~8x.)
//   y[m, n] = sum_b scale[n,b] * d[m,b] * sum_j q[n,b,j] a[m,b,j]  +  sum_b offset[n,b] * s[m,b]
//
// The inner sum is exact int32 math on int16 pairs (`madd`: |a| <= 32385, |q| <= 127, so a block's
// sum is below 32 * 127 * 32385 < 2^31). One 16-byte load of a pair, widened to int16 (q8: sign
// extension; q4: zero extension, then & 0xF and >> 4 give two pairs), is 8 rows x 2 weights: `madd`
// against the activation pair broadcast to all lanes leaves row r's partial sum in lane r. So a block
// is 16 madds into one int32 vector per activation row, converted and scaled once (8 rows' scales are
// one load), with no horizontal sums; each widened weight vector serves RM activation rows (register
// tile RM x 8, RM <= 6: 4-row tiles, 5-6 where a 1-2-row rest joins the last), which is what makes
// M > 1 (batched decode, verification, prefill) cheap: the weights stream once per RM rows and the
// per-row work is one broadcast, one madd, one add.
// AVX-512 VNNI fuses the madd and the add (`vpdpwssd`) and runs 512-bit tiles: two groups (16 rows)
// per zmm and up to 8 activation rows per tile (vnni::tile2), and on Zen 5 duo tiles (two column pairs
// of one group per zmm) for 1 row and for a matrix streamed from memory at 6-24 rows; those live in
// quant_vnni.h. The portable path is plain int loops.
//
// AMX hosts (the `amx` path) run the avx512vnni tiles below amx_min_rows() activation rows and AMX
// tile products from there (quant_amx.h: AMX-INT8 with the same bits, and AMX-BF16 for prefill-sized
// calls from amx_bf16_rows(), weights dequantized to bf16 in L2; docs/quantization.md).
//
// One object runs on every x86-64 CPU: it is compiled for the baseline ISA and each fast path
// carries its own target attribute; the caller picks the path (cpu_isas() says what this CPU has).
// Work: threads split the row groups; within a thread, groups are taken in L2-sized chunks and every
// RM-row tile of activations passes over a chunk while it is cached.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "c_api.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define TM_X86 1
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace {

constexpr int64_t QK = 32;  // weights per block
constexpr int64_t RG = 8;   // output rows per interleaved group
enum Isa : int64_t { PORTABLE = 0, AVX2 = 1, AVX512VNNI = 2, AMX = 3 };  // AMX: avx512vnni below amx_min_rows()
constexpr float kFine = 254.f;  // pass 2's step is 1/254 of pass 1's
constexpr int64_t kPrefetch = 2048;  // bytes ahead in the weight stream (the scales: a quarter of it)
constexpr int64_t kPanelBytes = 512 << 10;  // int16 activation rows a pass over the weights takes (run_groups)
constexpr int64_t kStreamBytes = 64 << 20;  // a matrix past this is streamed from memory whatever the tiles do
constexpr int64_t kDuoRows = 8;  // the tallest avx512vnni duo tile (8 rows x 2 chains: 16 of the 32 zmm registers)
constexpr int64_t kSplitBytes = 64 << 10;  // least weight bytes per thread task (scaled by M / 4 for wider tiles)

struct Act {  // quantized activations: a [M, K] int16 (the combined integer), d/s [M, nb] float
  const int16_t* a;
  const float* d;
  const float* s;
  int64_t K, nb;
  const int8_t* q;  // the int8 passes [M, nb, P, 32] (the AMX tiles multiply them one pass at a time)
  int64_t P;
};

// One array of 8 scale or offset lanes a (group, block): float32, fp16, or (two-level, Q4_K's own form)
// a uint8 multiplier a lane times an fp16 lane per 8 blocks (a 256-weight super-block): lane (g, b, r) =
// p[(g nb + b) 8 + r] * d[(g nb + 8 floor(b / 8)) + r], the product exact in float32 (6 x 11 bits).
struct Lanes {
  const void* p;
  const c10::Half* d;  // two-level only: [G, nb] fp16, (group, super-block, row)
};

struct Weights {           // one interleaved matrix (quant_formats.py)
  const uint8_t* qs;       // [G, nb * (q4 ? 128 : 256)]
  Lanes scale;             // [G, nb * 8] float32, or fp16 (`half`: where GGUF's own fp16 scales are exact), or uint8 (`two`)
  Lanes offset;            // [G, nb * 8] like scale (q4; q5 from Q5_1 / Q5_K) or nullptr (q8; q5 from Q5_0: -16 scale)
  const uint8_t* high;     // [G, nb * 32] q5's fifth-bit masks (q6: two planes; iq4: its 16-entry int8 table), or nullptr
  int64_t nb, rows;
  bool q4, half, q5;       // q4: nibbles (q4 and q5); q5: plus the fifth bits
  bool two;                // two-level lanes (q4 from Q4_K; nb a multiple of 8)
  bool q6;                 // q6 (Q6_K): q4's nibbles, two mask planes (bits 4, 5), int8 lanes a 16-column half
  bool iq4;                // iq4 (IQ4_NL, IQ4_XS): q4's nibbles through the int8 table at `high`, no offset
  // The 16 mask words of block (g, b): word 2c = chunk c's low nibbles, 2c + 1 its high nibbles (q6: then the
  // 16 words of the bit-5 plane).
  const uint8_t* high_block(int64_t g, int64_t b) const { return high + (g * nb + b) * (q6 ? 64 : 32); }
  // q6's lanes are 16 int8 a (group, block): 2 bytes for each unit of lanes(g, b).
  int64_t lane_bytes() const { return two ? 1 : q6 || half ? 2 : 4; }
  // Lane i of scale / offset (the portable path; the SIMD tiles load eight at a time).
  float scale_at(int64_t i) const { return lane(scale, i); }
  float offset_at(int64_t i) const { return lane(offset, i); }
  // q4/q5's offset lane i; q5 without offset lanes implies -16 * scale (exact: a power of two).
  float offset_or_implied(int64_t i) const { return offset.p ? offset_at(i) : scale_at(i) * -16.f; }
  // q6: the 8 rows' int8 multipliers of half h (0: columns 0-15, 1: 16-31) of block (g, b), and the 8 fp16
  // lanes of its super-block; a lane is their product (exact in float32: 8 x 11 bits).
  const int8_t* q6_mults(int64_t g, int64_t b, int h) const {
    return static_cast<const int8_t*>(scale.p) + (2 * (g * nb + b) + h) * RG;
  }
  const c10::Half* supers_of(const Lanes& l, int64_t g, int64_t b) const { return l.d + super_block(g * nb + b); }
  float q6_lane(int64_t g, int64_t b, int h, int r) const {
    return static_cast<float>(q6_mults(g, b, h)[r]) * static_cast<float>(supers_of(scale, g, b)[r]);
  }
  float lane(const Lanes& l, int64_t i) const {
    if (two) return static_cast<float>(static_cast<const uint8_t*>(l.p)[i]) * static_cast<float>(l.d[super(i) + (i & 7)]);
    return half ? static_cast<float>(static_cast<const c10::Half*>(l.p)[i]) : static_cast<const float*>(l.p)[i];
  }
  // The first of the 8 fp16 lanes of flat block g nb + b's super-block: with nb = 8k, (blk >> 3) << 3 =
  // g nb + 8 floor(b / 8); and that of lane index i = (g nb + b) 8.
  static int64_t super_block(int64_t blk) { return (blk >> 3) << 3; }
  static int64_t super(int64_t i) { return super_block(i >> 3); }
  const char* lane_ptr(const Lanes& l, int64_t i) const { return static_cast<const char*>(l.p) + i * lane_bytes(); }
  int64_t block_bytes() const { return q4 ? 128 : 256; }
  const uint8_t* block(int64_t g, int64_t b) const { return qs + (g * nb + b) * block_bytes(); }
  int64_t lanes(int64_t g, int64_t b) const { return (g * nb + b) * RG; }
};

// ---- activation quantization ---------------------------------------------------------------

// The float steps are spelled out (no fused multiply-add: -ffp-contract=off) so that every path,
// and the tests' torch model of it, rounds identically.
void quantize_rows_portable(const float* x, int64_t M, int64_t K, int64_t P, int8_t* qa, float* d, float* s) {
  const int64_t nb = K / QK;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * QK;
      int8_t* q = qa + (m * nb + b) * P * QK;
      float amax = 0.f;
      for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float id = amax > 0.f ? 127.f / amax : 0.f;
      const float d1 = amax / 127.f;
      const float fine = kFine * id;
      int32_t isum = 0;
      for (int j = 0; j < QK; ++j) {
        const float r1 = std::nearbyint(xb[j] * id);
        q[j] = static_cast<int8_t>(r1);
        if (P == 2) {
          const float resid = xb[j] - r1 * d1;
          const float r2 = std::min(127.f, std::max(-127.f, std::nearbyint(resid * fine)));
          q[QK + j] = static_cast<int8_t>(r2);
          isum += static_cast<int32_t>(kFine) * q[j] + q[QK + j];
        } else {
          isum += q[j];
        }
      }
      d[m * nb + b] = P == 2 ? d1 / kFine : d1;
      s[m * nb + b] = d[m * nb + b] * static_cast<float>(isum);
    }
  }
}


// a [M, K] int16 = 254 q1 + q2 (P = 2) or q1 (P = 1), from the int8 passes [M, nb, P, 32].
void combine_passes(const int8_t* qa, int64_t M, int64_t K, int64_t P, int16_t* a) {
  for (int64_t i = 0; i < M * K / QK; ++i) {
    const int8_t* q = qa + i * P * QK;
    int16_t* out = a + i * QK;
    if (P == 2) for (int j = 0; j < QK; ++j) out[j] = static_cast<int16_t>(static_cast<int>(kFine) * q[j] + q[QK + j]);
    else for (int j = 0; j < QK; ++j) out[j] = q[j];
  }
}

// ---- portable kernel -------------------------------------------------------------------------

// Weight (r, j) of block (g, b): the layout's inverse, one element at a time.
inline int32_t weight_at(const Weights& w, const uint8_t* blk, const uint8_t* hb, int r, int j) {
  const int p = j / 2, e = j % 2;
  if (!w.q4) return reinterpret_cast<const int8_t*>(blk)[(p * RG + r) * 2 + e];
  const uint8_t byte = blk[((p % 8) * RG + r) * 2 + e];
  const int32_t q = p < 8 ? (byte & 0x0F) : (byte >> 4);
  if (w.iq4) return reinterpret_cast<const int8_t*>(w.high)[q];
  if (!w.q5 && !w.q6) return q;
  const int word = 2 * (p % 8) + (p < 8 ? 0 : 1), lane = 2 * r + e;
  const uint16_t mask = static_cast<uint16_t>(hb[2 * word] | (hb[2 * word + 1] << 8));
  if (!w.q6) return q | (((mask >> lane) & 1) << 4);
  const uint16_t mask5 = static_cast<uint16_t>(hb[32 + 2 * word] | (hb[32 + 2 * word + 1] << 8));
  return (q | (((mask >> lane) & 1) << 4) | (((mask5 >> lane) & 1) << 5)) - 32;  // q6: q - 32
}

void groups_portable(const Weights& w, const Act& a, int64_t M, int64_t g0, int64_t g1, float* out, int64_t ld) {
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t valid = std::min<int64_t>(RG, w.rows - g * RG);
    for (int64_t m = 0; m < M; ++m) {
      float y[RG] = {};
      for (int64_t b = 0; b < w.nb; ++b) {
        const uint8_t* blk = w.block(g, b);
        const uint8_t* hb = w.q5 || w.q6 ? w.high_block(g, b) : nullptr;
        const int16_t* ab = a.a + m * a.K + b * QK;
        const int64_t lanes = w.lanes(g, b);
        for (int r = 0; r < RG; ++r) {
          if (w.q6) {  // two 16-column halves, each with its own scale; lo's step first (every path's order)
            int32_t half[2] = {0, 0};
            for (int j = 0; j < QK; ++j) half[j / 16] += weight_at(w, blk, hb, r, j) * ab[j];
            for (int h = 0; h < 2; ++h)
              y[r] += w.q6_lane(g, b, h, r) * a.d[m * a.nb + b] * static_cast<float>(half[h]);
            continue;
          }
          int32_t isum = 0;
          for (int j = 0; j < QK; ++j) isum += weight_at(w, blk, hb, r, j) * ab[j];
          y[r] += w.scale_at(lanes + r) * a.d[m * a.nb + b] * static_cast<float>(isum);
          if (w.q4 && !w.iq4) y[r] += w.offset_or_implied(lanes + r) * a.s[m * a.nb + b];
        }
      }
      for (int64_t r = 0; r < valid; ++r) out[m * ld + g * RG + r] = y[r];
    }
  }
}

#ifdef TM_X86

// Software prefetch kPrefetch bytes ahead in group g's weight stream at block b, and (every other
// block) in its scales: one call streams only 0.2-2 MB per thread, too short for the hardware
// prefetcher to ramp up from DRAM before the stream ends. The tiles call it on the first activation
// tile's pass over a chunk only: the later passes find it in L2, where the prefetches only took load
// slots (measured in docs/quantization.md). Plain SSE: usable under every target.
template <bool Q4, bool Q5>
inline void prefetch_ahead(const Weights& w, int64_t g, int64_t b) {
  const char* blk = reinterpret_cast<const char*>(w.block(g, b)) + kPrefetch;
  _mm_prefetch(blk, _MM_HINT_T0);
  _mm_prefetch(blk + 64, _MM_HINT_T0);
  if (!Q4) {
    _mm_prefetch(blk + 128, _MM_HINT_T0);
    _mm_prefetch(blk + 192, _MM_HINT_T0);
  }
  if ((b & 1) == 0) {
    _mm_prefetch(w.lane_ptr(w.scale, w.lanes(g, b)) + kPrefetch / 4, _MM_HINT_T0);
    // q5's masks: 32 bytes a block, a quarter of its nibbles' stream, as far ahead as the scales
    if (Q5) _mm_prefetch(reinterpret_cast<const char*>(w.high_block(g, b)) + kPrefetch / 4, _MM_HINT_T0);
  }
}

// ---- shared SIMD tile code, stamped out once per ISA --------------------------------------------
// Each ISA namespace defines, under its own target pragma:
//   madd_acc(acc, w, a): acc + the int32 pair sums of int16 w x a (madd + add, or one vpdpwssd)
// and the macro below builds the tiles from it, so the two fast paths share one body.

#define TM_SIMD_TILES                                                                                            \
/* Eight scale or offset lanes as float32, from float32, fp16 or two-level storage. */                                 \
inline __m256 lanes8(const Weights& w, const Lanes& l, int64_t i) {                                                    \
  if (w.two) {                                                                                                         \
    const __m128i m = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.lane_ptr(l, i)));                            \
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(l.d + Weights::super(i))));     \
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m)), d);                                              \
  }                                                                                                                    \
  if (w.half) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.lane_ptr(l, i))));            \
  return _mm256_loadu_ps(reinterpret_cast<const float*>(w.lane_ptr(l, i)));                                            \
}                                                                                                                      \
/* The offset lanes of a q4/q5 block whose scale lanes are sw: q5 without offset lanes (Q5_0) implies -16 * sw. */   \
inline __m256 offsets8(const Weights& w, __m256 sw, int64_t i) {                                                       \
  return w.offset.p ? lanes8(w, w.offset, i) : _mm256_mul_ps(sw, _mm256_set1_ps(-16.f));                               \
}                                                                                                                      \
inline __m256i bcast_pair(const int16_t* p) {                                                                          \
  int32_t v;                                                                                                           \
  std::memcpy(&v, p, sizeof v);                                                                                        \
  return _mm256_set1_epi32(v);                                                                                         \
}                                                                                                                      \
/* Byte-level decode (iq4's, and q5/q6's where kByteBits): chunk c's 16 bytes as 32 nibble bytes, bytes 0-15 its \
   low nibbles (lo's lanes), 16-31 its high ones... */                                                                \
inline __m256i nibble_bytes(const uint8_t* p) {                                                                        \
  const __m256i r = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));                 \
  return _mm256_and_si256(_mm256_srlv_epi64(r, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));               \
}                                                                                                                      \
/* ...and a mask word pair (4 bytes: the low nibbles' uint16, then the high ones') as 32 bytes in that order:    \
   byte i of each 128-bit half is `bit` where bit i of its uint16 is set, else 0. */                                   \
inline __m256i bit_bytes(const uint8_t* words, int8_t bit) {                                                           \
  int32_t v;                                                                                                           \
  std::memcpy(&v, words, sizeof v);                                                                                    \
  const __m256i sel = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,                                 \
                                       2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);                                \
  const __m256i pos = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));                                 \
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(v), sel), pos), pos);   \
  return _mm256_and_si256(set, _mm256_set1_epi8(bit));                                                                 \
}                                                                                                                      \
/* iq4's table in both 128-bit halves (a vpshufb table). */                                                           \
inline __m256i iq4_table(const Weights& w) {                                                                           \
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.high)));                       \
}                                                                                                                      \
/* Bytes 0-15 and 16-31 widened to the int16 lanes of lo and hi (sign- or zero-extended). */                           \
template <bool Signed>                                                                                                 \
inline void widen_halves(__m256i q, __m256i& lo, __m256i& hi) {                                                        \
  const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);                                  \
  lo = Signed ? _mm256_cvtepi8_epi16(q0) : _mm256_cvtepu8_epi16(q0);                                                   \
  hi = Signed ? _mm256_cvtepi8_epi16(q1) : _mm256_cvtepu8_epi16(q1);                                                   \
}                                                                                                                      \
/* Chunk c of a q4/q5 block: 16 bytes → its low and high nibbles as int16 (c's pairs and c + 8's), q5's                \
   fifth bits added: lane i of lo (hi) gets 16 where bit i of its mask word is set. */                                 \
template <bool Q5, bool IQ = false>                                                                                   \
inline void unpack_chunk(const Weights& w, const uint8_t* blk, int64_t g, int64_t b, int c, __m256i low, __m256i& lo,  \
                         __m256i& hi) {                                                                                \
  if constexpr (IQ) {  /* iq4: the table's int8 at each nibble byte, sign-extended */                                 \
    widen_halves<true>(_mm256_shuffle_epi8(iq4_table(w), nibble_bytes(blk + 16 * c)), lo, hi);                        \
    return;                                                                                                            \
  }                                                                                                                    \
  if constexpr (Q5 && kByteBits) {                                                                                               \
    widen_halves<false>(_mm256_or_si256(nibble_bytes(blk + 16 * c), bit_bytes(w.high_block(g, b) + 4 * c, 16)), lo, hi); \
    return;                                                                                                            \
  }                                                                                                                    \
  const __m256i raw = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * c)));           \
  lo = _mm256_and_si256(raw, low);                                                                                     \
  hi = _mm256_srli_epi16(raw, 4);                                                                                      \
  if (Q5) {                                                                                                            \
    uint32_t words;                                                                                                    \
    std::memcpy(&words, w.high_block(g, b) + 4 * c, sizeof words);                                                     \
    lo = add_bit(lo, words & 0xFFFF, 16);                                                                              \
    hi = add_bit(hi, words >> 16, 16);                                                                                 \
  }                                                                                                                    \
}                                                                                                                      \
/* Rows m0 .. m0 + RM - 1 of group g's 8 output columns (the last group may be partial). */                         \
template <int RM>                                                                                                      \
inline void store_rows(const Weights& w, int64_t g, const __m256* acc, int64_t m0, float* out, int64_t ld) {            \
  const int64_t valid = std::min<int64_t>(RG, w.rows - g * RG);                                                        \
  for (int r = 0; r < RM; ++r) {                                                                                       \
    float* y = out + (m0 + r) * ld + g * RG;                                                                           \
    if (valid == RG) { _mm256_storeu_ps(y, acc[r]); continue; }                                                        \
    alignas(32) float tmp[RG];                                                                                         \
    _mm256_store_ps(tmp, acc[r]);                                                                                      \
    for (int64_t i = 0; i < valid; ++i) y[i] = tmp[i];                                                                 \
  }                                                                                                                    \
}                                                                                                                      \
/* Group g (8 output rows) against activation rows m0 .. m0 + RM - 1: one int32 vector per row and                     \
   block (lane r = row r's block sum), then y += sum * (8 weight scales x the row's scale). */                         \
template <int RM, bool Q4, bool Q5, bool IQ = false, bool PANEL = false>                                               \
void tile(const Weights& w, int64_t g, const Act& a, int64_t m0, float* out, int64_t ld, bool first_pass,              \
          const int8_t* panel = nullptr) {                                                                             \
  __m256 acc[RM];                                                                                                      \
  const int16_t* arow[RM];                                                                                             \
  for (int r = 0; r < RM; ++r) { acc[r] = _mm256_setzero_ps(); arow[r] = a.a + (m0 + r) * a.K; }                       \
  for (int64_t b = 0; b < w.nb; ++b) {                                                                                 \
    /* PANEL: group g's blocks already decoded into q8's layout (decode_group); the q8 loop reads them */              \
    const uint8_t* blk = PANEL ? reinterpret_cast<const uint8_t*>(panel + b * 256) : w.block(g, b);                    \
    if (first_pass && !PANEL) prefetch_ahead<Q4, Q5>(w, g, b);  /* the first tile's pass over a chunk only */          \
    /* NCH independent integer chains per row where kSplitChains (VNNI): vpdpwssd is the madd and the add \
       in one, so a row's sums form one dependent chain of its latency; a 1-row tile splits it in 4, 2-6- \
       row tiles in 2 (summed exactly at the block's end: the bits do not change; measured on Zen 5,     \
       docs/quantization.md). AVX2's chain is the 1-cycle add. */                                          \
    constexpr int NCH = !kSplitChains ? 1 : RM == 1 ? 4 : RM <= 6 ? 2 : 1;                                             \
    __m256i isum[RM][NCH];                                                                                             \
    for (int r = 0; r < RM; ++r) for (int k = 0; k < NCH; ++k) isum[r][k] = _mm256_setzero_si256();                    \
    if (Q4 && !PANEL) {                                                                                                \
      const __m256i low = _mm256_set1_epi16(0x0F);                                                                     \
      auto chunk = [&](int c) {                                                                                        \
        __m256i lo, hi;                                                                                                \
        unpack_chunk<Q5, IQ>(w, blk, g, b, c, low, lo, hi);                                                            \
        for (int r = 0; r < RM; ++r) {                                                                                 \
          const int16_t* ab = arow[r] + b * QK + 2 * c;                                                                \
          isum[r][(2 * c) % NCH] = madd_acc(isum[r][(2 * c) % NCH], lo, bcast_pair(ab));                               \
          isum[r][(2 * c + 1) % NCH] = madd_acc(isum[r][(2 * c + 1) % NCH], hi, bcast_pair(ab + 16));                  \
        }                                                                                                              \
      };                                                                                                               \
      /* Unrolled where chains split (the chain index must be a constant); one chain (AVX2) kept its rolled */         \
      /* loop: unrolled it measured 0.98x through TOKENMILL_QUANT_ISA=avx2 on Zen 5 (docs/quantization.md). */         \
      if constexpr (NCH > 1) { _Pragma("GCC unroll 8") for (int c = 0; c < 8; ++c) chunk(c); }                         \
      else { for (int c = 0; c < 8; ++c) chunk(c); }                                                                   \
    } else {                                                                                                           \
      auto pair = [&](int p) {                                                                                         \
        const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * p)));     \
        for (int r = 0; r < RM; ++r) isum[r][p % NCH] = madd_acc(isum[r][p % NCH], wv, bcast_pair(arow[r] + b * QK + 2 * p)); \
      };                                                                                                               \
      /* Unrolled where chains split (the chain index must be a constant) and for 3-4-row tiles; one chain \
         at 1-2 rows lost with the unroll on Zen 3 (docs/quantization.md). */                               \
      if constexpr (NCH > 1) { _Pragma("GCC unroll 16") for (int p = 0; p < 16; ++p) pair(p); }                        \
      else if constexpr (RM > 2) { _Pragma("GCC unroll 2") for (int p = 0; p < 16; ++p) pair(p); }                     \
      else { for (int p = 0; p < 16; ++p) pair(p); }                                                                   \
    }                                                                                                                  \
    __m256i isum_r[RM];                                                                                                \
    for (int r = 0; r < RM; ++r) {                                                                                     \
      isum_r[r] = isum[r][0];                                                                                          \
      for (int k = 1; k < NCH; ++k) isum_r[r] = _mm256_add_epi32(isum_r[r], isum[r][k]);                               \
    }                                                                                                                  \
    const __m256 sw = lanes8(w, w.scale, w.lanes(g, b));                                                               \
    for (int r = 0; r < RM; ++r) {                                                                                     \
      const __m256 scale = _mm256_mul_ps(sw, _mm256_set1_ps(a.d[(m0 + r) * a.nb + b]));                                \
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum_r[r]), scale, acc[r]);                                          \
    }                                                                                                                  \
    if (Q4 && !IQ) {                                                                                                   \
      const __m256 off = offsets8(w, sw, w.lanes(g, b));                                                               \
      for (int r = 0; r < RM; ++r) acc[r] = _mm256_fmadd_ps(off, _mm256_set1_ps(a.s[(m0 + r) * a.nb + b]), acc[r]);    \
    }                                                                                                                  \
  }                                                                                                                    \
  store_rows<RM>(w, g, acc, m0, out, ld);                                                                              \
}                                                                                                                      \
/* q6 (Q6_K): int8 lanes per 16-column half times the super-block's fp16 lane, 8 rows (exact products). */           \
inline __m256 q6_lanes8(const Weights& w, int64_t g, int64_t b, int h) {                                               \
  const __m128i m = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.q6_mults(g, b, h)));                            \
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.supers_of(w.scale, g, b))));     \
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(m)), d);                                                \
}                                                                                                                      \
/* q6 against rows m0 .. m0 + RM - 1: the q4 chunk's nibbles plus bits 4 and 5 from the two mask planes,         \
   less 32 (int16 in [-32, 31]); a chunk's low nibbles are columns 0-15 of the block and its high ones 16-31,  \
   Q6_K's two 16-weight sub-blocks, so they sum apart (|sum| <= 16 * 32 * 32385 < 2^31) and take one float   \
   step each, low half first. */                                                                                       \
template <int RM, bool PANEL = false>                                                                                  \
void tile6(const Weights& w, int64_t g, const Act& a, int64_t m0, float* out, int64_t ld, bool first_pass,             \
           const int8_t* panel = nullptr) {                                                                            \
  __m256 acc[RM];                                                                                                      \
  const int16_t* arow[RM];                                                                                             \
  for (int r = 0; r < RM; ++r) { acc[r] = _mm256_setzero_ps(); arow[r] = a.a + (m0 + r) * a.K; }                       \
  const __m256i low = _mm256_set1_epi16(0x0F), bias = _mm256_set1_epi16(32);                                           \
  for (int64_t b = 0; b < w.nb; ++b) {                                                                                 \
    const uint8_t* blk = w.block(g, b);                                                                                \
    const uint8_t* hb = w.high_block(g, b);                                                                            \
    if (first_pass && !PANEL) prefetch_ahead<true, true>(w, g, b);                                                     \
    constexpr int NCH = kSplitChains && RM <= 2 ? 2 : 1;  /* chains a half and row (VNNI: latency-bound below 3 rows) */ \
    __m256i slo[RM][NCH], shi[RM][NCH];                                                                                \
    for (int r = 0; r < RM; ++r) for (int k = 0; k < NCH; ++k) slo[r][k] = shi[r][k] = _mm256_setzero_si256();        \
    auto chunk = [&](int c) {                                                                                          \
      __m256i lo, hi;                                                                                                  \
      if constexpr (PANEL) {  /* decode_group's q - 32: pair c (columns 0-15), pair c + 8 (16-31) */                   \
        lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + b * 256 + 16 * c)));        \
        hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + b * 256 + 16 * (c + 8))));  \
      } else if constexpr (kByteBits) {  /* q - 32 formed as bytes, then sign-extended */                              \
        const __m256i q = _mm256_or_si256(_mm256_or_si256(nibble_bytes(blk + 16 * c), bit_bytes(hb + 4 * c, 16)),     \
                                          bit_bytes(hb + 32 + 4 * c, 32));                                             \
        widen_halves<true>(_mm256_sub_epi8(q, _mm256_set1_epi8(32)), lo, hi);                                          \
      } else {                                                                                                         \
        const __m256i raw = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * c)));     \
        uint32_t w4, w5;                                                                                               \
        std::memcpy(&w4, hb + 4 * c, sizeof w4);                                                                       \
        std::memcpy(&w5, hb + 32 + 4 * c, sizeof w5);                                                                  \
        lo = _mm256_sub_epi16(add_bit(add_bit(_mm256_and_si256(raw, low), w4 & 0xFFFF, 16), w5 & 0xFFFF, 32), bias);  \
        hi = _mm256_sub_epi16(add_bit(add_bit(_mm256_srli_epi16(raw, 4), w4 >> 16, 16), w5 >> 16, 32), bias);         \
      }                                                                                                                \
      for (int r = 0; r < RM; ++r) {                                                                                   \
        const int16_t* ab = arow[r] + b * QK + 2 * c;                                                                  \
        slo[r][c % NCH] = madd_acc(slo[r][c % NCH], lo, bcast_pair(ab));                                               \
        shi[r][c % NCH] = madd_acc(shi[r][c % NCH], hi, bcast_pair(ab + 16));                                          \
      }                                                                                                                \
    };                                                                                                                 \
    _Pragma("GCC unroll 8") for (int c = 0; c < 8; ++c) chunk(c);                                                      \
    const __m256 llo = q6_lanes8(w, g, b, 0), lhi = q6_lanes8(w, g, b, 1);                                             \
    for (int r = 0; r < RM; ++r) {                                                                                     \
      __m256i sl = slo[r][0], sh = shi[r][0];                                                                          \
      for (int k = 1; k < NCH; ++k) { sl = _mm256_add_epi32(sl, slo[r][k]); sh = _mm256_add_epi32(sh, shi[r][k]); }    \
      const __m256 ad = _mm256_set1_ps(a.d[(m0 + r) * a.nb + b]);                                                      \
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sl), _mm256_mul_ps(llo, ad), acc[r]);                                \
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sh), _mm256_mul_ps(lhi, ad), acc[r]);                                \
    }                                                                                                                  \
  }                                                                                                                    \
  store_rows<RM>(w, g, acc, m0, out, ld);                                                                              \
}                                                                                                                      \
template <int RM>                                                                                                      \
void tile(const Weights& w, int64_t g, const Act& a, int64_t m0, float* out, int64_t ld) {                             \
  if (w.q6) tile6<RM>(w, g, a, m0, out, ld, m0 == 0);                                                                  \
  else if (w.q5) tile<RM, true, true>(w, g, a, m0, out, ld, m0 == 0);                                                  \
  else if (w.iq4) tile<RM, true, false, true>(w, g, a, m0, out, ld, m0 == 0);                                          \
  else if (w.q4) tile<RM, true, false>(w, g, a, m0, out, ld, m0 == 0);                                                 \
  else tile<RM, false, false>(w, g, a, m0, out, ld, m0 == 0);                                                          \
}                                                                                                                      \
/* Group g's blocks decoded once into q8's layout, 256 bytes a block (pair p: 8 rows x 2 int8 weights): a              \
   chunk's low nibbles are pair c, its high ones pair c + 8. q4/q5 values are 0-31, iq4's its table's int8,            \
   q6's q - 32 (its tile6 then sums pairs 0-7 and 8-15 apart, its two 16-column halves). */                            \
template <bool Q5, bool IQ, bool Q6 = false>                                                                           \
void decode_group(const Weights& w, int64_t g, int8_t* dst) {                                                          \
  for (int64_t b = 0; b < w.nb; ++b) {                                                                                 \
    const uint8_t* blk = w.block(g, b);                                                                                \
    prefetch_ahead<true, Q5 || Q6>(w, g, b);                                                                           \
    int8_t* d = dst + b * 256;                                                                                         \
    for (int c = 0; c < 8; ++c) {                                                                                      \
      __m256i q = nibble_bytes(blk + 16 * c);                                                                          \
      if constexpr (IQ) q = _mm256_shuffle_epi8(iq4_table(w), q);                                                      \
      if constexpr (Q5 || Q6) q = _mm256_or_si256(q, bit_bytes(w.high_block(g, b) + 4 * c, 16));                       \
      if constexpr (Q6) {                                                                                              \
        q = _mm256_or_si256(q, bit_bytes(w.high_block(g, b) + 32 + 4 * c, 32));                                        \
        q = _mm256_sub_epi8(q, _mm256_set1_epi8(32));                                                                  \
      }                                                                                                                \
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 16 * c), _mm256_castsi256_si128(q));                             \
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 16 * (c + 8)), _mm256_extracti128_si256(q, 1));                  \
    }                                                                                                                  \
  }                                                                                                                    \
}                                                                                                                      \
/* A q4/q5/iq4/q6 tile over group g's decoded panel: q8's loads, the format's scale and offset steps, so the           \
   same integer sums and float steps as tile<RM> (the same bits). */                                                   \
template <int RM>                                                                                                      \
void tile_panel(const Weights& w, int64_t g, const Act& a, int64_t m0, float* out, int64_t ld, const int8_t* panel) {  \
  if (w.q6) tile6<RM, true>(w, g, a, m0, out, ld, false, panel);                                                       \
  else if (w.iq4) tile<RM, true, false, true, true>(w, g, a, m0, out, ld, false, panel);                               \
  else tile<RM, true, false, false, true>(w, g, a, m0, out, ld, false, panel);                                         \
}                                                                                                                      \
/* The m-tiles over groups c0 .. c1 - 1: 4-row tiles, but 1-2 rows left over join the last one: a 1-2-row              \
   pass decodes every weight again for one or two rows (~2x the per-row cost of a 4-row tile), where 5-6-row           \
   tiles run at the 4-row rate. run(rows, g, m0) runs one tile of rows = std::integral_constant<int, RM>. */           \
template <class Run>                                                                                                   \
void over_tiles(int64_t M, int64_t c0, int64_t c1, Run&& run) {                                                        \
  const int64_t joined = M > 4 && M % 4 != 0 && M % 4 <= 2 ? 4 + M % 4 : 0;                                            \
  int64_t m0 = 0;                                                                                                      \
  for (; m0 + 4 <= M - joined; m0 += 4) for (int64_t g = c0; g < c1; ++g) run(std::integral_constant<int, 4>{}, g, m0); \
  const int64_t rest = M - m0;                                                                                         \
  for (int64_t g = c0; g < c1; ++g) {                                                                                  \
    if (rest == 6) run(std::integral_constant<int, 6>{}, g, m0);                                                       \
    else if (rest == 5) run(std::integral_constant<int, 5>{}, g, m0);                                                  \
    else if (rest == 3) run(std::integral_constant<int, 3>{}, g, m0);                                                  \
    else if (rest == 2) run(std::integral_constant<int, 2>{}, g, m0);                                                  \
    else if (rest == 1) run(std::integral_constant<int, 1>{}, g, m0);                                                  \
  }                                                                                                                    \
}                                                                                                                      \
void groups256(const Weights& w, const Act& a, int64_t M, int64_t g0, int64_t g1, float* out, int64_t ld) {            \
  /* Where kPanelRows: from that many rows up, q4/q5/iq4/q6 groups are decoded once into a q8-shaped panel             \
     (~128 KiB a chunk, 1 byte a weight) that every m-tile then reads as q8: AVX2 widens a q5 chunk in ~12             \
     ops where q8 takes one load, and each 4-row tile used to decode it again (docs/quantization.md). */               \
  if (kPanelRows > 0 && M >= kPanelRows && w.q4) {                                                                     \
    const int64_t panel_bytes = w.nb * 256;                                                                            \
    const int64_t chunk = std::max<int64_t>(1, (128 << 10) / panel_bytes);                                             \
    thread_local std::vector<int8_t> panels;                                                                           \
    panels.resize(static_cast<size_t>(std::min(chunk, g1 - g0) * panel_bytes));                                        \
    for (int64_t c0 = g0; c0 < g1; c0 += chunk) {                                                                      \
      const int64_t c1 = std::min(g1, c0 + chunk);                                                                     \
      for (int64_t g = c0; g < c1; ++g) {                                                                              \
        int8_t* dst = panels.data() + (g - c0) * panel_bytes;                                                          \
        if (w.q6) decode_group<false, false, true>(w, g, dst);                                                         \
        else if (w.q5) decode_group<true, false>(w, g, dst);                                                           \
        else if (w.iq4) decode_group<false, true>(w, g, dst);                                                          \
        else decode_group<false, false>(w, g, dst);                                                                    \
      }                                                                                                                \
      over_tiles(M, c0, c1, [&](auto rows, int64_t g, int64_t m0) {                                                    \
        tile_panel<decltype(rows)::value>(w, g, a, m0, out, ld, panels.data() + (g - c0) * panel_bytes);               \
      });                                                                                                              \
    }                                                                                                                  \
    return;                                                                                                            \
  }                                                                                                                    \
  /* Groups in chunks of ~128 KiB of weights, so a chunk stays in L2 while every m-tile passes over it. */             \
  const int64_t group_bytes = w.nb * w.block_bytes();                                                                  \
  const int64_t chunk = std::max<int64_t>(1, (128 << 10) / std::max<int64_t>(1, group_bytes));                         \
  for (int64_t c0 = g0; c0 < g1; c0 += chunk) {                                                                        \
    over_tiles(M, c0, std::min(g1, c0 + chunk), [&](auto rows, int64_t g, int64_t m0) {                                \
      tile<decltype(rows)::value>(w, g, a, m0, out, ld);                                                               \
    });                                                                                                                \
  }                                                                                                                    \
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
constexpr bool kSplitChains = false;
// q5/q6's high bits built at byte level, a chunk's 32 weights at once (kByteBits): AVX2 has no mask registers,
// so add_bit's broadcast-and-compare per 16 lanes was most of a q5 chunk's decode (measured in
// docs/quantization.md). The VNNI path keeps add_bit: one masked add there.
constexpr bool kByteBits = true;
// q4/q5/iq4/q6 from this many activation rows up: decoded once into q8-shaped panels (groups256). 7 is the first
// M that runs two tiles (4 + 3 rows; 5 and 6 run one): a q5 matmul of 7 rows 1.8x faster with the panel.
constexpr int64_t kPanelRows = 7;
inline __m256i madd_acc(__m256i acc, __m256i w, __m256i a) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, a)); }
// v | bit in the int16 lanes whose bit is set in `mask` (q5's fifth bit: 16; q6's bits 4 and 5: 16, 32;
// v has neither yet). AVX2 has no mask registers: broadcast, and with each lane's bit, compare, and the
// bit, or: five ops per 16 lanes, where VNNI's path takes one.
inline __m256i add_bit(__m256i v, uint32_t mask, int16_t bit) {
  const __m256i bits = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                         static_cast<int16_t>(0x8000));
  const __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(mask)), bits), bits);
  return _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi16(bit)));
}
TM_SIMD_TILES
void groups(const Weights& w, const Act& a, int64_t M, int64_t g0, int64_t g1, float* out, int64_t ld) {
  groups256(w, a, M, g0, g1, out, ld);
}

// Activation rows: amax, exact integer sums and nearest-even rounding (the portable path's steps).
inline __m256i pack8(const __m256i* q) {
  // int32 → int16 → int8 packs work per 128-bit lane; the permute restores element order.
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline __m256 round_even(__m256 v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// As quantize_rows_portable; where `a` is given, it also writes combine_passes' int16 rows (the tiles'
// operand) from the rounded integers in registers: that pass alone, scalar and on one thread, cost about
// as much as the rounding (~0.3 ns an element on Zen 5, ~4% of a 1,760-token prefill).
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t P, int8_t* qa, float* d, float* s, int16_t* a) {
  const int64_t nb = K / QK;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 lim = _mm256_set1_ps(127.f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * QK;
      int8_t* out = qa + (m * nb + b) * P * QK;
      __m256 v[4];
      __m256 mx = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float amax = _mm_cvtss_f32(h);
      const float id = amax > 0.f ? 127.f / amax : 0.f;
      const float d1 = amax / 127.f;
      const __m256 vid = _mm256_set1_ps(id);
      __m256 r1[4];
      __m256i q[4];
      for (int i = 0; i < 4; ++i) {
        r1[i] = round_even(_mm256_mul_ps(v[i], vid));
        q[i] = _mm256_cvtps_epi32(r1[i]);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), pack8(q));
      __m256i qsum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      if (P == 2) {
        const __m256 vd1 = _mm256_set1_ps(d1), vfine = _mm256_set1_ps(kFine * id);
        __m256i q2[4];
        for (int i = 0; i < 4; ++i) {
          const __m256 resid = _mm256_sub_ps(v[i], _mm256_mul_ps(r1[i], vd1));
          const __m256 r2 = round_even(_mm256_mul_ps(resid, vfine));
          q2[i] = _mm256_cvtps_epi32(_mm256_min_ps(lim, _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), lim), r2)));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + QK), pack8(q2));
        const __m256i q2sum = _mm256_add_epi32(_mm256_add_epi32(q2[0], q2[1]), _mm256_add_epi32(q2[2], q2[3]));
        qsum = _mm256_add_epi32(_mm256_mullo_epi32(qsum, _mm256_set1_epi32(static_cast<int>(kFine))), q2sum);
        if (a != nullptr) {  // 254 q1 + q2, |.| <= 32385: int16 without saturation
          const __m256i fine = _mm256_set1_epi32(static_cast<int>(kFine));
          for (int i = 0; i < 4; ++i) q[i] = _mm256_add_epi32(_mm256_mullo_epi32(q[i], fine), q2[i]);
        }
      }
      if (a != nullptr) {  // packs work per 128-bit lane; the permute restores element order
        int16_t* ao = a + m * K + b * QK;
        const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
        const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ao), lo);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ao + 16), hi);
      }
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(qsum), _mm256_extracti128_si256(qsum, 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
      d[m * nb + b] = P == 2 ? d1 / kFine : d1;
      s[m * nb + b] = d[m * nb + b] * static_cast<float>(_mm_cvtsi128_si32(t));
    }
  }
}
}  // namespace avx2
#pragma GCC pop_options

#include "quant_vnni.h"  // the AVX-512 VNNI tiles: 256-bit, duo and 512-bit

#include "quant_amx.h"  // the AMX-INT8 and AMX-BF16 tiles

#endif  // TM_X86

// The CPU family of an AMD CPU (0x19 Zen 3/4, 0x1A Zen 5), 0 on any other vendor.
unsigned amd_family() {
#ifdef TM_X86
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) && ebx == 0x68747541u /* "Auth" enticAMD */ &&
      __get_cpuid(1, &eax, &ebx, &ecx, &edx)) {
    const unsigned base = (eax >> 8) & 0xF;
    return base == 0xF ? base + ((eax >> 20) & 0xFF) : base;
  }
#endif
  return 0;
}

// Least activation rows for the 512-bit tiles: TOKENMILL_QUANT_WIDE_ROWS when set (tests, A/B runs),
// else 5 on AMD family 25 (Zen 4: 512-bit ops double-pumped; measured), 8 on AMD family 26 and later
// (Zen 5, whole-model steps of 4-6 rows 1.1-1.4x faster on the 256-bit tiles, q8 and q5 alike, even at
// 8; docs/quantization.md), else 4 (unmeasured elsewhere). A property of the CPU, read once.
int64_t wide_min_rows() {
  static const int64_t rows = [] {
    if (const char* env = std::getenv("TOKENMILL_QUANT_WIDE_ROWS")) return static_cast<int64_t>(std::atoll(env));
    const unsigned family = amd_family();
    if (family == 0x19) return static_cast<int64_t>(5);
    if (family >= 0x1A) return static_cast<int64_t>(8);
    return static_cast<int64_t>(4);
  }();
  return rows;
}

// Whether the avx512vnni path runs its duo-tile dispatch (vnni::groups: duo tiles for 1 row and a streamed
// matrix at 6-24 rows, the 512-bit tiles for the other calls of 2-8 rows), else the 256-bit tiles below
// wide_min_rows() and the 512-bit ones from there (the same bits either way): TOKENMILL_QUANT_DUO=0|1 when set
// (tests, A/B runs), else on AMD family 26 and later, where a 512-bit op runs at full width (measured
// in docs/quantization.md); off elsewhere, unmeasured.
bool duo_tiles() {
  static const bool on = [] {
    if (const char* env = std::getenv("TOKENMILL_QUANT_DUO")) return std::atoll(env) != 0;
    return amd_family() >= 0x1A;
  }();
  return on;
}

// Least activation rows the amx path runs its tiles for (below: the avx512vnni tiles, the same bits):
// TOKENMILL_QUANT_AMX_ROWS when set (tests, A/B runs), else 16 (a whole tile: 1.0-1.2x vpdpwssd from
// there, 0.6x at 8 rows; measured in docs/quantization.md). Read once.
int64_t amx_min_rows() {
  static const int64_t rows = [] {
    if (const char* env = std::getenv("TOKENMILL_QUANT_AMX_ROWS")) return std::max<int64_t>(1, std::atoll(env));
    return static_cast<int64_t>(16);
  }();
  return rows;
}

// Least activation rows for the amx path's bf16 tiles (prefill chunks): TOKENMILL_QUANT_AMX_BF16_ROWS
// when set (0: never), else 64 (measured in docs/quantization.md). Read once.
int64_t amx_bf16_rows() {
  static const int64_t rows = [] {
    if (const char* env = std::getenv("TOKENMILL_QUANT_AMX_BF16_ROWS")) return std::max<int64_t>(0, std::atoll(env));
    return static_cast<int64_t>(64);
  }();
  return rows;
}

// AMX-INT8 needs the CPU's flags, the OS's XSAVE support for the tile state (XCR0 bits 17-18) and, on
// Linux, this process's permission for the 8 KiB tile data (arch_prctl ARCH_REQ_XCOMP_PERM), without
// which the first tile instruction faults: asked once, process-wide. Elsewhere AMX is not offered.
bool amx_usable() {
#if defined(TM_X86) && defined(__linux__)
  static const bool usable = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool tile = (edx >> 24) & 1, int8 = (edx >> 25) & 1;
    if (!tile || !int8) return false;
    unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
    if (!__get_cpuid(1, &a1, &b1, &c1, &d1) || !((c1 >> 27) & 1)) return false;  // OSXSAVE
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) != 0) return false;
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((lo >> 17) & 3) == 3;
  }();
  return usable;
#else
  return false;
#endif
}

// The bf16 tiles also need AMX-BF16 (TDPBF16PS) and AVX512-BF16 (the bf16 conversions); without them
// the amx path keeps its int8 tiles at every M.
bool amx_bf16_usable() {
#ifdef TM_X86
  static const bool usable = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!amx_usable() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !((edx >> 22) & 1)) return false;
    return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && ((eax >> 5) & 1);
  }();
  return usable;
#else
  return false;
#endif
}

bool isa_available(int64_t isa) {
  if (isa == PORTABLE) return true;
#ifdef TM_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == AVX2) return avx2;
  const bool vnni = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
                    __builtin_cpu_supports("avx512dq");
  if (isa == AVX512VNNI) return vnni;
  if (isa == AMX) return vnni && amx_usable();
#endif
  return false;
}

std::vector<int64_t> cpu_isas() {
  std::vector<int64_t> out;
  for (int64_t isa : {PORTABLE, AVX2, AVX512VNNI, AMX})
    if (isa_available(isa)) out.push_back(isa);
  return out;
}

// `a`: where given, also the combined int16 rows (combine_passes), on every path.
void quantize_activations(const float* x, int64_t M, int64_t K, int64_t P, int8_t* qa, float* d, float* s,
                          int64_t isa, int16_t* a = nullptr) {
  // Rows are independent; split them over threads only when there are enough to pay for it.
  const int64_t nb = K / QK;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
#ifdef TM_X86
    if (isa != PORTABLE) {
      avx2::quantize_rows(x + m0 * K, m1 - m0, K, P, qa + m0 * nb * P * QK, d + m0 * nb, s + m0 * nb,
                          a == nullptr ? nullptr : a + m0 * K);
      return;
    }
#endif
    quantize_rows_portable(x + m0 * K, m1 - m0, K, P, qa + m0 * nb * P * QK, d + m0 * nb, s + m0 * nb);
    if (a != nullptr) combine_passes(qa + m0 * nb * P * QK, m1 - m0, K, P, a + m0 * K);
  });
}

void run_groups_panel(const Weights& w, const Act& a, int64_t M, float* out, int64_t ld, int64_t isa, int64_t amx_rows,
                      int64_t duo_rows) {
  // Grain: enough groups per task that each thread streams a long run of the weight matrix.
  const int64_t groups = (w.rows + RG - 1) / RG;
  const int64_t group_bytes = w.nb * w.block_bytes() * std::max<int64_t>(1, M / 4);
  const int64_t grain = std::max<int64_t>(1, (kSplitBytes) / std::max<int64_t>(1, group_bytes));
  const int64_t wide_rows = wide_min_rows();
#ifdef TM_X86
  if (isa == AMX && M >= amx_rows && !w.q6 && !w.iq4) {  // q6, iq4: the VNNI tiles at every M
    // Tasks of 16-row tiles: each regroups its weights once for all M rows, so a split costs nothing.
    return at::parallel_for(0, (groups + 1) / 2, 1, [&](int64_t t0, int64_t t1) {
      amx::tiles(w, a, M, t0, t1, out, ld);
    });
  }
#endif
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
#ifdef TM_X86
    if (isa == AVX512VNNI || isa == AMX) return vnni::groups(w, a, M, g0, g1, out, ld, wide_rows, duo_rows);
    if (isa == AVX2) return avx2::groups(w, a, M, g0, g1, out, ld);
#endif
    groups_portable(w, a, M, g0, g1, out, ld);
  });
}

void run_groups(const Weights& w, const Act& a, int64_t M, float* out, int64_t ld, int64_t isa, int64_t amx_rows,
                int64_t duo_rows) {
  // Activation rows in panels of ~kPanelBytes: every m-tile passes over each L2-resident weight chunk,
  // so all of a panel's rows are read once per chunk; past L2 (a 1,760-token prefill at K = 896 is
  // 3 MB of int16 rows) they came from L3 on every chunk and the GEMM fell from ~265 to ~180 G
  // multiply-adds a second. Each panel re-reads the weights instead, from L3 when they fit.
  const int64_t panel = std::max<int64_t>(64, kPanelBytes / (2 * a.K) / RG * RG);
  for (int64_t p0 = 0; p0 < M; p0 += panel) {
    const Act part{a.a + p0 * a.K, a.d + p0 * a.nb, a.s + p0 * a.nb, a.K, a.nb, a.q + p0 * a.nb * a.P * QK, a.P};
    run_groups_panel(w, part, std::min(panel, M - p0), out + p0 * ld, ld, isa, amx_rows, duo_rows);
  }
}

void check_isa(int64_t isa, int64_t passes) {
  TORCH_CHECK(isa >= PORTABLE && isa <= AMX, "unknown quant ISA ", isa);
  TORCH_CHECK(isa_available(isa), "this CPU cannot run quant ISA ", isa);
  TORCH_CHECK(passes == 1 || passes == 2, "activation passes must be 1 or 2, not ", passes);
}

// The matrices (qs_i, scale_i, offset_i, high_i) of rows_i output rows each, checked and viewed as the
// tiles read them. qs int8 → q8 (offset and high ignored: pass empty tensors), uint8 → q4, or q5 where
// high_i is not empty (offset_i empty: Q5_0, offset -16 * scale; or lanes like q4's: Q5_1, Q5_K), or q6
// where scale_i is int8 (Q6_K: high_i two mask planes, [ceil(rows/8), K/32 * 64], scale_i int8
// [ceil(rows/8), K/32 * 16] a 16-column half, supers_i fp16 [1, ceil(rows/8), K/32]). `highs` may be
// empty: no q5 or q6 matrix. `supers` may be empty, or hold per matrix an empty tensor, q6's, or (q4/q5
// with uint8 scale and offset lanes: two-level, Q4_K's and Q5_K's own form) fp16 [2, G, nb]: the scale's
// and the offset's lane per 8 blocks. K: the input features.
std::vector<Weights> checked_weights(const std::vector<at::Tensor>& qs, const std::vector<at::Tensor>& scales,
                                     const std::vector<at::Tensor>& offsets, const std::vector<int64_t>& rows,
                                     const std::vector<at::Tensor>& highs, int64_t K,
                                     const std::vector<at::Tensor>& supers = {}) {
  TORCH_CHECK(qs.size() == scales.size() && qs.size() == offsets.size() && qs.size() == rows.size() && !qs.empty() &&
              (highs.empty() || highs.size() == qs.size()) && (supers.empty() || supers.size() == qs.size()),
              "one scale/offset/row count (and high plane, super lanes) per matrix");
  TORCH_CHECK(K % QK == 0, "in_features ", K, " is not a multiple of 32");
  auto has_high = [&](size_t i) { return !highs.empty() && highs[i].numel() > 0; };
  const int64_t nb = K / QK;
  std::vector<Weights> out;
  for (size_t i = 0; i < qs.size(); ++i) {
    const bool q4 = qs[i].scalar_type() == at::kByte;
    const at::ScalarType lane_type = scales[i].scalar_type();
    const bool q6 = q4 && lane_type == at::kChar, two = lane_type == at::kByte;
    const bool iq4 = q4 && !q6 && has_high(i) && highs[i].scalar_type() == at::kChar;  // high: its int8 table
    const bool q5 = has_high(i) && !q6 && !iq4;
    const int64_t groups = (rows[i] + RG - 1) / RG;
    TORCH_CHECK(q4 || qs[i].scalar_type() == at::kChar, "qs must be int8 (q8) or uint8 (q4)");
    TORCH_CHECK(rows[i] > 0 && qs[i].dim() == 2 && qs[i].is_contiguous() && qs[i].size(0) == groups &&
                qs[i].size(1) == nb * (q4 ? 128 : 256), "qs shape");
    const c10::Half* scale_d = nullptr;
    const c10::Half* offset_d = nullptr;
    auto supers_of = [&](int64_t planes) {
      TORCH_CHECK(!supers.empty() && supers[i].scalar_type() == at::kHalf && supers[i].is_contiguous() &&
                  supers[i].numel() == planes * groups * nb && nb % 8 == 0,
                  "two-level and q6 lanes need supers fp16 [", planes, ", ceil(rows/8), K/32], K a multiple of 256");
      return static_cast<const c10::Half*>(supers[i].data_ptr());
    };
    if (q6) {
      TORCH_CHECK(scales[i].is_contiguous() && scales[i].numel() == groups * nb * 2 * RG,
                  "q6 scale must be int8 [ceil(rows/8), K/32 * 16]");
      TORCH_CHECK(has_high(i) && highs[i].scalar_type() == at::kByte && highs[i].is_contiguous() &&
                  highs[i].numel() == groups * nb * 64, "q6 high must be uint8 [ceil(rows/8), K/32 * 64]");
      scale_d = supers_of(1);
    } else {
      TORCH_CHECK((lane_type == at::kFloat || lane_type == at::kHalf || two) && scales[i].is_contiguous() &&
                  scales[i].numel() == groups * nb * RG,
                  "scale must be float32, fp16 or uint8 (two-level) [ceil(rows/8), K/32 * 8]");
      // q5's offset lanes are optional (Q5_0: implied -16 * scale); q4's and two-level lanes' are not; iq4 has none.
      TORCH_CHECK(!iq4 || (!two && offsets[i].numel() == 0 && highs[i].numel() == 16 && highs[i].is_contiguous()),
                  "iq4 takes a 16-entry int8 table as its high and no offset");
      TORCH_CHECK(!q4 || iq4 || (q5 && !two && offsets[i].numel() == 0) ||
                  (offsets[i].scalar_type() == lane_type && offsets[i].is_contiguous() &&
                   offsets[i].numel() == groups * nb * RG), "offset must be [ceil(rows/8), K/32 * 8] of scale's dtype");
      TORCH_CHECK(!q5 || (q4 && highs[i].scalar_type() == at::kByte && highs[i].is_contiguous() &&
                          highs[i].numel() == groups * nb * 32), "high must be uint8 [ceil(rows/8), K/32 * 32] (q5)");
      if (two) {
        TORCH_CHECK(q4, "two-level (uint8) lanes are for q4 and q5");
        scale_d = supers_of(2);
        offset_d = scale_d + groups * nb;
      } else {
        TORCH_CHECK(supers.empty() || supers[i].numel() == 0, "super lanes go with uint8 (two-level) or q6 lanes only");
      }
    }
    out.push_back(Weights{static_cast<const uint8_t*>(qs[i].data_ptr()), Lanes{scales[i].data_ptr(), scale_d},
                          Lanes{q4 && !q6 && offsets[i].numel() ? offsets[i].data_ptr() : nullptr, offset_d},
                          q5 || q6 || iq4 ? static_cast<const uint8_t*>(highs[i].data_ptr()) : nullptr, nb, rows[i],
                          q4, lane_type == at::kHalf, q5, two, q6, iq4});
  }
  return out;
}

// y [M, ld] (the first sum rows_i columns written) = x [M, K] times the concatenated matrices `ws`.
// passes: activation rounding passes (2: the 15-bit rounding, 1: plain int8). amx_rows / bf16_rows:
// the amx path's thresholds (amx_min_rows(), amx_bf16_rows()) for this call where >= 0 (bf16_rows 0:
// never), so tests reach every tile kind at any M.
void quant_linear_into(const float* x, int64_t M, int64_t K, const std::vector<Weights>& ws, int64_t passes,
                       int64_t isa, int64_t amx_rows, int64_t bf16_rows, float* y, int64_t ld,
                       int64_t duo_rows = -1) {
  if (duo_rows < 0) duo_rows = duo_tiles() ? kDuoRows + 1 : 0;
  if (amx_rows < 0) amx_rows = amx_min_rows();
  if (amx_rows == 0) amx_rows = 1;
  if (bf16_rows < 0) bf16_rows = amx_bf16_rows();
  if (M == 0) return;
  const int64_t nb = K / QK;
  // The quantized activations live in a per-thread scratch buffer, grown as needed: three tensor
  // allocations a call were ~1 us each against a few us of work for a batch-1 matrix.
  // Mp rows of d, s and the int8 passes: the AMX tiles read whole 16-row tiles (rows past M are
  // computed from whatever the padding holds and never stored).
  thread_local std::vector<float> scratch;
  const int64_t Mp = M + 16;
  const size_t floats = 2 * Mp * nb + (Mp * passes * K + 3) / 4 + (M * K + 1) / 2 + 32;
  if (scratch.size() < floats) scratch.resize(floats);
  float* d = scratch.data();
  float* s = d + Mp * nb;
  int8_t* qa = reinterpret_cast<int8_t*>(s + Mp * nb);
  // int16 activations 32-byte aligned after the int8 passes (the tiles load them as pairs).
  auto a_at = reinterpret_cast<std::uintptr_t>(qa + Mp * passes * K);
  int16_t* a16 = reinterpret_cast<int16_t*>((a_at + 31) & ~static_cast<std::uintptr_t>(31));
#ifdef TM_X86
  if (isa == AMX && bf16_rows > 0 && M >= bf16_rows && amx_bf16_usable() &&
      std::none_of(ws.begin(), ws.end(), [](const Weights& w) { return w.q6 || w.iq4; })) {  // q6, iq4: no bf16 tiles
    // bf16 activations (16 rows of padding: the tiles read whole 16-row tiles) and bf16 tiles.
    uint16_t* xb = reinterpret_cast<uint16_t*>(d);
    const size_t need = ((M + 16) * K + 1) / 2 + 16;
    if (scratch.size() < need) { scratch.resize(need); xb = reinterpret_cast<uint16_t*>(scratch.data()); }
    amxbf::to_bf16(x, M, K, xb);
    int64_t col = 0;
    for (const Weights& w : ws) {
      amxbf::linear(w, xb, M, y + col, ld);
      col += w.rows;
    }
    return;
  }
#endif
  quantize_activations(x, M, K, passes, qa, d, s, isa, a16);
  const Act act{a16, d, s, K, nb, qa, passes};
  int64_t col = 0;
  for (const Weights& w : ws) {
    run_groups(w, act, M, y + col, ld, isa, amx_rows, duo_rows);
    col += w.rows;
  }
}

int64_t total_rows(const std::vector<Weights>& ws) {
  int64_t total = 0;
  for (const Weights& w : ws) total += w.rows;
  return total;
}

// The work of a call for ReleaseGilIfLong: the weights it streams, or its multiply-adds / 16.
int64_t call_work(int64_t M, int64_t K, int64_t N) { return std::max(K * N, M * K * N / 16); }

// y [M, sum rows_i] = x [M, K] (float32, contiguous) times the matrices of checked_weights.
at::Tensor quant_linear(const at::Tensor& x, const std::vector<at::Tensor>& qs, const std::vector<at::Tensor>& scales,
                        const std::vector<at::Tensor>& offsets, const std::vector<int64_t>& rows, int64_t passes,
                        int64_t isa, const std::vector<at::Tensor>& highs, int64_t amx_rows = -1,
                        int64_t bf16_rows = -1, int64_t duo_rows = -1, const std::vector<at::Tensor>& supers = {}) {
  check_isa(isa, passes);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  const std::vector<Weights> ws = checked_weights(qs, scales, offsets, rows, highs, x.size(1), supers);
  const int64_t total = total_rows(ws);
  at::Tensor out = at::empty({x.size(0), total}, x.options());
  const tokenmill_capi::ReleaseGilIfLong gil(call_work(x.size(0), x.size(1), total));  // called from Python only
  quant_linear_into(x.data_ptr<float>(), x.size(0), x.size(1), ws, passes, isa, amx_rows, bf16_rows,
                    out.data_ptr<float>(), total, duo_rows);
  return out;
}

// The activation quantization alone (tests hold a float reference to exactly this rounding):
// qa [M, K / 32, passes, 32] int8, d and s [M, K / 32].
std::vector<at::Tensor> quantize_activations_op(const at::Tensor& x, int64_t passes, int64_t isa) {
  check_isa(isa, passes);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % QK == 0,
              "x must be contiguous float32 [M, 32k]");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor qa = at::empty({M, K / QK, passes, QK}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / QK}, x.options());
  at::Tensor s = at::empty({M, K / QK}, x.options());
  quantize_activations(x.data_ptr<float>(), M, K, passes, qa.data_ptr<int8_t>(), d.data_ptr<float>(),
                       s.data_ptr<float>(), isa);
  return {qa, d, s};
}

// One linear layer's kernel arguments bound once (layers/linear.py's QuantLinear holds one): the
// call is x → y in C++ (any leading shape, a dtype other than float32 converted in, the bias added),
// where the Python wrapper's reshapes, checks and list conversions cost ~9 us a call, more than
// the kernel itself for a batch-1 matrix of SmolLM2 (121 calls a step).
struct QuantPlan {
  std::vector<at::Tensor> qs, scales, offsets;  // kept alive: `ws` points into them
  std::vector<at::Tensor> highs, supers;
  std::vector<Weights> ws;  // checked once, at construction
  int64_t K, N, passes, isa;
  c10::optional<at::Tensor> bias;
  int64_t bf16_rows;  // quant_linear's: -1 the CPU's default, 0 never (integer tiles at every M)

  // y [M, N] = x [M, K] W^T (+ bias), both contiguous float32: the decoder stack's call, into its buffer.
  void forward_into(const at::Tensor& x, at::Tensor& y) const {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == K,
                "x must be contiguous float32 [M, ", K, "]");
    TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.is_contiguous() && y.size(0) == x.size(0) &&
                y.size(1) == N, "out must be contiguous float32 [M, ", N, "]");
    quant_linear_into(x.data_ptr<float>(), x.size(0), K, ws, passes, isa, -1, bf16_rows, y.data_ptr<float>(), N);
    if (bias.has_value()) y.add_(*bias);
  }

  at::Tensor forward(const at::Tensor& x) const {
    TORCH_CHECK(x.dim() >= 1, "x must have a feature dimension");
    at::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
    if (x2.scalar_type() != at::kFloat) x2 = x2.to(at::kFloat);
    x2 = x2.contiguous();
    at::Tensor y = at::empty({x2.size(0), N}, x2.options());
    forward_into(x2, y);
    if (x.dim() == 2) return y;
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = N;
    return y.view(sizes);
  }
};

void plan_forward_out(const void* plan, const at::Tensor& x, at::Tensor& out) {
  static_cast<const QuantPlan*>(plan)->forward_into(x, out);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<QuantPlan>(m, "QuantPlan")
      .def(pybind11::init([](std::vector<at::Tensor> qs, std::vector<at::Tensor> scales,
                             std::vector<at::Tensor> offsets, std::vector<int64_t> rows, int64_t passes, int64_t isa,
                             c10::optional<at::Tensor> bias, std::vector<at::Tensor> highs, int64_t bf16_rows,
                             std::vector<at::Tensor> supers) {
             check_isa(isa, passes);
             TORCH_CHECK(!qs.empty() && qs[0].dim() == 2, "a plan needs its matrices");
             // qs [groups, nb * (128 or 256)]: K = nb * 32 either way.
             const int64_t K = qs[0].size(1) / (qs[0].scalar_type() == at::kByte ? 128 : 256) * QK;
             std::vector<Weights> ws = checked_weights(qs, scales, offsets, rows, highs, K, supers);
             const int64_t N = total_rows(ws);
             TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                               bias->numel() == N), "bias must be contiguous float32 [N]");
             return QuantPlan{std::move(qs), std::move(scales), std::move(offsets), std::move(highs), std::move(supers),
                              std::move(ws),
                              K, N, passes, isa, std::move(bias), bf16_rows};
           }), pybind11::arg("qs"), pybind11::arg("scales"), pybind11::arg("offsets"), pybind11::arg("rows"),
           pybind11::arg("passes"), pybind11::arg("isa"), pybind11::arg("bias"),
           pybind11::arg("highs") = std::vector<at::Tensor>{}, pybind11::arg("bf16_rows") = -1,
           pybind11::arg("supers") = std::vector<at::Tensor>{})
      .def("__call__", [](const QuantPlan& plan, const at::Tensor& x) {
             const tokenmill_capi::ReleaseGilIfLong gil(call_work(x.numel() / std::max<int64_t>(1, plan.K), plan.K,
                                                                  plan.N));
             return plan.forward(x);
           }, pybind11::arg("x"), "y = x W^T (+ bias) over x's last dimension (float32 out)")
      .def_property_readonly("in_features", [](const QuantPlan& plan) { return plan.K; })
      .def_property_readonly("out_features", [](const QuantPlan& plan) { return plan.N; })
      .def("handle", [](const QuantPlan& plan) {
        return pybind11::capsule(static_cast<const void*>(&plan), tokenmill_capi::kPlanCapsule);
      }, "this plan for c_api's plan_forward_out (valid while the plan lives)");
  m.def("c_api", [] {
    pybind11::dict api;
    TM_CAPI_ENTRY(api, PlanForwardOut, plan_forward_out);
    return api;
  }, "the entry points as C function pointers (c_api.h), for stack_kernels.cpp");
  m.def("quant_linear", &quant_linear, "y = x W^T for interleaved q8/q4/q5/q6/iq4 block-quantized W, int16 activations (CPU)",
        pybind11::arg("x"), pybind11::arg("qs"), pybind11::arg("scales"), pybind11::arg("offsets"), pybind11::arg("rows"),
        pybind11::arg("passes"), pybind11::arg("isa"), pybind11::arg("highs") = std::vector<at::Tensor>{},
        pybind11::arg("amx_rows") = -1, pybind11::arg("bf16_rows") = -1, pybind11::arg("duo_rows") = -1,
        pybind11::arg("supers") = std::vector<at::Tensor>{});
  m.def("quantize_activations", &quantize_activations_op, "int8 blocks of 32 per row, 1 or 2 passes: (qa, scale, sum)");
  m.def("duo_tiles", &duo_tiles, "whether the avx512vnni path runs its duo tiles for 1-8 activation rows");
  m.def("wide_min_rows", &wide_min_rows, "least activation rows the avx512vnni path runs 512-bit tiles for");
  m.def("amx_bf16_rows", &amx_bf16_rows, "least activation rows the amx path runs bf16 tiles for (0: never)");
  m.def("amx_min_rows", &amx_min_rows, "least activation rows the amx path runs AMX tiles for");
  m.def("cpu_isas", &cpu_isas, "quant ISAs this CPU runs: 0 portable, 1 avx2, 2 avx512vnni, 3 amx");
}
