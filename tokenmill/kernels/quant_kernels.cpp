// Quantized linear layers with integer dot products (built by tokenmill/kernels/__init__.py).
//
// Weights (see tokenmill/layers/quant_formats.py for how GGUF blocks land here), row-major,
// K = 32 * nb, one block = 32 consecutive weights of one output row:
//   q8: qs int8  [N, K]       w = scale[n, b] * q                      (q in [-127, 127])
//   q4: qs uint8 [N, K / 2]   w = scale[n, b] * q + offset[n, b]        (q in [0, 15]); the 16 bytes
//       of block b hold weight j in the low nibble of byte j and weight j + 16 in its high nibble.
// Activations: each row of x is quantized once per call to int8 blocks of 32 (a_j = d * qa_j,
// d = max|x| / 127) with the block's sum s = d * sum_j qa_j for the offset term, so the result is
// exactly (quantized x) . (dequantized W) up to float summation order. (The sum of the rounded
// activations, not of x: with q4's uncentred q in [0, 15] the rounding errors then cancel against
// the offset instead of being scaled by ~8x the centred weight.)
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

struct Act {  // quantized activations: qa [M, K] int8, d/s [M, nb] float
  const int8_t* qa;
  const float* d;
  const float* s;
  int64_t K, nb;
};

struct Weights {
  const uint8_t* qs;       // q8: int8 bytes; q4: packed nibbles
  const float* scale;      // [N, nb]
  const float* offset;     // [N, nb] (q4) or nullptr (q8)
  int64_t row_bytes, nb;
  bool q4;
};

// ---- activation quantization ---------------------------------------------------------------

void quantize_rows_portable(const float* x, int64_t M, int64_t K, int8_t* qa, float* d, float* s) {
  const int64_t nb = K / QK;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * QK;
      float amax = 0.f;
      for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float id = amax > 0.f ? 127.f / amax : 0.f;
      int32_t isum = 0;
      for (int j = 0; j < QK; ++j) {
        const int8_t q = static_cast<int8_t>(std::nearbyint(xb[j] * id));
        qa[m * K + b * QK + j] = q;
        isum += q;
      }
      d[m * nb + b] = amax / 127.f;
      s[m * nb + b] = d[m * nb + b] * static_cast<float>(isum);
    }
  }
}

// ---- portable kernels ------------------------------------------------------------------------

// y for one weight row n and one activation row m (int dot per block, then the float terms).
float row_dot_portable(const Weights& w, int64_t n, const Act& a, int64_t m) {
  const uint8_t* row = w.qs + n * w.row_bytes;
  const float* sc = w.scale + n * w.nb;
  const int8_t* qa = a.qa + m * a.K;
  const float* da = a.d + m * a.nb;
  float acc = 0.f;
  for (int64_t b = 0; b < w.nb; ++b) {
    int32_t isum = 0;
    const int8_t* ab = qa + b * QK;
    if (w.q4) {
      const uint8_t* wb = row + b * (QK / 2);
      for (int j = 0; j < QK / 2; ++j) {
        isum += static_cast<int32_t>(wb[j] & 0x0F) * ab[j] + static_cast<int32_t>(wb[j] >> 4) * ab[j + QK / 2];
      }
    } else {
      const int8_t* wb = reinterpret_cast<const int8_t*>(row) + b * QK;
      for (int j = 0; j < QK; ++j) isum += static_cast<int32_t>(wb[j]) * ab[j];
    }
    acc += sc[b] * da[b] * static_cast<float>(isum);
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

void rows_portable(const Weights& w, const Act& a, int64_t M, int64_t n0, int64_t n1, float* out, int64_t ld) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) out[m * ld + n] = row_dot_portable(w, n, a, m);
}

#ifdef TM_X86

// ---- shared SIMD tile code, stamped out once per ISA --------------------------------------------
// Each ISA namespace defines, under its own target pragma:
//   dot_u8s8(u, s): 8 int32 lanes, each the sum of 4 adjacent u8 x s8 products
// and the macro below builds the tiles from it, so the two fast paths share one body.

#define TM_SIMD_TILES                                                                                   \
  inline float hsum(__m256 v) {                                                                        \
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));                      \
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));                                                             \
    x = _mm_add_ss(x, _mm_movehdup_ps(x));                                                              \
    return _mm_cvtss_f32(x);                                                                            \
  }                                                                                                     \
  /* sum_b off[b] * s[b]: the offset (min) term of a q4 row against one activation row. */             \
  inline float dot_f32(const float* off, const float* s, int64_t nb) {                                  \
    __m256 acc = _mm256_setzero_ps();                                                                   \
    int64_t b = 0;                                                                                      \
    for (; b + 8 <= nb; b += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(off + b), _mm256_loadu_ps(s + b), acc); \
    float r = hsum(acc);                                                                                \
    for (; b < nb; ++b) r += off[b] * s[b];                                                             \
    return r;                                                                                           \
  }                                                                                                     \
  /* Sums of 8 int32x8 vectors, one lane per vector: [sum d0, sum d1, ..., sum d7]. */                  \
  inline __m256i reduce8(const __m256i* d) {                                                            \
    const __m256i h01 = _mm256_hadd_epi32(d[0], d[1]), h23 = _mm256_hadd_epi32(d[2], d[3]);             \
    const __m256i h45 = _mm256_hadd_epi32(d[4], d[5]), h67 = _mm256_hadd_epi32(d[6], d[7]);             \
    const __m256i lo = _mm256_hadd_epi32(h01, h23), hi = _mm256_hadd_epi32(h45, h67);                   \
    return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));\
  }                                                                                                     \
  /* Block b of a row as the unsigned operand (q4: the nibbles; q8: |q|) and, for q8, its signs. */     \
  template <bool Q4>                                                                                    \
  inline void load_block(const uint8_t* row, int64_t b, __m256i& u, __m256i& sign) {                    \
    if (Q4) {                                                                                           \
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * (QK / 2)));        \
      u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));      \
    } else {                                                                                            \
      sign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * QK));                        \
      u = _mm256_sign_epi8(sign, sign);                                                                 \
    }                                                                                                   \
  }                                                                                                     \
  template <bool Q4>                                                                                    \
  inline __m256i block_dot(__m256i u, __m256i sign, const int8_t* qa) {                                 \
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa));                         \
    return dot_u8s8(u, Q4 ? a : _mm256_sign_epi8(a, sign));                                             \
  }                                                                                                     \
  /* One weight row n against activation rows m0..m0+RM-1. Blocks go 8 at a time: 8 integer block       \
     dots are reduced to one vector of 8 block sums, converted once and scaled by the 8 (weight scale   \
     x activation scale) products in one multiply, so the float work is per 8 blocks, not per block. */ \
  template <int RM, bool Q4>                                                                            \
  void tile(const Weights& w, int64_t n, const Act& a, int64_t m0, float* out, int64_t ld) {            \
    const uint8_t* row = w.qs + n * w.row_bytes;                                                        \
    const float* sc = w.scale + n * w.nb;                                                               \
    __m256 acc[RM];                                                                                     \
    float tail[RM];                                                                                     \
    for (int r = 0; r < RM; ++r) { acc[r] = _mm256_setzero_ps(); tail[r] = 0.f; }                       \
    int64_t b = 0;                                                                                      \
    for (; b + 8 <= w.nb; b += 8) {                                                                     \
      __m256i u[8], sign[8];                                                                            \
      for (int j = 0; j < 8; ++j) load_block<Q4>(row, b + j, u[j], sign[j]);                            \
      const __m256 sw = _mm256_loadu_ps(sc + b);                                                        \
      for (int r = 0; r < RM; ++r) {                                                                    \
        const int8_t* qa = a.qa + (m0 + r) * a.K + b * QK;                                              \
        __m256i d[8];                                                                                   \
        for (int j = 0; j < 8; ++j) d[j] = block_dot<Q4>(u[j], sign[j], qa + j * QK);                   \
        const __m256 scale = _mm256_mul_ps(sw, _mm256_loadu_ps(a.d + (m0 + r) * a.nb + b));             \
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(d)), scale, acc[r]);                        \
      }                                                                                                 \
    }                                                                                                   \
    for (; b < w.nb; ++b) {                                                                             \
      __m256i u, sign;                                                                                  \
      load_block<Q4>(row, b, u, sign);                                                                  \
      for (int r = 0; r < RM; ++r) {                                                                    \
        const float isum = hsum(_mm256_cvtepi32_ps(block_dot<Q4>(u, sign, a.qa + (m0 + r) * a.K + b * QK)));\
        tail[r] += sc[b] * a.d[(m0 + r) * a.nb + b] * isum;                                             \
      }                                                                                                 \
    }                                                                                                   \
    for (int r = 0; r < RM; ++r) {                                                                      \
      float y = hsum(acc[r]) + tail[r];                                                                 \
      if (Q4) y += dot_f32(w.offset + n * w.nb, a.s + (m0 + r) * a.nb, w.nb);                           \
      out[(m0 + r) * ld + n] = y;                                                                       \
    }                                                                                                   \
  }                                                                                                     \
  template <int RM>                                                                                     \
  void tile(const Weights& w, int64_t n, const Act& a, int64_t m0, float* out, int64_t ld) {            \
    if (w.q4) tile<RM, true>(w, n, a, m0, out, ld); else tile<RM, false>(w, n, a, m0, out, ld);         \
  }                                                                                                     \
  void rows(const Weights& w, const Act& a, int64_t M, int64_t n0, int64_t n1, float* out, int64_t ld) {  \
    /* Rows in chunks of ~128 KiB of weights, so a chunk stays in L2 while every m-tile passes over it. */ \
    const int64_t chunk = std::max<int64_t>(1, (128 << 10) / std::max<int64_t>(1, w.row_bytes));       \
    for (int64_t c0 = n0; c0 < n1; c0 += chunk) {                                                       \
      const int64_t c1 = std::min(n1, c0 + chunk);                                                      \
      int64_t m0 = 0;                                                                                   \
      for (; m0 + 4 <= M; m0 += 4) for (int64_t n = c0; n < c1; ++n) tile<4>(w, n, a, m0, out, ld);     \
      const int64_t rest = M - m0;                                                                      \
      for (int64_t n = c0; n < c1; ++n) {                                                               \
        if (rest == 3) tile<3>(w, n, a, m0, out, ld);                                                   \
        else if (rest == 2) tile<2>(w, n, a, m0, out, ld);                                              \
        else if (rest == 1) tile<1>(w, n, a, m0, out, ld);                                              \
      }                                                                                                 \
    }                                                                                                   \
  }

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
TM_SIMD_TILES

// Activation rows: amax, exact float sum and nearest-even rounding (same as the portable path).
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* qa, float* d, float* s) {
  const int64_t nb = K / QK;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * QK;
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
      const __m256 vid = _mm256_set1_ps(id);
      __m256i q[4];
      for (int i = 0; i < 4; ++i)
        q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      // int32 → int16 → int8 packs work per 128-bit lane; the permute restores element order.
      const __m256i p01 = _mm256_packs_epi32(q[0], q[1]);
      const __m256i p23 = _mm256_packs_epi32(q[2], q[3]);
      __m256i p = _mm256_packs_epi16(p01, p23);
      p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qa + m * K + b * QK), p);
      const __m256i qsum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      d[m * nb + b] = amax / 127.f;
      s[m * nb + b] = d[m * nb + b] * hsum(_mm256_cvtepi32_ps(qsum));
    }
  }
}
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace vnni {
inline __m256i dot_u8s8(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
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

void quantize_activations(const float* x, int64_t M, int64_t K, int8_t* qa, float* d, float* s, int64_t isa) {
  // Rows are independent; split them over threads only when there are enough to pay for it.
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
#ifdef TM_X86
    if (isa != PORTABLE) {
      avx2::quantize_rows(x + m0 * K, m1 - m0, K, qa + m0 * K, d + m0 * (K / QK), s + m0 * (K / QK));
      return;
    }
#endif
    quantize_rows_portable(x + m0 * K, m1 - m0, K, qa + m0 * K, d + m0 * (K / QK), s + m0 * (K / QK));
  });
}

void run_rows(const Weights& w, const Act& a, int64_t M, int64_t N, float* out, int64_t ld, int64_t isa) {
  // Grain: enough rows per task that each thread streams a long run of the weight matrix.
  const int64_t grain = std::max<int64_t>(8, (64 << 10) / std::max<int64_t>(1, w.row_bytes * std::max<int64_t>(1, M / 4)));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
#ifdef TM_X86
    if (isa == AVX512VNNI) return vnni::rows(w, a, M, n0, n1, out, ld);
    if (isa == AVX2) return avx2::rows(w, a, M, n0, n1, out, ld);
#endif
    rows_portable(w, a, M, n0, n1, out, ld);
  });
}

void check_isa(int64_t isa) {
  TORCH_CHECK(isa >= PORTABLE && isa <= AVX512VNNI, "unknown quant ISA ", isa);
  TORCH_CHECK(isa_available(isa), "this CPU cannot run quant ISA ", isa);
}

// y [M, sum N_i] = x [M, K] times the concatenated quantized matrices (qs_i, scale_i, offset_i).
// qs int8 → q8 (offset ignored: pass an empty tensor), uint8 → q4. x: float32, contiguous.
at::Tensor quant_linear(const at::Tensor& x, const std::vector<at::Tensor>& qs, const std::vector<at::Tensor>& scales,
                        const std::vector<at::Tensor>& offsets, int64_t isa) {
  check_isa(isa);
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
  at::Tensor qa = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor ds = at::empty({2, M, nb}, x.options());
  float* d = ds.data_ptr<float>();
  float* s = d + M * nb;
  quantize_activations(x.data_ptr<float>(), M, K, qa.data_ptr<int8_t>(), d, s, isa);
  const Act act{qa.data_ptr<int8_t>(), d, s, K, nb};
  int64_t col = 0;
  for (size_t i = 0; i < qs.size(); ++i) {
    const bool q4 = qs[i].scalar_type() == at::kByte;
    const Weights w{static_cast<const uint8_t*>(qs[i].data_ptr()), scales[i].data_ptr<float>(),
                    q4 ? offsets[i].data_ptr<float>() : nullptr, q4 ? K / 2 : K, nb, q4};
    run_rows(w, act, M, qs[i].size(0), out.data_ptr<float>() + col, total, isa);
    col += qs[i].size(0);
  }
  return out;
}

// The activation quantization alone (tests hold a float reference to exactly this rounding).
std::vector<at::Tensor> quantize_activations_op(const at::Tensor& x, int64_t isa) {
  check_isa(isa);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % QK == 0,
              "x must be contiguous float32 [M, 32k]");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor qa = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / QK}, x.options());
  at::Tensor s = at::empty({M, K / QK}, x.options());
  quantize_activations(x.data_ptr<float>(), M, K, qa.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>(), isa);
  return {qa, d, s};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, "y = x W^T for q8/q4 block-quantized W, int8 activations (CPU)");
  m.def("quantize_activations", &quantize_activations_op, "int8 blocks of 32 per row: (qa, scale, sum)");
  m.def("cpu_isas", &cpu_isas, "quant ISAs this CPU runs: 0 portable, 1 avx2, 2 avx512vnni");
}
