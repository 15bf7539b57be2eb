// Paged prefill attention on AVX-512 (cpu_kernels.cpp includes this inside its anonymous namespace,
// after attention_avx512.h; built only where TM_AVX512 is).
//
// Why: a prefill chunk's attention went through gather + a dense mask + torch SDPA, whose CPU flash
// kernel multiplies through MKL's sgemm (on Zen 5 its `mkl_blas_def_sgemm_kernel_0_zen`: 81-90 G
// multiply-adds a second on 2 threads, where 2 cores' zmm FMAs reach ~220), and a 4,096-token prompt
// spent about half its prefill there. This is flash attention (online softmax, Dao 2023) with both
// products in zmm tiles, keys and values read in place through the block table (no gather; an int8
// cache's scales folded in as the decode kernel does), and key blocks past a query block's last
// position never computed.
//
// Work: per (sequence, kv head), the visible keys are first transposed into fp32 blocks of 64,
// KT[d][64], once (every query block of the chunk reuses them: the score tile broadcasts a query
// element and multiplies 64 keys in 4 zmm, no horizontal sums). Then items (sequence, kv head, 16
// query tokens): rows r = (token, head of the kv head's group), scaled queries Qf [R, hd], and for
// each key block b
//     S = Qf KT_b,  masked (causal, window),  m' = max(m, rowmax S),  P = exp(S - m'),
//     l = e^(m - m') l + Σ P,   O = e^(m - m') O + P V_b,
// then out = O / l. Items are claimed from an atomic counter, longest first: causal rows make the
// items of one chunk unequal.
#pragma once

#if defined(TM_AVX512)
namespace prefill {

constexpr int64_t kBlock = 64;  // keys per block: a score row is 4 zmm
constexpr int64_t kTokens = 16;  // query tokens per item
constexpr int kTile = 6;         // rows per register tile: 24 accumulators

// S[r, 0 .. 64) = Σ_d Q[r, d] KT[d, 0 .. 64) for R rows.
template <int R>
inline void scores_tile(const float* Q, int64_t hd, const float* KT, float* S) {
  __m512 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) a[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < hd; ++d) {
    const float* k = KT + d * kBlock;
    const __m512 k0 = _mm512_loadu_ps(k), k1 = _mm512_loadu_ps(k + 16), k2 = _mm512_loadu_ps(k + 32),
                 k3 = _mm512_loadu_ps(k + 48);
    for (int r = 0; r < R; ++r) {
      const __m512 q = _mm512_set1_ps(Q[r * hd + d]);
      a[r][0] = _mm512_fmadd_ps(q, k0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(q, k1, a[r][1]);
      a[r][2] = _mm512_fmadd_ps(q, k2, a[r][2]);
      a[r][3] = _mm512_fmadd_ps(q, k3, a[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(S + r * kBlock + 16 * c, a[r][c]);
}

inline void scores(int64_t rows, const float* Q, int64_t hd, const float* KT, float* S) {
  int64_t r = 0;
  for (; r + kTile <= rows; r += kTile) scores_tile<kTile>(Q + r * hd, hd, KT, S + r * kBlock);
  switch (rows - r) {
    case 5: return scores_tile<5>(Q + r * hd, hd, KT, S + r * kBlock);
    case 4: return scores_tile<4>(Q + r * hd, hd, KT, S + r * kBlock);
    case 3: return scores_tile<3>(Q + r * hd, hd, KT, S + r * kBlock);
    case 2: return scores_tile<2>(Q + r * hd, hd, KT, S + r * kBlock);
    case 1: return scores_tile<1>(Q + r * hd, hd, KT, S + r * kBlock);
    default: return;
  }
}

// The online-softmax step of one row over one key block: masks keys outside [lo, hi) (block-relative),
// turns S into P in place, and returns e^(m - m') (1 where the block has no visible key: P stays 0).
inline float softmax_row(float* S, int64_t lo, int64_t hi, float& m, float& l) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __mmask16 keep[4];
  __m512 mx = ninf;
  for (int c = 0; c < 4; ++c) {
    const __m512i t = _mm512_add_epi32(lane, _mm512_set1_epi32(16 * c));
    keep[c] = _mm512_cmpge_epi32_mask(t, _mm512_set1_epi32(static_cast<int>(lo))) &
              _mm512_cmplt_epi32_mask(t, _mm512_set1_epi32(static_cast<int>(hi)));
    mx = _mm512_mask_max_ps(mx, keep[c], mx, _mm512_loadu_ps(S + 16 * c));
  }
  const float bm = _mm512_reduce_max_ps(mx);
  if (hi <= lo || bm == -std::numeric_limits<float>::infinity()) {
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(S + 16 * c, _mm512_setzero_ps());
    return 1.f;
  }
  const float mn = std::max(m, bm);
  const float alpha = std::exp(m - mn);  // m = -inf on a row's first visible block: 0
  const __m512 vm = _mm512_set1_ps(mn);
  __m512 sum = _mm512_setzero_ps();
  for (int c = 0; c < 4; ++c) {
    const __m512 p = _mm512_maskz_mov_ps(keep[c], wide::exp16(_mm512_sub_ps(_mm512_loadu_ps(S + 16 * c), vm)));
    _mm512_storeu_ps(S + 16 * c, p);
    sum = _mm512_add_ps(sum, p);
  }
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = mn;
  return alpha;
}

struct Seq {  // one sequence of the group
  int64_t q0, nq;  // its query rows [q0, q0 + nq) of q and out
  int64_t len;     // keys after this step (its queries are the last nq positions)
  int64_t k0;      // first key any of its queries sees (window); its key blocks start here
};

// q [T, H, hd] rows of the group's sequences back to back (row stride q_stride); out [T, H, hd].
// k_scale / v_scale [slots, kvh] fp16: the int8 cache's per-(slot, kv head) scales (null for dense caches):
// a key's scale goes into its transposed copy, a value's into the softmax weight that multiplies it (after
// the row sum l, which must not see it), as the decode kernel folds them.
template <typename TQ, typename TC>
void attention(const TQ* q, int64_t q_stride, const TC* k_cache, const TC* v_cache, const at::Half* k_scale,
               const at::Half* v_scale, const int64_t* table,
               int64_t table_width, const std::vector<Seq>& seqs, int64_t num_heads, int64_t kvh, int64_t hd,
               int64_t block_size, float scale, int64_t window, TQ* out) {
  const int64_t rep = num_heads / kvh, token_stride = kvh * hd;
  const auto slot = [&](int64_t s, int64_t t) {
    return table[s * table_width + t / block_size] * block_size + t % block_size;
  };
  const auto blocks_of = [&](const Seq& sq) { return (sq.len - sq.k0 + kBlock - 1) / kBlock; };
  std::vector<int64_t> kt_at(seqs.size() + 1, 0);  // each sequence's transposed blocks: [kvh][blocks][hd][64]
  for (size_t s = 0; s < seqs.size(); ++s) kt_at[s + 1] = kt_at[s] + blocks_of(seqs[s]) * kvh * hd * kBlock;
  std::vector<float> kt(kt_at.back());
  // Phase 1: every visible key transposed once, per (sequence, kv head, block); past the end zeros.
  std::vector<std::array<int64_t, 3>> tasks;
  for (int64_t s = 0; s < static_cast<int64_t>(seqs.size()); ++s)
    for (int64_t g = 0; g < kvh; ++g)
      for (int64_t b = 0; b < blocks_of(seqs[s]); ++b) tasks.push_back({s, g, b});
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const auto [s, g, b] = tasks[i];
      const Seq& sq = seqs[s];
      float* dst = kt.data() + kt_at[s] + (g * blocks_of(sq) + b) * hd * kBlock;
      const int64_t t0 = sq.k0 + b * kBlock, n = std::min(kBlock, sq.len - t0);
      for (int64_t t = 0; t < kBlock; ++t) {
        if (t >= n) {
          for (int64_t d = 0; d < hd; ++d) dst[d * kBlock + t] = 0.f;
          continue;
        }
        const int64_t sl = slot(s, t0 + t);
        const TC* row = k_cache + sl * token_stride + g * hd;
        const float mul = k_scale != nullptr ? static_cast<float>(k_scale[sl * kvh + g]) : 1.f;
        for (int64_t d = 0; d < hd; ++d) dst[d * kBlock + t] = static_cast<float>(row[d]) * mul;
      }
    }
  });
  // Phase 2: items of kTokens queries, longest (most key blocks) first, claimed in turn.
  struct Item {
    int64_t s, g, i0, work;
  };
  std::vector<Item> items;
  for (int64_t s = 0; s < static_cast<int64_t>(seqs.size()); ++s)
    for (int64_t i0 = 0; i0 < seqs[s].nq; i0 += kTokens)
      for (int64_t g = 0; g < kvh; ++g) {
        const int64_t last = seqs[s].len - seqs[s].nq + std::min(seqs[s].nq, i0 + kTokens) - 1;
        items.push_back({s, g, i0, last - seqs[s].k0});
      }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.work > b.work; });
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  at::parallel_for(0, std::max<int64_t>(threads, 1), 1, [&](int64_t, int64_t) {
    const int64_t max_rows = kTokens * rep;
    std::vector<float> Q(max_rows * hd), O(max_rows * hd), S(max_rows * kBlock), m(max_rows), l(max_rows),
        alpha(max_rows);
    std::vector<const TC*> vrows(kBlock);
    std::vector<float> vmul(kBlock);
    for (int64_t it = next.fetch_add(1); it < static_cast<int64_t>(items.size()); it = next.fetch_add(1)) {
      const Item& item = items[it];
      const Seq& sq = seqs[item.s];
      const int64_t nt = std::min(kTokens, sq.nq - item.i0), rows = nt * rep;
      const int64_t p0 = sq.len - sq.nq + item.i0;  // the first token's position
      for (int64_t i = 0; i < nt; ++i)
        for (int64_t h = 0; h < rep; ++h) {
          const TQ* src = q + (sq.q0 + item.i0 + i) * q_stride + (item.g * rep + h) * hd;
          float* dst = Q.data() + (i * rep + h) * hd;
          for (int64_t d = 0; d < hd; ++d) dst[d] = static_cast<float>(src[d]) * scale;
        }
      std::fill(O.begin(), O.begin() + rows * hd, 0.f);
      std::fill(m.begin(), m.begin() + rows, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + rows, 0.f);
      const int64_t first = window > 0 ? std::max<int64_t>(sq.k0, p0 - window + 1) : sq.k0;
      const int64_t b_lo = (first - sq.k0) / kBlock, b_hi = (p0 + nt - 1 - sq.k0) / kBlock + 1;
      const float* kt_g = kt.data() + kt_at[item.s] + item.g * blocks_of(sq) * hd * kBlock;
      for (int64_t b = b_lo; b < b_hi; ++b) {
        const int64_t t0 = sq.k0 + b * kBlock, n = std::min(kBlock, sq.len - t0);
        scores(rows, Q.data(), hd, kt_g + b * hd * kBlock, S.data());
        for (int64_t i = 0; i < nt; ++i) {
          const int64_t p = p0 + i;
          const int64_t lo = window > 0 ? std::max<int64_t>(0, p - window + 1 - t0) : 0;
          const int64_t hi = std::min(n, p + 1 - t0);
          for (int64_t h = 0; h < rep; ++h) {
            const int64_t r = i * rep + h;
            alpha[r] = softmax_row(S.data() + r * kBlock, lo, hi, m[r], l[r]);
          }
        }
        for (int64_t t = 0; t < n; ++t) vrows[t] = v_cache + slot(item.s, t0 + t) * token_stride + item.g * hd;
        if (v_scale != nullptr) {
          for (int64_t t = 0; t < n; ++t) vmul[t] = static_cast<float>(v_scale[slot(item.s, t0 + t) * kvh + item.g]);
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t t = 0; t < n; ++t) S[r * kBlock + t] *= vmul[t];
        }
        const auto row = [rows_at = vrows.data()](int64_t t) { return rows_at[t]; };
        wide::values_rows<TC>(rows, kTile, S.data(), kBlock, n, row, alpha.data(), O.data(), hd);
      }
      for (int64_t i = 0; i < nt; ++i)
        for (int64_t h = 0; h < rep; ++h) {
          const int64_t r = i * rep + h;
          const float inv = 1.f / l[r];
          TQ* dst = out + ((sq.q0 + item.i0 + i) * num_heads + item.g * rep + h) * hd;
          for (int64_t d = 0; d < hd; ++d) dst[d] = static_cast<TQ>(O[r * hd + d] * inv);
        }
    }
  });
}

}  // namespace prefill
#endif
