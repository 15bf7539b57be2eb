// AVX-512 tiles of the paged decode attention (cpu_kernels.cpp includes this inside its anonymous
// namespace, after its AVX2 helpers; built only where -march=native has AVX-512F/BW/DQ).
//
// Why: with the 16 ymm registers of AVX2, a head group of more than 3 query heads (Qwen2.5's 7 per
// kv head) scores one key at a time, each key's 7 dot products ending in 7 horizontal sums, and the
// value pass spends two ymm FMAs per 16 dimensions. At 4,000 keys an 8-row speculative verification
// spent half its step there (perf, Zen 5). The 32 zmm registers hold 4 keys x 7 heads of accumulators,
// and one zmm FMA covers 16 dimensions.
//
// Exactness: every (head, key) score is one fixed sequence of operations: an FMA chain over the
// 16-lane slices of head_dim in order, then `sum4`'s reduction tree, whichever 4-key tile or position
// the key lands in (the last tile of a chunk repeats its last key in the unused places). Every
// (head, dimension) value sum runs over the keys in order. So a row's result depends only on its own
// keys and chunking (decode_chunk_len), never on the other rows of a step: a speculative verification
// row gives the same bits as the plain decode of that row would.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define TM_AVX512 1

namespace wide {

// Sixteen cache elements widened to fp32 lanes.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const c10::BFloat16* p) {  // bf16 is the upper half of an fp32
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <typename T>
constexpr bool kTyped = std::is_same_v<T, float> || std::is_same_v<T, int8_t> || std::is_same_v<T, c10::BFloat16> ||
                        std::is_same_v<T, c10::Half>;

// Whether the wide tiles take this cache type and head size.
template <typename T>
inline bool fits(int64_t head_dim) {
  return kTyped<T> && head_dim % 16 == 0;
}

// exp on 16 lanes: exp8's steps on cpu_kernels.cpp's cephes constants (the same value per lane).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(cephes::kMin)), _mm512_set1_ps(cephes::kMax));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(cephes::kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(cephes::kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(cephes::kLn2Lo), r);
  __m512 p = _mm512_set1_ps(cephes::kP[0]);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(cephes::kP[1]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(cephes::kP[2]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(cephes::kP[3]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(cephes::kP[4]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(cephes::kP[5]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// Softmax numerators in place: s_t <- exp(s_t - max_t s_t); returns their sum (and the max in *max_out,
// which a split sequence's merge needs). cpu_kernels.cpp's softmax_numerators in 16 lanes, the tail
// through masked loads.
inline float softmax_numerators(float* s, int64_t n, float* max_out = nullptr) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 vmax = ninf;
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + t));
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - t)) - 1);
  vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(ninf, tail, s + t));
  const float mx = _mm512_reduce_max_ps(vmax);
  if (max_out != nullptr) *max_out = mx;
  const __m512 vm = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (t = 0; t + 16 <= n; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), vm));
    _mm512_storeu_ps(s + t, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  const __m512 e = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_mask_loadu_ps(vm, tail, s + t), vm)));
  _mm512_mask_storeu_ps(s + t, tail, e);
  return _mm512_reduce_add_ps(_mm512_add_ps(vsum, e));
}

// [Σ a0, Σ a1, Σ a2, Σ a3]: pairs interleaved within each 128-bit lane (unpack ps, then pd), then the
// four 128-bit lanes added. One tree for every key: its sum's association never depends on the others.
inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d d01 = _mm512_castps_pd(t01), d23 = _mm512_castps_pd(t23);
  const __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d01, d23)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(d01, d23)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Scores of NR query heads (rows of qf, head_dim apart) against four key rows: 4 NR accumulators
// (28 of the 32 registers at NR = 7, beside the four key slices). out[r * stride + j] for key j.
template <typename T, int NR>
inline void score_tile4(const float* qf, const T* const* k, int64_t head_dim, const float* mul, float* out,
                        int64_t stride) {
  __m512 acc[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 16) {
    const __m512 k0 = load16(k[0] + d), k1 = load16(k[1] + d), k2 = load16(k[2] + d), k3 = load16(k[3] + d);
    for (int r = 0; r < NR; ++r) {
      const __m512 qv = _mm512_loadu_ps(qf + r * head_dim + d);
      acc[r][0] = _mm512_fmadd_ps(qv, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(qv, k1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(qv, k2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(qv, k3, acc[r][3]);
    }
  }
  const __m128 scale = _mm_loadu_ps(mul);
  for (int r = 0; r < NR; ++r)
    _mm_storeu_ps(out + r * stride, _mm_mul_ps(sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), scale));
}

// Heads in near-equal groups of at most 7 (a register tile each): 7 → 7, 8 → 4 + 4, 9 → 5 + 4.
inline int64_t head_group(int64_t rep) {
  const int64_t groups = (rep + 6) / 7;
  return (rep + groups - 1) / groups;
}

template <typename T>
inline void score_group4(const float* qf, const T* const* k, int64_t nr, int64_t head_dim, const float* mul,
                         float* out, int64_t stride) {
  switch (nr) {
    case 7: return score_tile4<T, 7>(qf, k, head_dim, mul, out, stride);
    case 6: return score_tile4<T, 6>(qf, k, head_dim, mul, out, stride);
    case 5: return score_tile4<T, 5>(qf, k, head_dim, mul, out, stride);
    case 4: return score_tile4<T, 4>(qf, k, head_dim, mul, out, stride);
    case 3: return score_tile4<T, 3>(qf, k, head_dim, mul, out, stride);
    case 2: return score_tile4<T, 2>(qf, k, head_dim, mul, out, stride);
    default: return score_tile4<T, 1>(qf, k, head_dim, mul, out, stride);
  }
}

// Scores of the `rep` heads of kv head g (qf: their rows) against keys [t, t + 4) of a chunk of n
// (fewer at its end: the last key stands in for the missing ones, and only real keys are written).
// scores[r * n + t + j]; k_scale per (slot, kv head) when T is int8.
template <typename T>
inline void score_keys4(const float* qf, const T* k_cache, const at::Half* k_scale, const int64_t* slots, int64_t t,
                        int64_t n, int64_t g, int64_t num_kv_heads, int64_t rep, int64_t head_dim,
                        int64_t token_stride, float* scores) {
  const T* rows[4];
  float mul[4] = {1.f, 1.f, 1.f, 1.f};
  const int64_t real = std::min<int64_t>(4, n - t);
  for (int64_t j = 0; j < 4; ++j) {
    const int64_t slot = slots[t + std::min(j, real - 1)];
    rows[j] = k_cache + slot * token_stride + g * head_dim;
    if constexpr (std::is_same_v<T, int8_t>) mul[j] = static_cast<float>(k_scale[slot * num_kv_heads + g]);
  }
  const int64_t nr = head_group(rep);
  if (real == 4) {
    for (int64_t r0 = 0; r0 < rep; r0 += nr)
      score_group4(qf + r0 * head_dim, rows, std::min(nr, rep - r0), head_dim, mul, scores + r0 * n + t, n);
    return;
  }
  float tail[7 * 4];
  for (int64_t r0 = 0; r0 < rep; r0 += nr) {
    const int64_t m = std::min(nr, rep - r0);
    score_group4(qf + r0 * head_dim, rows, m, head_dim, mul, tail, 4);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < real; ++j) scores[(r0 + r) * n + t + j] = tail[r * 4 + j];
  }
}

// O[r, d0 .. d0 + 16 SC) = (alpha ? alpha[r] O[r, ...] : 0) + Σ_{t < n} P[r ldp + t] V_t[d0 ...] for R rows,
// V_t = row(t): R SC accumulators (28 at R = 7, SC = 4) while the value rows stream by; each weight an
// embedded broadcast. Each (r, dimension) sums over t in order whatever tile it lands in.
template <typename TC, int R, int SC, typename Row>
inline void values_tile(const float* P, int64_t ldp, int64_t n, const Row& row, int64_t d0, const float* alpha,
                        float* O, int64_t ldo) {
  __m512 a[R][SC];
  if (alpha == nullptr) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < SC; ++c) a[r][c] = _mm512_setzero_ps();
  } else {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < SC; ++c)
        a[r][c] = _mm512_mul_ps(_mm512_set1_ps(alpha[r]), _mm512_loadu_ps(O + r * ldo + d0 + 16 * c));
  }
  for (int64_t t = 0; t < n; ++t) {
    const TC* v = row(t) + d0;
    __m512 vv[SC];
    for (int c = 0; c < SC; ++c) vv[c] = load16(v + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(P[r * ldp + t]);
      for (int c = 0; c < SC; ++c) a[r][c] = _mm512_fmadd_ps(w, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < SC; ++c) _mm512_storeu_ps(O + r * ldo + d0 + 16 * c, a[r][c]);
}

template <typename TC, int SC, typename Row>
inline void values_group(int64_t rb, const float* P, int64_t ldp, int64_t n, const Row& row, int64_t d0,
                         const float* alpha, float* O, int64_t ldo) {
  switch (rb) {
    case 7: return values_tile<TC, 7, SC>(P, ldp, n, row, d0, alpha, O, ldo);
    case 6: return values_tile<TC, 6, SC>(P, ldp, n, row, d0, alpha, O, ldo);
    case 5: return values_tile<TC, 5, SC>(P, ldp, n, row, d0, alpha, O, ldo);
    case 4: return values_tile<TC, 4, SC>(P, ldp, n, row, d0, alpha, O, ldo);
    case 3: return values_tile<TC, 3, SC>(P, ldp, n, row, d0, alpha, O, ldo);
    case 2: return values_tile<TC, 2, SC>(P, ldp, n, row, d0, alpha, O, ldo);
    default: return values_tile<TC, 1, SC>(P, ldp, n, row, d0, alpha, O, ldo);
  }
}

// O[r, :] (= alpha[r] O[r, :] +) Σ_{t < n} P[r ldp + t] row(t) for `rows` rows of head_dim values: head_dim
// in slices of 64 (the last 16, 32 or 48), rows in tiles of at most `tile` (<= 7). Decode's value pass (the
// heads of one kv head, no alpha) and the prefill kernel's (query rows, rescaled by the online softmax).
template <typename TC, typename Row>
void values_rows(int64_t rows, int64_t tile, const float* P, int64_t ldp, int64_t n, const Row& row,
                 const float* alpha, float* O, int64_t head_dim) {
  for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
    const int64_t sc = std::min<int64_t>(4, (head_dim - d0) / 16);
    for (int64_t r0 = 0; r0 < rows; r0 += tile) {
      const int64_t rb = std::min(tile, rows - r0);
      const float* pr = P + r0 * ldp;
      const float* al = alpha == nullptr ? nullptr : alpha + r0;
      float* o = O + r0 * head_dim;
      switch (sc) {
        case 4: values_group<TC, 4>(rb, pr, ldp, n, row, d0, al, o, head_dim); break;
        case 3: values_group<TC, 3>(rb, pr, ldp, n, row, d0, al, o, head_dim); break;
        case 2: values_group<TC, 2>(rb, pr, ldp, n, row, d0, al, o, head_dim); break;
        default: values_group<TC, 1>(rb, pr, ldp, n, row, d0, al, o, head_dim); break;
      }
    }
  }
}

// acc[r, :] = Σ_t p[r n + t] v_t for the `rep` heads of one kv head, heads in groups of at most 7.
template <typename TC>
void weighted_values(const float* p, int64_t n, const int64_t* slots, const TC* v, int64_t token_stride,
                     int64_t rep, int64_t head_dim, float* acc) {
  const auto row = [v, slots, token_stride](int64_t t) { return v + slots[t] * token_stride; };
  values_rows<TC>(rep, head_group(rep), p, n, n, row, nullptr, acc, head_dim);
}

}  // namespace wide
#endif
