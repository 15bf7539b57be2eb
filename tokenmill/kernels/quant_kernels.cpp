// Quantized linear layers with integer dot products (built by tokenmill/kernels/__init__.py).
//
// Weights (see tokenmill/layers/quant_formats.py for how GGUF blocks land here), row-major,
// K = 32 * nb, one block = 32 consecutive weights of one output row:
//   q8: qs int8  [N, K]       w = scale[n, b] * q                      (q in [-127, 127])
//   q4: qs uint8 [N, K / 2]   w = scale[n, b] * q + offset[n, b]        (q in [0, 15]); the 16 bytes
//       of block b hold weight j in the low nibble of byte j and weight j + 16 in its high nibble.
// Activations: each row of x is quantized once per call to int8 blocks of 32. With P = 2 passes (the
// default) a block is two int8 vectors, the first rounding and its residual at a 254x finer step:
//   d1 = max|x| / 127,  q1 = round(x / d1),  q2 = round((x - d1 q1) * 254 / d1) in [-127, 127]
//   x ~ d (254 q1 + q2),  d = d1 / 254          (a 15-bit activation, error <= d1 / 508)
// so both passes multiply the same loaded weight block and their integer sums combine exactly in
// int32 (254 * dot1 + dot2 <= 32 * 127 * 127 * 255 < 2^31) before one float conversion. P = 1 is the
// plain int8 rounding (q2 = 0, d = d1). The block sum s = d * sum_j (254 q1 + q2)_j is the offset
// term's, so the result is exactly (rounded x) . (dequantized W) up to float summation order. (The
// sum of the rounded activations, not of x: with q4's uncentred q in [0, 15] the rounding errors
// then cancel against the offset instead of being scaled by ~8x the centred weight.)
//   y[m, n] = sum_b scale[n,b] * d[m,b] * sum_j q[n,b,j] qa[m,b,j]  +  sum_b offset[n,b] * s[m,b]
// The inner sum is exact integer math: u8 x s8 pairs through maddubs + madd (AVX2), vpdpbusd
// (AVX-512 VNNI), or plain int loops (portable). q8 weights are signed: |w| x (a * sign(w)), the
// usual trick that makes a signed x signed product fit the unsigned x signed instruction.
//
// One object runs on every x86-64 CPU: it is compiled for the baseline ISA and each fast path
// carries its own target attribute; the caller picks the path (cpu_isas() says what this CPU has).
// Work: threads split the output rows; within a thread, rows are taken in cache-sized chunks and
// each loaded weight block is reused for up to 4 activation rows (register tile 1 x RM).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define TM_X86 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t QK = 32;  // weights per block
enum Isa : int64_t { PORTABLE = 0, AVX2 = 1, AVX512VNNI = 2 };

struct Act {  // quantized activations: qa [M, nb, P, 32] int8 (P = passes), d/s [M, nb] float
  const int8_t* qa;
  const float* d;
  const float* s;
  int64_t K, nb;
  // The P int8 vectors of block b of row m, back to back (pass 1 at +0, pass 2 at +32).
  template <int P>
  const int8_t* block(int64_t m, int64_t b) const { return qa + (m * nb + b) * (P * QK); }
};

constexpr float kFine = 254.f;  // pass 2's step is 1/254 of pass 1's

struct Weights {
  const uint8_t* qs;       // q8: int8 bytes; q4: packed nibbles
  const float* scale;      // [N, nb]
  const float* offset;     // [N, nb] (q4) or nullptr (q8)
  int64_t row_bytes, nb;
  bool q4;
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

// ---- portable kernels ------------------------------------------------------------------------

// y for one weight row n and one activation row m (int dot per block, then the float terms).
template <int P>
float row_dot_portable(const Weights& w, int64_t n, const Act& a, int64_t m) {
  const uint8_t* row = w.qs + n * w.row_bytes;
  const float* sc = w.scale + n * w.nb;
  const float* da = a.d + m * a.nb;
  float acc = 0.f;
  for (int64_t b = 0; b < w.nb; ++b) {
    const int8_t* ab = a.block<P>(m, b);
    int32_t isum[P] = {};
    for (int p = 0; p < P; ++p) {
      const int8_t* ap = ab + p * QK;
      if (w.q4) {
        const uint8_t* wb = row + b * (QK / 2);
        for (int j = 0; j < QK / 2; ++j)
          isum[p] += static_cast<int32_t>(wb[j] & 0x0F) * ap[j] + static_cast<int32_t>(wb[j] >> 4) * ap[j + QK / 2];
      } else {
        const int8_t* wb = reinterpret_cast<const int8_t*>(row) + b * QK;
        for (int j = 0; j < QK; ++j) isum[p] += static_cast<int32_t>(wb[j]) * ap[j];
      }
    }
    const int32_t total = P == 2 ? static_cast<int32_t>(kFine) * isum[0] + isum[P - 1] : isum[0];
    acc += sc[b] * da[b] * static_cast<float>(total);
  }
  if (w.q4) {
    const float* off = w.offset + n * w.nb;
    const float* sa = a.s + m * a.nb;
    float o = 0.f;
    for (int64_t b = 0; b < w.nb; ++b) o += off[b] * sa[b];
    acc += o;
  }
  return acc;
}

template <int P>
void rows_portable(const Weights& w, const Act& a, int64_t M, int64_t n0, int64_t n1, float* out, int64_t ld) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) out[m * ld + n] = row_dot_portable<P>(w, n, a, m);
}

#ifdef TM_X86

// ---- shared SIMD tile code, stamped out once per ISA --------------------------------------------
// Each ISA namespace defines, under its own target pragma:
//   dot_u8s8(u, s): 8 int32 lanes, each the sum of 4 adjacent u8 x s8 products
// and the macro below builds the tiles from it, so the two fast paths share one body.

#define TM_SIMD_TILES                                                                                            \
inline float hsum(__m256 v) {                                                                                          \
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));                                       \
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));                                                                              \
  x = _mm_add_ss(x, _mm_movehdup_ps(x));                                                                               \
  return _mm_cvtss_f32(x);                                                                                             \
}                                                                                                                      \
/* sum_b off[b] * s[b]: the offset (min) term of a q4 row against one activation row. */                               \
inline float dot_f32(const float* off, const float* s, int64_t nb) {                                                   \
  __m256 acc = _mm256_setzero_ps();                                                                                    \
  int64_t b = 0;                                                                                                       \
  for (; b + 8 <= nb; b += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(off + b), _mm256_loadu_ps(s + b), acc);            \
  float r = hsum(acc);                                                                                                 \
  for (; b < nb; ++b) r += off[b] * s[b];                                                                              \
  return r;                                                                                                            \
}                                                                                                                      \
/* Sums of 8 int32x8 vectors, one lane per vector: [sum d0, sum d1, ..., sum d7]. */                                   \
inline __m256i reduce8(const __m256i* d) {                                                                             \
  const __m256i h01 = _mm256_hadd_epi32(d[0], d[1]), h23 = _mm256_hadd_epi32(d[2], d[3]);                              \
  const __m256i h45 = _mm256_hadd_epi32(d[4], d[5]), h67 = _mm256_hadd_epi32(d[6], d[7]);                              \
  const __m256i lo = _mm256_hadd_epi32(h01, h23), hi = _mm256_hadd_epi32(h45, h67);                                    \
  return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));           \
}                                                                                                                      \
/* Block b of a row as the unsigned operand (q4: the nibbles; q8: |q|) and, for q8, its signs. */                      \
template <bool Q4>                                                                                                     \
inline void load_block(const uint8_t* row, int64_t b, __m256i& u, __m256i& sign) {                                     \
  if (Q4) {                                                                                                            \
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * (QK / 2)));                         \
    u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));                       \
  } else {                                                                                                             \
    sign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * QK));                                         \
    u = _mm256_sign_epi8(sign, sign);                                                                                  \
  }                                                                                                                    \
}                                                                                                                      \
/* One weight block (u, sign) against one activation block's P passes: 8 int32 lanes whose sum is                      \
   the block's integer dot (P = 2: 254 dot1 + dot2). The weight registers serve both passes. */                        \
template <bool Q4, int P>                                                                                              \
inline __m256i block_dot(__m256i u, __m256i sign, const int8_t* qa) {                                                  \
  __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa));                                               \
  if (!Q4) a1 = _mm256_sign_epi8(a1, sign);                                                                            \
  if (P == 1) return dot_u8s8(u, a1);                                                                                  \
  __m256i a2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa + QK));                                          \
  if (!Q4) a2 = _mm256_sign_epi8(a2, sign);                                                                            \
  return dot2_u8s8(u, a1, a2);                                                                                         \
}                                                                                                                      \
/* One weight row n against activation rows m0..m0+RM-1. Blocks go 8 at a time: 8 integer block                        \
   dots are reduced to one vector of 8 block sums, converted once and scaled by the 8 (weight scale                    \
   x activation scale) products in one multiply, so the float work is per 8 blocks, not per block. */                  \
template <int RM, bool Q4, int P>                                                                                      \
void tile(const Weights& w, int64_t n, const Act& a, int64_t m0, float* out, int64_t ld) {                             \
  const uint8_t* row = w.qs + n * w.row_bytes;                                                                         \
  const float* sc = w.scale + n * w.nb;                                                                                \
  __m256 acc[RM];                                                                                                      \
  float tail[RM];                                                                                                      \
  for (int r = 0; r < RM; ++r) { acc[r] = _mm256_setzero_ps(); tail[r] = 0.f; }                                        \
  int64_t b = 0;                                                                                                       \
  for (; b + 8 <= w.nb; b += 8) {                                                                                      \
    __m256i u[8], sign[8];                                                                                             \
    for (int j = 0; j < 8; ++j) load_block<Q4>(row, b + j, u[j], sign[j]);                                             \
    const __m256 sw = _mm256_loadu_ps(sc + b);                                                                         \
    for (int r = 0; r < RM; ++r) {                                                                                     \
      const int8_t* qa = a.block<P>(m0 + r, b);                                                                        \
      __m256i d[8];                                                                                                    \
      for (int j = 0; j < 8; ++j) d[j] = block_dot<Q4, P>(u[j], sign[j], qa + j * P * QK);                             \
      const __m256 scale = _mm256_mul_ps(sw, _mm256_loadu_ps(a.d + (m0 + r) * a.nb + b));                              \
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(d)), scale, acc[r]);                                         \
    }                                                                                                                  \
  }                                                                                                                    \
  for (; b < w.nb; ++b) {                                                                                              \
    __m256i u, sign;                                                                                                   \
    load_block<Q4>(row, b, u, sign);                                                                                   \
    for (int r = 0; r < RM; ++r) {                                                                                     \
      const float isum = hsum(_mm256_cvtepi32_ps(block_dot<Q4, P>(u, sign, a.block<P>(m0 + r, b))));                   \
      tail[r] += sc[b] * a.d[(m0 + r) * a.nb + b] * isum;                                                              \
    }                                                                                                                  \
  }                                                                                                                    \
  for (int r = 0; r < RM; ++r) {                                                                                       \
    float y = hsum(acc[r]) + tail[r];                                                                                  \
    if (Q4) y += dot_f32(w.offset + n * w.nb, a.s + (m0 + r) * a.nb, w.nb);                                            \
    out[(m0 + r) * ld + n] = y;                                                                                        \
  }                                                                                                                    \
}                                                                                                                      \
template <int RM, int P>                                                                                               \
void tile(const Weights& w, int64_t n, const Act& a, int64_t m0, float* out, int64_t ld) {                             \
  if (w.q4) tile<RM, true, P>(w, n, a, m0, out, ld); else tile<RM, false, P>(w, n, a, m0, out, ld);                    \
}                                                                                                                      \
template <int P>                                                                                                       \
void rows(const Weights& w, const Act& a, int64_t M, int64_t n0, int64_t n1, float* out, int64_t ld) {                 \
  /* Rows in chunks of ~128 KiB of weights, so a chunk stays in L2 while every m-tile passes over it. */               \
  const int64_t chunk = std::max<int64_t>(1, (128 << 10) / std::max<int64_t>(1, w.row_bytes));                         \
  for (int64_t c0 = n0; c0 < n1; c0 += chunk) {                                                                        \
    const int64_t c1 = std::min(n1, c0 + chunk);                                                                       \
    int64_t m0 = 0;                                                                                                    \
    for (; m0 + 4 <= M; m0 += 4) for (int64_t n = c0; n < c1; ++n) tile<4, P>(w, n, a, m0, out, ld);                   \
    const int64_t rest = M - m0;                                                                                       \
    for (int64_t n = c0; n < c1; ++n) {                                                                                \
      if (rest == 3) tile<3, P>(w, n, a, m0, out, ld);                                                                 \
      else if (rest == 2) tile<2, P>(w, n, a, m0, out, ld);                                                            \
      else if (rest == 1) tile<1, P>(w, n, a, m0, out, ld);                                                            \
    }                                                                                                                  \
  }                                                                                                                    \
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
// 254 u.s1 + u.s2: the first pass's int16 pair sums (|.| <= 2 * 127 * 127) weighted by 254 in the madd.
inline __m256i dot2_u8s8(__m256i u, __m256i s1, __m256i s2) {
  return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s1), _mm256_set1_epi16(254)),
                          _mm256_madd_epi16(_mm256_maddubs_epi16(u, s2), _mm256_set1_epi16(1)));
}
TM_SIMD_TILES

// Activation rows: amax, exact integer sums and nearest-even rounding (the portable path's steps).
inline __m256i pack8(const __m256i* q) {
  // int32 → int16 → int8 packs work per 128-bit lane; the permute restores element order.
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline __m256 round_even(__m256 v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

void quantize_rows(const float* x, int64_t M, int64_t K, int64_t P, int8_t* qa, float* d, float* s) {
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

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace vnni {
inline __m256i dot_u8s8(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
inline __m256i dot2_u8s8(__m256i u, __m256i s1, __m256i s2) {
  const __m256i t = dot_u8s8(u, s1);  // 254 t = (t << 8) - (t << 1), then pass 2 accumulates on top
  return _mm256_dpbusd_epi32(_mm256_sub_epi32(_mm256_slli_epi32(t, 8), _mm256_slli_epi32(t, 1)), u, s2);
}
TM_SIMD_TILES
}  // namespace vnni
#pragma GCC pop_options

#endif  // TM_X86

bool isa_available(int64_t isa) {
  if (isa == PORTABLE) return true;
#ifdef TM_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == AVX2) return avx2;
  if (isa == AVX512VNNI)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
  return false;
}

std::vector<int64_t> cpu_isas() {
  std::vector<int64_t> out;
  for (int64_t isa : {PORTABLE, AVX2, AVX512VNNI})
    if (isa_available(isa)) out.push_back(isa);
  return out;
}

void quantize_activations(const float* x, int64_t M, int64_t K, int64_t P, int8_t* qa, float* d, float* s,
                          int64_t isa) {
  // Rows are independent; split them over threads only when there are enough to pay for it.
  const int64_t nb = K / QK;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
#ifdef TM_X86
    if (isa != PORTABLE) {
      avx2::quantize_rows(x + m0 * K, m1 - m0, K, P, qa + m0 * nb * P * QK, d + m0 * nb, s + m0 * nb);
      return;
    }
#endif
    quantize_rows_portable(x + m0 * K, m1 - m0, K, P, qa + m0 * nb * P * QK, d + m0 * nb, s + m0 * nb);
  });
}

template <int P>
void run_rows(const Weights& w, const Act& a, int64_t M, int64_t N, float* out, int64_t ld, int64_t isa) {
  // Grain: enough rows per task that each thread streams a long run of the weight matrix.
  const int64_t grain = std::max<int64_t>(8, (64 << 10) / std::max<int64_t>(1, w.row_bytes * std::max<int64_t>(1, M / 4)));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
#ifdef TM_X86
    if (isa == AVX512VNNI) return vnni::rows<P>(w, a, M, n0, n1, out, ld);
    if (isa == AVX2) return avx2::rows<P>(w, a, M, n0, n1, out, ld);
#endif
    rows_portable<P>(w, a, M, n0, n1, out, ld);
  });
}

void check_isa(int64_t isa, int64_t passes) {
  TORCH_CHECK(isa >= PORTABLE && isa <= AVX512VNNI, "unknown quant ISA ", isa);
  TORCH_CHECK(isa_available(isa), "this CPU cannot run quant ISA ", isa);
  TORCH_CHECK(passes == 1 || passes == 2, "activation passes must be 1 or 2, not ", passes);
}

// y [M, sum N_i] = x [M, K] times the concatenated quantized matrices (qs_i, scale_i, offset_i).
// qs int8 → q8 (offset ignored: pass an empty tensor), uint8 → q4. x: float32, contiguous.
// passes: activation rounding passes (2: the 15-bit two-vector rounding, 1: plain int8).
at::Tensor quant_linear(const at::Tensor& x, const std::vector<at::Tensor>& qs, const std::vector<at::Tensor>& scales,
                        const std::vector<at::Tensor>& offsets, int64_t passes, int64_t isa) {
  check_isa(isa, passes);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  TORCH_CHECK(qs.size() == scales.size() && qs.size() == offsets.size() && !qs.empty(), "one scale/offset per matrix");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % QK == 0, "in_features ", K, " is not a multiple of 32");
  const int64_t nb = K / QK;
  int64_t total = 0;
  for (size_t i = 0; i < qs.size(); ++i) {
    const bool q4 = qs[i].scalar_type() == at::kByte;
    TORCH_CHECK(q4 || qs[i].scalar_type() == at::kChar, "qs must be int8 (q8) or uint8 (q4)");
    TORCH_CHECK(qs[i].dim() == 2 && qs[i].is_contiguous() && qs[i].size(1) == (q4 ? K / 2 : K), "qs shape");
    TORCH_CHECK(scales[i].scalar_type() == at::kFloat && scales[i].is_contiguous() &&
                scales[i].numel() == qs[i].size(0) * nb, "scale must be float32 [N, K/32]");
    TORCH_CHECK(!q4 || (offsets[i].scalar_type() == at::kFloat && offsets[i].is_contiguous() &&
                        offsets[i].numel() == qs[i].size(0) * nb), "offset must be float32 [N, K/32]");
    total += qs[i].size(0);
  }
  at::Tensor out = at::empty({M, total}, x.options());
  if (M == 0 || total == 0) return out;
  at::Tensor qa = at::empty({M, passes * K}, x.options().dtype(at::kChar));
  at::Tensor ds = at::empty({2, M, nb}, x.options());
  float* d = ds.data_ptr<float>();
  float* s = d + M * nb;
  quantize_activations(x.data_ptr<float>(), M, K, passes, qa.data_ptr<int8_t>(), d, s, isa);
  const Act act{qa.data_ptr<int8_t>(), d, s, K, nb};
  int64_t col = 0;
  for (size_t i = 0; i < qs.size(); ++i) {
    const bool q4 = qs[i].scalar_type() == at::kByte;
    const Weights w{static_cast<const uint8_t*>(qs[i].data_ptr()), scales[i].data_ptr<float>(),
                    q4 ? offsets[i].data_ptr<float>() : nullptr, q4 ? K / 2 : K, nb, q4};
    if (passes == 2) run_rows<2>(w, act, M, qs[i].size(0), out.data_ptr<float>() + col, total, isa);
    else run_rows<1>(w, act, M, qs[i].size(0), out.data_ptr<float>() + col, total, isa);
    col += qs[i].size(0);
  }
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, "y = x W^T for q8/q4 block-quantized W, int8 activations (CPU)");
  m.def("quantize_activations", &quantize_activations_op, "int8 blocks of 32 per row, 1 or 2 passes: (qa, scale, sum)");
  m.def("cpu_isas", &cpu_isas, "quant ISAs this CPU runs: 0 portable, 1 avx2, 2 avx512vnni");
}
