// Native CPU kernels of the hot path (built by tokenmill/kernels/__init__.py).
//
// 1. Paged decode attention: one query token per sequence against its keys and values read
// in place from the block KV cache. The SDPA path first gathers every sequence's blocks into a
// dense copy (read + write + read again); this kernel reads each cached key and value once.
//
// Work item = (sequence, kv head): the `rep = H / KVH` query heads that share a kv head are
// scored together, so each key row is loaded once for all of them (GQA without repeating K/V).
// Softmax is two-pass over a per-thread score buffer (exact, same math as SDPA in fp32):
//   s_t = q·k_t * scale  (optionally cap * tanh(s_t / cap)),  p_t = exp(s_t - max) / Σ exp,
//   out = Σ_t p_t v_t.
// Visible keys of a sequence of length L: [max(0, L - window), L) when window > 0, else [0, L).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// Scores of `rep` query heads (rows of qf, pre-scaled) against one key row.
template <typename T>
inline void score_row(const float* qf, const T* k, int64_t rep, int64_t head_dim, float* out, int64_t stride) {
  for (int64_t r = 0; r < rep; ++r) {
    const float* qr = qf + r * head_dim;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < head_dim; ++d) acc += qr[d] * static_cast<float>(k[d]);
    out[r * stride] = acc;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// fp32 with head_dim % 8 == 0: the key row is loaded once per 8 lanes and shared by up to 8 heads.
template <>
inline void score_row<float>(const float* qf, const float* k, int64_t rep, int64_t head_dim, float* out,
                             int64_t stride) {
  if (head_dim % 8 != 0) {
    for (int64_t r = 0; r < rep; ++r) {
      float acc = 0.f;
      for (int64_t d = 0; d < head_dim; ++d) acc += qf[r * head_dim + d] * k[d];
      out[r * stride] = acc;
    }
    return;
  }
  for (int64_t r0 = 0; r0 < rep; r0 += 8) {
    const int64_t nr = std::min<int64_t>(8, rep - r0);
    __m256 acc[8];
    for (int64_t r = 0; r < nr; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
      const __m256 kv = _mm256_loadu_ps(k + d);
      for (int64_t r = 0; r < nr; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + (r0 + r) * head_dim + d), kv, acc[r]);
    }
    for (int64_t r = 0; r < nr; ++r) out[(r0 + r) * stride] = hsum(acc[r]);
  }
}
#endif

template <typename T>
inline void axpy(float w, const T* v, float* out, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) out[d] += w * static_cast<float>(v[d]);
}

// The cache row [KVH, hd] of position `pos` of a sequence, through its block table.
template <typename T>
inline const T* slot_row(const T* cache, const int64_t* table, int64_t pos, int64_t block_size, int64_t stride) {
  return cache + (table[pos / block_size] * block_size + pos % block_size) * stride;
}

// The K and V passes prefetch the row two positions ahead: it may sit in another block, where the
// hardware prefetcher cannot follow.
inline void prefetch_rows(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

template <typename T>
void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_table,
                   const int64_t* seq_lens, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, int64_t block_size, int64_t table_width, double scale, int64_t window,
                   double softcap) {
  const int64_t rep = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // elements between consecutive slots
  // A work item is one sequence and a run of its kv heads. Walking all heads of a slot together
  // reads the cache rows [KVH, hd] front to back (sequential memory); few sequences (batch-1
  // decode) split by head instead so every thread still has work.
  const int64_t threads = at::get_num_threads();
  const int64_t heads_per_item = num_seqs >= 4 * threads ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / heads_per_item;
  const float qscale = softcap > 0 ? 1.f : static_cast<float>(scale);  // with a softcap, scale goes inside tanh
  at::parallel_for(0, num_seqs * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, scores, inv_sum;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / items_per_seq, g0 = (item % items_per_seq) * heads_per_item;
      const int64_t nh = heads_per_item * rep;  // query heads of this item, consecutive in q
      const int64_t len = seq_lens[s];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - lo;
      const int64_t* table = block_table + s * table_width;
      const T* qs = q + (s * num_heads + g0 * rep) * head_dim;
      qf.resize(nh * head_dim);
      for (int64_t i = 0; i < nh * head_dim; ++i) qf[i] = static_cast<float>(qs[i]) * qscale;
      const int64_t item_bytes = heads_per_item * head_dim * static_cast<int64_t>(sizeof(T));
      scores.resize(nh * n);
      for (int64_t t = 0; t < n; ++t) {
        const T* row = slot_row(k_cache, table, lo + t, block_size, token_stride);
        if (t + 2 < n) prefetch_rows(slot_row(k_cache, table, lo + t + 2, block_size, token_stride) + g0 * head_dim,
                                     item_bytes);
        for (int64_t g = 0; g < heads_per_item; ++g)
          score_row(qf.data() + g * rep * head_dim, row + (g0 + g) * head_dim, rep, head_dim,
                    scores.data() + g * rep * n + t, n);
      }
      inv_sum.resize(nh);
      for (int64_t h = 0; h < nh; ++h) {
        float* sh = scores.data() + h * n;
        if (softcap > 0) {
          const float c = static_cast<float>(softcap), sc = static_cast<float>(scale);
          for (int64_t t = 0; t < n; ++t) sh[t] = c * std::tanh(sh[t] * sc / c);
        }
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sh[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) {
          sh[t] = std::exp(sh[t] - mx);
          sum += sh[t];
        }
        inv_sum[h] = 1.f / sum;
      }
      acc.assign(nh * head_dim, 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const T* row = slot_row(v_cache, table, lo + t, block_size, token_stride);
        if (t + 2 < n) prefetch_rows(slot_row(v_cache, table, lo + t + 2, block_size, token_stride) + g0 * head_dim,
                                     item_bytes);
        for (int64_t h = 0; h < nh; ++h)
          axpy(scores[h * n + t], row + (g0 + h / rep) * head_dim, acc.data() + h * head_dim, head_dim);
      }
      T* os = out + (s * num_heads + g0 * rep) * head_dim;
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t d = 0; d < head_dim; ++d)
          os[h * head_dim + d] = static_cast<T>(acc[h * head_dim + d] * inv_sum[h]);
    }
  });
}

}  // namespace

// q [S, H, hd]; k_cache, v_cache [num_blocks, block_size, KVH, hd]; block_table [S, W] int64;
// seq_lens [S] int64 (keys per sequence, the new token included). Returns [S, H, hd].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor seq_lens, double scale,
                                     int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 indices");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3), "head layout mismatch");
  q = q.contiguous();
  block_table = block_table.contiguous();
  seq_lens = seq_lens.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == q.size(0) && seq_lens.numel() == q.size(0),
              "one block-table row and one length per sequence");
  // The kernel reads raw pointers: check every index it will follow (S x W integers, microseconds).
  const int64_t* lens_p = seq_lens.data_ptr<int64_t>();
  const int64_t* table_p = block_table.data_ptr<int64_t>();
  const int64_t width = block_table.size(1), bs = k_cache.size(1), num_blocks = k_cache.size(0);
  for (int64_t s = 0; s < q.size(0); ++s) {
    TORCH_CHECK(lens_p[s] >= 1 && lens_p[s] <= width * bs, "sequence length outside its block table");
    for (int64_t j = 0; j < (lens_p[s] + bs - 1) / bs; ++j)
      TORCH_CHECK(table_p[s * width + j] >= 0 && table_p[s * width + j] < num_blocks, "block id out of range");
  }
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            block_table.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                            q.size(0), q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), block_table.size(1),
                            scale, window, softcap);
  });
  return out;
}


// ---------------------------------------------------------------------------------------------
// Skinny GEMM y = x Wᵀ (+ b) for a few rows of x (batch-1 and small-batch decode), fp32.
// At one row the product is a pure stream over W: the time is W's bytes over memory bandwidth.
// BLAS libraries run these small calls on one thread (measured ~8 GB/s here, against ~20 GB/s for
// a two-thread read), so this splits W's rows across all threads and streams each row once for
// every row of x.
template <int64_t M>
void gemv_rows(const float* x, const float* w, const float* b, float* y, int64_t k, int64_t n_begin,
               int64_t n_end, int64_t n_total) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const float* wr = w + n * k;
    float acc_s[M];
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc0[M], acc1[M];
    for (int64_t m = 0; m < M; ++m) acc0[m] = acc1[m] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= k; d += 16) {
      const __m256 w0 = _mm256_loadu_ps(wr + d), w1 = _mm256_loadu_ps(wr + d + 8);
      for (int64_t m = 0; m < M; ++m) {
        acc0[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * k + d), w0, acc0[m]);
        acc1[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * k + d + 8), w1, acc1[m]);
      }
    }
    for (int64_t m = 0; m < M; ++m) acc_s[m] = hsum(_mm256_add_ps(acc0[m], acc1[m]));
#else
    int64_t d = 0;
    for (int64_t m = 0; m < M; ++m) acc_s[m] = 0.f;
#endif
    for (; d < k; ++d)
      for (int64_t m = 0; m < M; ++m) acc_s[m] += x[m * k + d] * wr[d];
    for (int64_t m = 0; m < M; ++m) y[m * n_total + n] = acc_s[m] + (b ? b[n] : 0.f);
  }
}

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and W [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 4, "1 to 4 rows");
  TORCH_CHECK(w.is_contiguous(), "W must be contiguous");
  x = x.contiguous();
  const float* b = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.scalar_type() == at::kFloat && bias_c.numel() == w.size(0), "bias [N] fp32 expected");
    b = bias_c.data_ptr<float>();
  }
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  auto y = torch::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // 16 KiB+ of W per task: enough work to amortise the fork, small enough to balance two cores.
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(k, 1));
  at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
    switch (m) {
      case 1: gemv_rows<1>(xp, wp, b, yp, k, lo, hi, n); break;
      case 2: gemv_rows<2>(xp, wp, b, yp, k, lo, hi, n); break;
      case 3: gemv_rows<3>(xp, wp, b, yp, k, lo, hi, n); break;
      default: gemv_rows<4>(xp, wp, b, yp, k, lo, hi, n); break;
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("skinny_linear", &skinny_linear, "y = x W^T + b for 1-4 rows of x, fp32, threads over W's rows (CPU)");
}
