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
//
// Cache element types (layers/kv_cache.py): fp32, bf16 or fp16 (any of them under a query of any
// of them), or int8 with an fp16 scale per (slot, kv head): k_t = kq_t * ks_t, v_t = vq_t * vs_t.
// The int8 path never materialises k_t or v_t: the scale multiplies the finished dot product,
//   q·k_t = ks_t * Σ_d q_d kq_t[d],   and folds into the softmax weight, Σ_t (p_t vs_t) vq_t,
// so a row costs one int8 → fp32 widening per element and a quarter of fp32's memory traffic.
//
// 2. The KV write of a step: each new token's key and value row copied into its slot (converted to
// the cache dtype), straight from the strided q/k/v view of the fused projection. `index_copy_` costs
// ~10 us a call here (two per layer, plus a contiguous copy of each strided view): at batch 1 that
// was 1.6 ms of a SmolLM2 step, the same as the attention itself.
//
// 3. The SwiGLU glue: silu(gate) * up from the fused gate/up projection's output in one pass (ATen:
// chunk, silu, mul and two allocations), with the same vectorised exp as the softmax.
//
// 4. A skinny fp32 GEMM for 1-4 rows (at the end of the file).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "c_api.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TM_AVX2 1
#endif

namespace {

// Cephes expf, shared by exp8 and wide::exp16 so a lane gets the same value at either width: inputs
// clamped to [kMin, kMax] (2^n stays normal), x = n ln2 + r with ln2 split in two (kLn2Hi exact in
// float), exp(r) = 1 + r + r^2 (kP[0] r^5 + ... + kP[5]).
namespace cephes {
constexpr float kMin = -87.3f, kMax = 88.3f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace cephes

#if defined(TM_AVX2)
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// Eight cache elements widened to fp32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is the upper half of an fp32
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
#if defined(__F16C__)
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif

// exp on 8 lanes (Cephes expf): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-7 polynomial,
// 2^n through the exponent bits; ~1 ulp. Inputs are clamped to [-87.3, 88.3], where 2^n stays normal.
// The softmax spends most of its time in scalar expf otherwise (one per key and query head).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(cephes::kMin)), _mm256_set1_ps(cephes::kMax));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(cephes::kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(cephes::kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(cephes::kLn2Lo), r);
  __m256 p = _mm256_set1_ps(cephes::kP[0]);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(cephes::kP[1]));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(cephes::kP[2]));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(cephes::kP[3]));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(cephes::kP[4]));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(cephes::kP[5]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// Softmax numerators in place: s_t ← exp(s_t - max_t s_t); returns Σ_t of them (and the max in *max_out,
// which a split sequence's merge needs).
inline float softmax_numerators(float* s, int64_t n, float* max_out = nullptr) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#if defined(TM_AVX2)
  __m256 vmax = _mm256_set1_ps(mx);
  for (; t + 8 <= n; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (float l : lanes) mx = std::max(mx, l);
#endif
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  if (max_out != nullptr) *max_out = mx;
  float sum = 0.f;
  t = 0;
#if defined(TM_AVX2)
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
    _mm256_storeu_ps(s + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  sum = hsum(vsum);
#endif
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  return sum;
}

// Whether load8 exists for T on this build (else the scalar loops below, which the compiler vectorises
// where it can).
template <typename T>
constexpr bool kVector =
#if defined(TM_AVX2)
    std::is_same_v<T, float> || std::is_same_v<T, int8_t> || std::is_same_v<T, c10::BFloat16>
#if defined(__F16C__)
    || std::is_same_v<T, c10::Half>
#endif
#else
    false
#endif
    ;

#if defined(TM_AVX2)
// Scores of NR query heads against one key row. NR is a compile-time constant so the NR
// accumulators live in registers: with a run-time count (an array indexed in a loop) they went
// through the stack, a store-to-load chain per FMA, and this was most of a decode step's
// attention time (0.26 us a key for SmolLM2's 9 heads, ~10x the FMA bound).
template <typename T, int NR>
inline void score_tile(const float* qf, const T* k, int64_t head_dim, float mul, float* out, int64_t stride) {
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 8) {
    const __m256 kv = load8(k + d);
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + r * head_dim + d), kv, acc[r]);
  }
  for (int r = 0; r < NR; ++r) out[r * stride] = hsum(acc[r]) * mul;
}

// Scores of NR query heads against four key rows at once: 4 NR independent accumulator chains (a
// single key's NR chains of head_dim / 8 dependent FMAs left the FMA units idle), and one
// hadd tree turns each head's 4 accumulators into its 4 scores. out[r * stride + j] for key j.
template <typename T, int NR>
inline void score_tile4(const float* qf, const T* const* k, int64_t head_dim, const float* mul, float* out,
                        int64_t stride) {
  __m256 acc[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 8) {
    const __m256 k0 = load8(k[0] + d), k1 = load8(k[1] + d), k2 = load8(k[2] + d), k3 = load8(k[3] + d);
    for (int r = 0; r < NR; ++r) {
      const __m256 qv = _mm256_loadu_ps(qf + r * head_dim + d);
      acc[r][0] = _mm256_fmadd_ps(qv, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(qv, k1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(qv, k2, acc[r][2]);
      acc[r][3] = _mm256_fmadd_ps(qv, k3, acc[r][3]);
    }
  }
  const __m128 scale = _mm_loadu_ps(mul);
  for (int r = 0; r < NR; ++r) {
    // hadd(hadd(a0, a1), hadd(a2, a3)) holds, per 128-bit half, the four keys' partial sums.
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]), _mm256_hadd_ps(acc[r][2], acc[r][3]));
    const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(out + r * stride, _mm_mul_ps(sums, scale));
  }
}

// Whether score_rows4 takes this shape: a head group small enough that its 4 x NR accumulators fit
// the 16 vector registers with the four key vectors.
template <typename T>
inline bool scores4_fit(int64_t rep, int64_t head_dim) {
  return kVector<T> && head_dim % 8 == 0 && rep <= 3;
}

template <typename T>
inline void score_rows4(const float* qf, const T* const* k, int64_t rep, int64_t head_dim, const float* mul,
                        float* out, int64_t stride) {
  if constexpr (kVector<T>) {
    if (rep == 3) return score_tile4<T, 3>(qf, k, head_dim, mul, out, stride);
    if (rep == 2) return score_tile4<T, 2>(qf, k, head_dim, mul, out, stride);
    return score_tile4<T, 1>(qf, k, head_dim, mul, out, stride);
  }
}
#endif

// Scores of `rep` query heads (rows of qf, pre-scaled) against one key row, times `mul` (the
// row's int8 scale, 1 for dense caches). With head_dim % 8 == 0 each 8 lanes of the row are
// loaded and widened once and shared by up to 8 heads.
template <typename T>
inline void score_row(const float* qf, const T* k, int64_t rep, int64_t head_dim, float mul, float* out,
                      int64_t stride) {
#if defined(TM_AVX2)
  if constexpr (kVector<T>) {
    if (head_dim % 8 == 0) {
      int64_t r0 = 0;
      for (; r0 + 8 <= rep; r0 += 8) score_tile<T, 8>(qf + r0 * head_dim, k, head_dim, mul, out + r0 * stride, stride);
      const float* qr = qf + r0 * head_dim;
      float* o = out + r0 * stride;
      switch (rep - r0) {
        case 7: score_tile<T, 7>(qr, k, head_dim, mul, o, stride); break;
        case 6: score_tile<T, 6>(qr, k, head_dim, mul, o, stride); break;
        case 5: score_tile<T, 5>(qr, k, head_dim, mul, o, stride); break;
        case 4: score_tile<T, 4>(qr, k, head_dim, mul, o, stride); break;
        case 3: score_tile<T, 3>(qr, k, head_dim, mul, o, stride); break;
        case 2: score_tile<T, 2>(qr, k, head_dim, mul, o, stride); break;
        case 1: score_tile<T, 1>(qr, k, head_dim, mul, o, stride); break;
        default: break;
      }
      return;
    }
  }
#endif
  for (int64_t r = 0; r < rep; ++r) {
    const float* qr = qf + r * head_dim;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < head_dim; ++d) acc += qr[d] * static_cast<float>(k[d]);
    out[r * stride] = acc * mul;
  }
}

// out[r] += w[r * w_stride] * v  for the `rep` heads sharing the value row v (widened once per 8 lanes).
template <typename T>
inline void axpy_rows(const float* w, int64_t w_stride, const T* v, float* out, int64_t rep, int64_t n) {
#if defined(TM_AVX2)
  if constexpr (kVector<T>) {
    if (n % 8 == 0) {
      for (int64_t r0 = 0; r0 < rep; r0 += 8) {
        const int64_t nr = std::min<int64_t>(8, rep - r0);
        __m256 wv[8];
        for (int64_t r = 0; r < nr; ++r) wv[r] = _mm256_set1_ps(w[(r0 + r) * w_stride]);
        for (int64_t d = 0; d < n; d += 8) {
          const __m256 vv = load8(v + d);
          for (int64_t r = 0; r < nr; ++r) {
            float* o = out + (r0 + r) * n + d;
            _mm256_storeu_ps(o, _mm256_fmadd_ps(wv[r], vv, _mm256_loadu_ps(o)));
          }
        }
      }
      return;
    }
  }
#endif
  for (int64_t r = 0; r < rep; ++r) {
    const float wr = w[r * w_stride];
    float* o = out + r * n;
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) o[d] += wr * static_cast<float>(v[d]);
  }
}

// The cache slots of positions [lo, lo + n) of a sequence, through its block table, a block at a
// time (one division per block, not two per key and pass).
inline void slots_of(const int64_t* table, int64_t lo, int64_t n, int64_t block_size, int64_t* slots) {
  for (int64_t pos = lo, t = 0; t < n;) {
    const int64_t off = pos % block_size, run = std::min(block_size - off, n - t);
    const int64_t base = table[pos / block_size] * block_size + off;
    for (int64_t i = 0; i < run; ++i) slots[t + i] = base + i;
    pos += run;
    t += run;
  }
}

#if defined(TM_AVX2)
// acc[r, d0 .. d0 + 16) = sum_t p[r * n + t] v_t[d0 .. d0 + 16) for RB heads: 2 * RB accumulators stay in
// registers while the keys stream by (the axpy form sends every accumulator through memory per key,
// a store-to-load chain each time).
template <typename TC, int RB>
inline void values_tile(const float* p, int64_t n, const int64_t* slots, const TC* v, int64_t token_stride,
                        int64_t d0, float* acc, int64_t head_dim) {
  __m256 a0[RB], a1[RB];
  for (int r = 0; r < RB; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const TC* row = v + slots[t] * token_stride + d0;  // prefetched by the key pass
    const __m256 v0 = load8(row), v1 = load8(row + 8);
    for (int r = 0; r < RB; ++r) {
      const __m256 w = _mm256_broadcast_ss(p + r * n + t);
      a0[r] = _mm256_fmadd_ps(w, v0, a0[r]);
      a1[r] = _mm256_fmadd_ps(w, v1, a1[r]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    _mm256_storeu_ps(acc + r * head_dim + d0, a0[r]);
    _mm256_storeu_ps(acc + r * head_dim + d0 + 8, a1[r]);
  }
}
#endif

// acc[r, :] = sum_t p[r * n + t] v_t for the `rep` query heads sharing one kv head (v: that head's
// first element in slot 0; rows `token_stride` apart).
template <typename TC>
void weighted_values(const float* p, int64_t n, const int64_t* slots, const TC* v, int64_t token_stride,
                     int64_t rep, int64_t head_dim, float* acc) {
#if defined(TM_AVX2)
  if constexpr (kVector<TC>) {
    if (head_dim % 16 == 0) {
      for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
        int64_t r0 = 0;
        for (; r0 + 4 <= rep; r0 += 4)
          values_tile<TC, 4>(p + r0 * n, n, slots, v, token_stride, d0, acc + r0 * head_dim, head_dim);
        float* a = acc + r0 * head_dim;
        const float* pr = p + r0 * n;
        if (rep - r0 == 3) values_tile<TC, 3>(pr, n, slots, v, token_stride, d0, a, head_dim);
        if (rep - r0 == 2) values_tile<TC, 2>(pr, n, slots, v, token_stride, d0, a, head_dim);
        if (rep - r0 == 1) values_tile<TC, 1>(pr, n, slots, v, token_stride, d0, a, head_dim);
      }
      return;
    }
  }
#endif
  std::fill(acc, acc + rep * head_dim, 0.f);
  for (int64_t t = 0; t < n; ++t) axpy_rows(p + t, n, v + slots[t] * token_stride, acc, rep, head_dim);
}

#include "attention_avx512.h"  // wide:: tiles (AVX-512 builds only)

#include "prefill_avx512.h"  // prefill:: flash attention (AVX-512 builds only)

// Rows are prefetched through the slot list: the next row may sit in another block, where the
// hardware prefetcher cannot follow.
constexpr int64_t kAhead = 12;  // rows in flight ahead of the key pass
inline void prefetch_rows(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

// Keys per chunk of one sequence's `keys` keys (decode_kernel's work items; the last chunk takes the
// rest). About 4 chunks a thread, at least kMinChunk keys each, and never more keys than keep a
// chunk's keys and values (read by the key pass, read again by the value pass; key_bytes per key)
// within ~256 KiB of L2: at 1,000 keys a whole SmolLM2 sequence (1.5 MB) made the value pass re-read
// its rows from L3 (batch 32: 7.7 ms a layer warm against 2.4 ms in chunks). A split sequence then
// takes a multiple of the thread count of equal chunks (at least kMinSplit keys each): parallel_for
// hands each thread a contiguous run of ceil(items / threads), so a batch-1 row of 150 keys cut 64,
// 64, 22 gave one thread 128 keys and the other 22 (perf: the main thread did three quarters of
// batch-1 attention while the other spun). The length depends on the sequence's own key count only,
// never on the other rows of the step: a speculative verification scores 1 + k rows of one request
// where a plain decode scores one, and greedy output must not change with it (chunks sized from the
// step's total keys flipped a near-tie on Qwen2.5-Coder-0.5B).
//
// `threads` is the split thread count (split_threads()), not the threads running now: the engine's CPU
// governor (engine/cpu_share.py) moves the running count while requests decode, and a split that
// followed it changed a row's float sums between steps (greedy output must not depend on a neighbour's
// load). Fewer threads than the split still run every chunk, each as before, merged in chunk order.
int64_t decode_chunk_len(int64_t keys, int64_t threads, int64_t key_bytes) {
  constexpr int64_t kMinChunk = 64;  // below this a chunk's fixed cost and merge outweigh the parallelism (32: batch 32 at 100 keys 1.23x slower)
  constexpr int64_t kMinSplit = 32;
  if (keys <= 0) return 1;
  const int64_t max_chunk = std::max(kMinChunk, (256 << 10) / std::max<int64_t>(1, key_bytes));
  const int64_t base = std::min(max_chunk, std::max(kMinChunk, (keys + 4 * threads - 1) / (4 * threads)));
  int64_t n = (keys + base - 1) / base;
  if (n > 1) n = std::min((n + threads - 1) / threads * threads, std::max<int64_t>(2, keys / kMinSplit));
  return (keys + n - 1) / n;
}

// The thread count decode attention splits keys for: set once per process by the engine
// (set_decode_split_threads: its configured count); 0, the default, follows the threads running now.
std::atomic<int64_t> g_split_threads{0};

int64_t split_threads() {
  const int64_t fixed = g_split_threads.load(std::memory_order_relaxed);
  return fixed > 0 ? fixed : at::get_num_threads();
}

// The order decode_kernel runs its items in (item ids stay grouped by sequence for the merge). Rows of
// one request's speculative verification (consecutive sequences over the same blocks) take turns chunk by
// chunk: row j's chunk c covers nearly the keys of row 0's chunk c, so the rows after the first find
// those keys in L2. In sequence order, each row re-read the whole context from L3 or memory (8 rows at
// 4,000 keys: 8 x 4 MB a layer). Which thread runs an item changes no bits: items are independent.
std::vector<int64_t> item_order(const std::vector<int64_t>& first_item, const int64_t* block_table,
                                int64_t table_width, const int64_t* seq_lens, int64_t block_size) {
  const int64_t num_seqs = static_cast<int64_t>(first_item.size()) - 1;
  std::vector<int64_t> order;
  order.reserve(first_item[num_seqs]);
  const auto same_blocks = [&](int64_t a, int64_t b) {
    const int64_t blocks = (std::min(seq_lens[a], seq_lens[b]) + block_size - 1) / block_size;
    return std::equal(block_table + a * table_width, block_table + a * table_width + blocks,
                      block_table + b * table_width);
  };
  for (int64_t s = 0; s < num_seqs;) {
    int64_t e = s + 1, chunks = first_item[s + 1] - first_item[s];
    for (; e < num_seqs && same_blocks(s, e); ++e) chunks = std::max(chunks, first_item[e + 1] - first_item[e]);
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t r = s; r < e; ++r)
        if (first_item[r] + c < first_item[r + 1]) order.push_back(first_item[r] + c);
    s = e;
  }
  return order;
}

// Whether attention takes the AVX-512 kernels where this build has them (the default): the decode tiles
// where they fit and the prefill kernel; off, the AVX2 decode tiles and gather + SDPA for prefill, what
// an AVX2-only host runs. A process setting for tests, which compare the paths on one machine (a step's
// rows always share one path, so a verification row still matches its plain decode).
// TOKENMILL_WIDE_ATTENTION=0 starts a process on the AVX2 path (an A/B of a whole run, or an escape hatch).
bool wide_default() {
  const char* env = std::getenv("TOKENMILL_WIDE_ATTENTION");
  return env == nullptr || std::string(env) != "0";
}
std::atomic<bool> g_wide_attention{wide_default()};

template <typename TC>
bool use_wide(int64_t head_dim) {
#if defined(TM_AVX512)
  return g_wide_attention.load(std::memory_order_relaxed) && wide::fits<TC>(head_dim);
#else
  (void)head_dim;
  return false;
#endif
}

// TQ: query and output type; TC: cache element type. k_scale/v_scale [slots, KVH] are read only
// when TC is int8 (null otherwise).
//
// A work item is one sequence's key range [t0, t1), all its kv heads. Walking all heads of a
// slot together reads the cache rows [KVH, hd] front to back (sequential memory, which the hardware
// prefetcher follows). Each sequence's keys are split into chunks (flash-decoding) when sequences
// are few (batch-1 decode: every thread gets work and still streams whole rows) or long (a chunk's
// rows stay in L2 between the key and the value pass); each chunk leaves, per query head, its max
// m_c, its sum l_c = Σ exp(s - m_c) and its unnormalised values a_c = Σ exp(s - m_c) v; the merge is
//     out = Σ_c e^(m_c - M) a_c / Σ_c e^(m_c - M) l_c,   M = max_c m_c.
// (Splitting by kv head instead gave a thread 2 of SmolLM2's 3 heads, and each item read a third of
// every row: 256-byte pieces 768 bytes apart.)
template <typename TQ, typename TC, bool Wide>
void decode_kernel(const TQ* q, const TC* k_cache, const TC* v_cache, const at::Half* k_scale,
                   const at::Half* v_scale, const int64_t* block_table, const int64_t* seq_lens, TQ* out,
                   int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                   int64_t table_width, double scale, int64_t window, double softcap, int64_t q_stride) {
  constexpr bool kQuant = std::is_same_v<TC, int8_t>;
  const int64_t rep = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // elements between consecutive slots
  const int64_t threads = split_threads();
  const float qscale = softcap > 0 ? 1.f : static_cast<float>(scale);  // with a softcap, scale goes inside tanh
  const auto first_key = [&](int64_t s) { return window > 0 ? std::max<int64_t>(0, seq_lens[s] - window) : 0; };
  const int64_t key_bytes = 2 * token_stride * static_cast<int64_t>(sizeof(TC));
  std::vector<int64_t> item_seq, item_t0;  // items in sequence order; a sequence's chunks are consecutive
  std::vector<int64_t> first_item(num_seqs + 1), seq_chunk(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) {
    first_item[s] = static_cast<int64_t>(item_seq.size());
    const int64_t lo = first_key(s), len = seq_lens[s];
    const int64_t chunk = seq_chunk[s] = decode_chunk_len(len - lo, threads, key_bytes);
    for (int64_t t0 = lo; t0 < len; t0 = t0 + std::min(chunk, len - t0)) {
      item_seq.push_back(s);
      item_t0.push_back(t0);
    }
  }
  first_item[num_seqs] = static_cast<int64_t>(item_seq.size());
  const int64_t num_items = first_item[num_seqs];
  const bool split = num_items > num_seqs;
  // A split sequence's partials: per item and query head, the max, the sum and hd unnormalised values.
  std::vector<float> part_m, part_l, part_a;
  if (split) {
    part_m.resize(num_items * num_heads);
    part_l.resize(num_items * num_heads);
    part_a.resize(num_items * num_heads * head_dim);
  }
  const std::vector<int64_t> order = item_order(first_item, block_table, table_width, seq_lens, block_size);
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(num_heads * head_dim), own_acc(num_heads * head_dim), scores, inv_sum(num_heads);
    std::vector<int64_t> slots;
    const int64_t row_bytes = token_stride * static_cast<int64_t>(sizeof(TC));
    for (int64_t at = begin; at < end; ++at) {
      const int64_t item = order[at];
      const int64_t s = item_seq[item], t0 = item_t0[item];
      const int64_t n = std::min(seq_chunk[s], seq_lens[s] - t0);
      // Per sequence, not per step: an unsplit sequence takes the same steps whatever the others do.
      const bool seq_split = first_item[s + 1] - first_item[s] > 1;
      slots.resize(n);
      slots_of(block_table + s * table_width, t0, n, block_size, slots.data());
      const TQ* qs = q + s * q_stride;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) qf[i] = static_cast<float>(qs[i]) * qscale;
      // The unnormalised values: a split sequence's go straight to its partials.
      float* acc = seq_split ? part_a.data() + item * num_heads * head_dim : own_acc.data();
      scores.resize(num_heads * n);
      // The key pass prefetches its keys kAhead rows ahead (the next row may sit in another block).
      // Not the values: cold rows come in as fast as misses can be outstanding, and value prefetches
      // took the key pass's miss slots (batch 1 steps 1.02-1.07x faster without them, batch 16
      // 1.02x; the value pass's sequential rows are left to the hardware prefetcher).
      const auto prefetch_kv = [&](int64_t t) {
        const int64_t at = slots[t] * token_stride;
        prefetch_rows(k_cache + at, row_bytes);
        if constexpr (kQuant) {
          __builtin_prefetch(k_scale + slots[t] * num_kv_heads);
          __builtin_prefetch(v_scale + slots[t] * num_kv_heads);
        }
      };
      for (int64_t t = 0; t < std::min<int64_t>(n, kAhead); ++t) prefetch_kv(t);
#if defined(TM_AVX512)
      if constexpr (Wide) {
        for (int64_t t = 0; t < n; t += 4) {
          for (int64_t j = 0; j < 4; ++j)
            if (t + j + kAhead < n) prefetch_kv(t + j + kAhead);
          for (int64_t g = 0; g < num_kv_heads; ++g)
            wide::score_keys4(qf.data() + g * rep * head_dim, k_cache, k_scale, slots.data(), t, n, g, num_kv_heads,
                              rep, head_dim, token_stride, scores.data() + g * rep * n);
        }
      }
#endif
      int64_t t = Wide ? n : 0;
#if defined(TM_AVX2)
      if (scores4_fit<TC>(rep, head_dim)) {
        for (; t + 4 <= n; t += 4) {
          for (int64_t j = 0; j < 4; ++j)
            if (t + j + kAhead < n) prefetch_kv(t + j + kAhead);
          for (int64_t g = 0; g < num_kv_heads; ++g) {
            const TC* rows[4];
            float mul[4] = {1.f, 1.f, 1.f, 1.f};
            for (int64_t j = 0; j < 4; ++j) {
              rows[j] = k_cache + slots[t + j] * token_stride + g * head_dim;
              if constexpr (kQuant) mul[j] = static_cast<float>(k_scale[slots[t + j] * num_kv_heads + g]);
            }
            score_rows4(qf.data() + g * rep * head_dim, rows, rep, head_dim, mul, scores.data() + g * rep * n + t, n);
          }
        }
      }
#endif
      for (; t < n; ++t) {
        const int64_t slot = slots[t];
        const TC* row = k_cache + slot * token_stride;
        if (t + kAhead < n) prefetch_kv(t + kAhead);
        for (int64_t g = 0; g < num_kv_heads; ++g) {
          float mul = 1.f;
          if constexpr (kQuant) mul = static_cast<float>(k_scale[slot * num_kv_heads + g]);
          score_row(qf.data() + g * rep * head_dim, row + g * head_dim, rep, head_dim, mul,
                    scores.data() + g * rep * n + t, n);
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* sh = scores.data() + h * n;
        if (softcap > 0) {
          const float c = static_cast<float>(softcap), sc = static_cast<float>(scale);
          for (int64_t t = 0; t < n; ++t) sh[t] = c * std::tanh(sh[t] * sc / c);
        }
        float* max_out = seq_split ? &part_m[item * num_heads + h] : nullptr;
        float sum = 0.f;
#if defined(TM_AVX512)
        if constexpr (Wide) sum = wide::softmax_numerators(sh, n, max_out);
        else
#endif
          sum = softmax_numerators(sh, n, max_out);
        if (seq_split) part_l[item * num_heads + h] = sum;
        else inv_sum[h] = 1.f / sum;
      }
      for (int64_t g = 0; g < num_kv_heads; ++g) {
        float* p = scores.data() + g * rep * n;  // p_t of the kv head's query heads, rows of n
        if constexpr (kQuant) {  // the value scale folds into the weight: sum_t (p_t vs_t) vq_t
          for (int64_t t = 0; t < n; ++t) {
            const float vs = static_cast<float>(v_scale[slots[t] * num_kv_heads + g]);
            for (int64_t r = 0; r < rep; ++r) p[r * n + t] *= vs;
          }
        }
#if defined(TM_AVX512)
        if constexpr (Wide) {
          wide::weighted_values(p, n, slots.data(), v_cache + g * head_dim, token_stride, rep, head_dim,
                                acc + g * rep * head_dim);
          continue;
        }
#endif
        weighted_values(p, n, slots.data(), v_cache + g * head_dim, token_stride, rep, head_dim,
                        acc + g * rep * head_dim);
      }
      if (seq_split) continue;
      TQ* os = out + s * num_heads * head_dim;
      for (int64_t h = 0; h < num_heads; ++h)
        for (int64_t d = 0; d < head_dim; ++d)
          os[h * head_dim + d] = static_cast<TQ>(acc[h * head_dim + d] * inv_sum[h]);
    }
  });
  if (!split) return;
  // The merge: per sequence and head, its chunks' hd values.
  at::parallel_for(0, num_seqs, 1, [&](int64_t s0, int64_t s1) {
    std::vector<float> merged(head_dim);
    for (int64_t s = s0; s < s1; ++s) {
      if (first_item[s + 1] - first_item[s] <= 1) continue;  // written by its one item
      for (int64_t h = 0; h < num_heads; ++h) {
        float big = -std::numeric_limits<float>::infinity();
        for (int64_t i = first_item[s]; i < first_item[s + 1]; ++i) big = std::max(big, part_m[i * num_heads + h]);
        float denom = 0.f;
        std::fill(merged.begin(), merged.end(), 0.f);
        for (int64_t i = first_item[s]; i < first_item[s + 1]; ++i) {
          const float w = std::exp(part_m[i * num_heads + h] - big);
          denom += w * part_l[i * num_heads + h];
          const float* a = part_a.data() + (i * num_heads + h) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) merged[d] += w * a[d];
        }
        TQ* o = out + (s * num_heads + h) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<TQ>(merged[d] / denom);
      }
    }
  });
}

// decode_kernel<TQ, TC, wide>(args...) for the path use_wide picks.
template <typename TQ, typename TC, typename... Args>
void run_decode_kernel(int64_t head_dim, Args&&... args) {
  if (use_wide<TC>(head_dim)) return decode_kernel<TQ, TC, true>(std::forward<Args>(args)...);
  decode_kernel<TQ, TC, false>(std::forward<Args>(args)...);
}

// f(T{}) for the floating type t names; anything else is an error naming `what`.
template <typename F>
void with_float_type(at::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, what, " must be fp32, bf16 or fp16, not ", t);
  }
}

// Shapes and every index the kernel will follow (S x W integers, microseconds): a bad table is an
// error, never a wild read.
// q [rows, H, hd] against caches [num_blocks, block_size, KVH, hd]: shapes, dtypes and layout.
void check_caches(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "the key and value caches must share a dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3), "head layout mismatch");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
}

// Sequence s of `table` [S, width] holds `len` keys: every block id it will follow is in the pool.
void check_table_row(const int64_t* table, int64_t s, int64_t width, int64_t len, const torch::Tensor& k_cache) {
  const int64_t bs = k_cache.size(1), num_blocks = k_cache.size(0);
  TORCH_CHECK(len >= 1 && len <= width * bs, "sequence length outside its block table");
  for (int64_t j = 0; j < (len + bs - 1) / bs; ++j)
    TORCH_CHECK(table[s * width + j] >= 0 && table[s * width + j] < num_blocks, "block id out of range");
}

// The int8 cache's fp16 scales [num_blocks, block_size, KVH], one per (slot, kv head).
void check_int8_scales(const torch::Tensor& k_cache, const torch::Tensor& k_scale, const torch::Tensor& v_scale) {
  TORCH_CHECK(k_cache.scalar_type() == at::kChar, "int8 caches expected");
  TORCH_CHECK(k_scale.scalar_type() == at::kHalf && v_scale.scalar_type() == at::kHalf, "fp16 scales expected");
  TORCH_CHECK(k_scale.dim() == 3 && k_scale.sizes() == k_cache.sizes().slice(0, 3) &&
                  v_scale.sizes() == k_scale.sizes(),
              "scales [num_blocks, block_size, KVH] expected");
  TORCH_CHECK(k_scale.is_contiguous() && v_scale.is_contiguous(), "scales must be contiguous");
}

void check_decode_args(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const torch::Tensor& block_table, const torch::Tensor& seq_lens) {
  check_caches(q, k_cache, v_cache);
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 indices");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == q.size(0) && seq_lens.numel() == q.size(0),
              "one block-table row and one length per sequence");
  const torch::Tensor table = block_table.contiguous(), lens = seq_lens.contiguous();
  const int64_t* lens_p = lens.data_ptr<int64_t>();
  const int64_t* table_p = table.data_ptr<int64_t>();
  for (int64_t s = 0; s < q.size(0); ++s) check_table_row(table_p, s, table.size(1), lens_p[s], k_cache);
}

}  // namespace

// q [S, H, hd] (heads back to back; any stride between sequences: the decoder stack passes a view of
// its fused q/k/v rows); k_cache, v_cache [num_blocks, block_size, KVH, hd] (fp32, bf16 or fp16, any
// under any q); block_table [S, W] int64; seq_lens [S] int64 (keys per sequence, the new token
// included); out [S, H, hd] contiguous, q's dtype.
static bool has_contiguous_heads(const torch::Tensor& q) { return q.stride(2) == 1 && q.stride(1) == q.size(2); }

// q with contiguous heads as is, any other q copied (the Python layers' entry points take any q).
static torch::Tensor with_contiguous_heads(const torch::Tensor& q) {
  return q.dim() == 3 && !has_contiguous_heads(q) ? q.contiguous() : q;
}

static void check_decode_out(const torch::Tensor& q, const torch::Tensor& out) {
  TORCH_CHECK(has_contiguous_heads(q), "q must have contiguous heads");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "out must be contiguous, shaped and typed like q");
}

void paged_decode_attention_out(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                const torch::Tensor& block_table, const torch::Tensor& seq_lens, double scale,
                                int64_t window, double softcap, torch::Tensor& out) {
  check_decode_args(q, k_cache, v_cache, block_table, seq_lens);
  check_decode_out(q, out);
  const torch::Tensor table = block_table.contiguous(), lens = seq_lens.contiguous();
  with_float_type(q.scalar_type(), "q", [&](auto tq) {
    using TQ = decltype(tq);
    with_float_type(k_cache.scalar_type(), "the caches", [&](auto tc) {
      using TC = decltype(tc);
      run_decode_kernel<TQ, TC>(q.size(2), q.data_ptr<TQ>(), k_cache.data_ptr<TC>(), v_cache.data_ptr<TC>(),
                                static_cast<const at::Half*>(nullptr), static_cast<const at::Half*>(nullptr),
                                table.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<TQ>(), q.size(0),
                                q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), table.size(1), scale, window,
                                softcap, q.stride(0));
    });
  });
}

// The cache entries a decode call may read (every sequence at its block table's full width), for
// ReleaseGilIfLong.
int64_t decode_work(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& block_table) {
  const int64_t row = k_cache.dim() == 4 ? k_cache.size(1) * k_cache.size(2) * k_cache.size(3) : 0;
  return q.size(0) * (block_table.dim() == 2 ? block_table.size(1) : 0) * row;
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor seq_lens, double scale,
                                     int64_t window, double softcap) {
  const tokenmill_capi::ReleaseGilIfLong gil(decode_work(q, k_cache, block_table));
  q = with_contiguous_heads(q);
  auto out = torch::empty(q.sizes(), q.options());
  paged_decode_attention_out(q, k_cache, v_cache, block_table, seq_lens, scale, window, softcap, out);
  return out;
}

// Prefill attention (kernels/prefill_avx512.h; AVX-512 builds only: elsewhere the Python layer keeps
// gather + SDPA). q [T, H, hd]: the query rows of S sequences back to back (any row stride; heads
// contiguous); caches fp32, bf16 or fp16 [num_blocks, block_size, KVH, hd]; block_table [S, W] int64;
// seq_lens [S]: keys per sequence after this step; query_lens [S]: its queries are its last query_lens
// positions; window > 0: a query at p sees keys (p - window, p]. out [T, H, hd] contiguous, q's dtype.
// k_scale / v_scale: the int8 cache's [num_blocks, block_size, KVH] fp16 scales (undefined for dense caches).
static void prefill_attention_impl(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                   const torch::Tensor& k_scale, const torch::Tensor& v_scale,
                                   const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                                   const torch::Tensor& query_lens, double scale, int64_t window, torch::Tensor& out) {
#if defined(TM_AVX512)
  check_caches(q, k_cache, v_cache);
  TORCH_CHECK(q.size(2) % 16 == 0, "head layout mismatch (head_dim must be a multiple of 16)");
  check_decode_out(q, out);
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_lens.scalar_type() == at::kLong, "int64 indices");
  TORCH_CHECK(block_table.dim() == 2 && seq_lens.numel() == block_table.size(0) &&
                  query_lens.numel() == block_table.size(0), "one block-table row, length and query count per sequence");
  const torch::Tensor table = block_table.contiguous(), lens = seq_lens.contiguous(), qlens = query_lens.contiguous();
  const int64_t* lens_p = lens.data_ptr<int64_t>();
  const int64_t* qlens_p = qlens.data_ptr<int64_t>();
  const int64_t* table_p = table.data_ptr<int64_t>();
  const int64_t width = table.size(1), bs = k_cache.size(1);
  std::vector<prefill::Seq> seqs;
  int64_t rows = 0;
  for (int64_t s = 0; s < table.size(0); ++s) {
    const int64_t len = lens_p[s], nq = qlens_p[s];
    TORCH_CHECK(nq >= 1 && nq <= len, "sequence length outside its block table");
    check_table_row(table_p, s, width, len, k_cache);
    const int64_t k0 = window > 0 ? std::max<int64_t>(0, len - nq - window + 1) : 0;
    seqs.push_back({rows, nq, len, k0});
    rows += nq;
  }
  TORCH_CHECK(rows == q.size(0), "q must hold every sequence's query rows");
  with_float_type(q.scalar_type(), "q", [&](auto tq) {
    using TQ = decltype(tq);
    if (k_scale.defined()) {
      check_int8_scales(k_cache, k_scale, v_scale);
      return prefill::attention<TQ, int8_t>(q.data_ptr<TQ>(), q.stride(0), k_cache.data_ptr<int8_t>(),
                                            v_cache.data_ptr<int8_t>(), k_scale.data_ptr<at::Half>(),
                                            v_scale.data_ptr<at::Half>(), table_p, width, seqs, q.size(1),
                                            k_cache.size(2), q.size(2), bs, static_cast<float>(scale), window,
                                            out.data_ptr<TQ>());
    }
    with_float_type(k_cache.scalar_type(), "the caches", [&](auto tc) {
      using TC = decltype(tc);
      prefill::attention<TQ, TC>(q.data_ptr<TQ>(), q.stride(0), k_cache.data_ptr<TC>(), v_cache.data_ptr<TC>(),
                                 nullptr, nullptr, table_p, width, seqs, q.size(1), k_cache.size(2), q.size(2), bs,
                                 static_cast<float>(scale), window, out.data_ptr<TQ>());
    });
  });
#else
  (void)q, (void)k_cache, (void)v_cache, (void)k_scale, (void)v_scale, (void)block_table, (void)seq_lens,
      (void)query_lens, (void)scale, (void)window, (void)out;
  TORCH_CHECK(false, "paged prefill attention needs an AVX-512 build of the CPU kernels");
#endif
}

// The int8 cache (k_scale, v_scale [num_blocks, block_size, KVH] fp16) or a dense one (scales undefined).
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_table, torch::Tensor seq_lens, torch::Tensor query_lens,
                                      double scale, int64_t window, c10::optional<torch::Tensor> k_scale,
                                      c10::optional<torch::Tensor> v_scale) {
  // q elements x table keys: the multiply-adds, to within the head-group factor
  const tokenmill_capi::ReleaseGilIfLong gil(q.numel() * block_table.size(-1) * k_cache.size(1));
  TORCH_CHECK(k_scale.has_value() == v_scale.has_value(), "both scales or neither");
  q = with_contiguous_heads(q);
  auto out = torch::empty(q.sizes(), q.options());
  prefill_attention_impl(q, k_cache, v_cache, k_scale.value_or(torch::Tensor()), v_scale.value_or(torch::Tensor()),
                         block_table, seq_lens, query_lens, scale, window, out);
  return out;
}

// The int8 cache: k_cache, v_cache int8 as above; k_scale, v_scale [num_blocks, block_size, KVH] fp16.
void paged_decode_attention_int8_out(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& k_scale,
                                     const torch::Tensor& v_scale, const torch::Tensor& block_table,
                                     const torch::Tensor& seq_lens, double scale, int64_t window, double softcap,
                                     torch::Tensor& out) {
  check_decode_args(q, k_cache, v_cache, block_table, seq_lens);
  check_decode_out(q, out);
  check_int8_scales(k_cache, k_scale, v_scale);
  const torch::Tensor table = block_table.contiguous(), lens = seq_lens.contiguous();
  with_float_type(q.scalar_type(), "q", [&](auto tq) {
    using TQ = decltype(tq);
    run_decode_kernel<TQ, int8_t>(q.size(2), q.data_ptr<TQ>(), k_cache.data_ptr<int8_t>(),
                                  v_cache.data_ptr<int8_t>(), k_scale.data_ptr<at::Half>(), v_scale.data_ptr<at::Half>(),
                                  table.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<TQ>(), q.size(0),
                                  q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), table.size(1), scale, window,
                                  softcap, q.stride(0));
  });
}

torch::Tensor paged_decode_attention_int8(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                          torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor block_table,
                                          torch::Tensor seq_lens, double scale, int64_t window, double softcap) {
  const tokenmill_capi::ReleaseGilIfLong gil(decode_work(q, k_cache, block_table));
  q = with_contiguous_heads(q);
  auto out = torch::empty(q.sizes(), q.options());
  paged_decode_attention_int8_out(q, k_cache, v_cache, k_scale, v_scale, block_table, seq_lens, scale, window,
                                  softcap, out);
  return out;
}


// The rows a KV write reads and the slots it writes, checked: k and v [T, KVH, hd] of one dtype
// with contiguous heads, slots contiguous int64 [T], each inside the cache. Returns the slots.
const int64_t* check_write_rows(const char* op, const torch::Tensor& k_cache, const torch::Tensor& slots,
                                const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t T = slots.numel(), kvh = k_cache.size(2), hd = k_cache.size(3);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (const torch::Tensor* x : {&k, &v})
    TORCH_CHECK(x->dim() == 3 && x->size(0) == T && x->size(1) == kvh && x->size(2) == hd && x->stride(2) == 1 &&
                    x->stride(1) == hd && x->scalar_type() == k.scalar_type(),
                op, ": k and v must be [T, KVH, hd] of one dtype with contiguous heads");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              op, ": slots must be contiguous int64 [T]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, op, ": slot out of range");
  return sp;
}

// ---------------------------------------------------------------------------------------------
// KV write: k, v [T, KVH, hd] (rows of heads back to back; any stride between tokens) into the
// caches [num_blocks, block_size, KVH, hd] at flat slots [T]. Every slot is checked before any write.
void kv_write(torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& slots, const torch::Tensor& k,
              const torch::Tensor& v) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "kv_write: contiguous caches [num_blocks, block_size, KVH, hd] of one dtype expected");
  const int64_t T = slots.numel(), row = k_cache.size(2) * k_cache.size(3);
  const int64_t* sp = check_write_rows("kv_write", k_cache, slots, k, v);
  with_float_type(k.scalar_type(), "k", [&](auto tx) {
    using TX = decltype(tx);
    with_float_type(k_cache.scalar_type(), "the caches", [&](auto tc) {
      using TC = decltype(tc);
      for (int pass = 0; pass < 2; ++pass) {
        const torch::Tensor& x = pass == 0 ? k : v;
        const TX* src = x.data_ptr<TX>();
        TC* dst = (pass == 0 ? k_cache : v_cache).data_ptr<TC>();
        for (int64_t t = 0; t < T; ++t) {
          const TX* from = src + t * x.stride(0);
          TC* to = dst + sp[t] * row;
          if constexpr (std::is_same_v<TX, TC>) {
            std::memcpy(to, from, row * sizeof(TC));
          } else {
            for (int64_t i = 0; i < row; ++i) to[i] = static_cast<TC>(static_cast<float>(from[i]));
          }
        }
      }
    });
  });
}

// The int8 cache's write: each token's k/v head rows quantized symmetrically, q = round(x / s) with
// s = fp16(max|x| / 127) (the scale every reader sees, so q is computed against the rounded scale),
// exactly as kv_cache.quantize_int8 does in torch: the same fp32 operations in the same order, ties
// to even, so both paths store the same bytes. k_scale, v_scale [num_blocks, block_size, KVH] fp16.
// Smoothing (layers/kv_smoothing.py): with k_shift μ and k_inv_sigma σ⁻¹ ([KVH, hd] float32, both or
// neither) a key row is quantized as x_d = (k_d − μ_d) · σ⁻¹_d, the fp32 subtract then the fp32
// multiply of ChannelSmoothing.normalize (no add follows the multiply, so nothing can contract into
// an FMA on one path only); readers multiply the queries by σ. Values likewise with v_shift ν and
// v_inv_sigma τ⁻¹; readers map the attention output back as o · τ + ν.
void kv_write_int8(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k_scale, torch::Tensor v_scale,
                   const torch::Tensor& slots, const torch::Tensor& k, const torch::Tensor& v,
                   const c10::optional<torch::Tensor>& k_shift, const c10::optional<torch::Tensor>& k_inv_sigma,
                   const c10::optional<torch::Tensor>& v_shift, const c10::optional<torch::Tensor>& v_inv_sigma) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar,
              "kv_write_int8: contiguous int8 caches [num_blocks, block_size, KVH, hd] expected");
  TORCH_CHECK(k_scale.scalar_type() == at::kHalf && v_scale.scalar_type() == at::kHalf && k_scale.is_contiguous() &&
                  v_scale.is_contiguous() && k_scale.sizes() == k_cache.sizes().slice(0, 3) &&
                  v_scale.sizes() == k_scale.sizes(),
              "kv_write_int8: contiguous fp16 scales [num_blocks, block_size, KVH] expected");
  const int64_t T = slots.numel(), kvh = k_cache.size(2), hd = k_cache.size(3);
  // Per pass (keys, values): the smoothing's shift and inverse spread, or null.
  const float* shifts[2] = {nullptr, nullptr};
  const float* inv_sigmas[2] = {nullptr, nullptr};
  const c10::optional<torch::Tensor>* given[2][2] = {{&k_shift, &k_inv_sigma}, {&v_shift, &v_inv_sigma}};
  for (int pass = 0; pass < 2; ++pass) {
    const c10::optional<torch::Tensor>& sh = *given[pass][0];
    const c10::optional<torch::Tensor>& inv = *given[pass][1];
    TORCH_CHECK(sh.has_value() == inv.has_value(), "kv_write_int8: a shift and its inverse spread go together");
    if (!sh.has_value()) continue;
    for (const torch::Tensor* p : {&*sh, &*inv})
      TORCH_CHECK(p->scalar_type() == at::kFloat && p->is_contiguous() && p->dim() == 2 && p->size(0) == kvh &&
                      p->size(1) == hd && p->device() == k_cache.device(),
                  "kv_write_int8: shifts and inverse spreads must be contiguous float32 [KVH, hd]");
    shifts[pass] = sh->data_ptr<float>();
    inv_sigmas[pass] = inv->data_ptr<float>();
  }
  const int64_t* sp = check_write_rows("kv_write_int8", k_cache, slots, k, v);
  with_float_type(k.scalar_type(), "k", [&](auto tx) {
    using TX = decltype(tx);
    std::vector<float> xf(hd);
    for (int pass = 0; pass < 2; ++pass) {
      const torch::Tensor& x = pass == 0 ? k : v;
      const TX* src = x.data_ptr<TX>();
      int8_t* dst = (pass == 0 ? k_cache : v_cache).data_ptr<int8_t>();
      at::Half* scales = (pass == 0 ? k_scale : v_scale).data_ptr<at::Half>();
      const float* shift = shifts[pass];
      const float* inv_sigma = inv_sigmas[pass];
      const bool smooth = shift != nullptr;
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < kvh; ++h) {
          const TX* from = src + t * x.stride(0) + h * hd;
          float amax = 0.f;
          for (int64_t i = 0; i < hd; ++i) {
            xf[i] = static_cast<float>(from[i]);
            if (smooth) xf[i] = (xf[i] - shift[h * hd + i]) * inv_sigma[h * hd + i];
            amax = std::max(amax, std::fabs(xf[i]));
          }
          const at::Half scale = static_cast<at::Half>(std::min(amax / 127.f, 65504.f));
          const float inv = 1.f / std::max(static_cast<float>(scale), 0x1p-24f);
          int8_t* to = dst + (sp[t] * kvh + h) * hd;
          for (int64_t i = 0; i < hd; ++i)
            to[i] = static_cast<int8_t>(std::clamp(std::nearbyint(xf[i] * inv), -127.f, 127.f));
          scales[sp[t] * kvh + h] = scale;
        }
      }
    }
  });
}

// y [..., I] = silu(g) * u where gate_up [..., 2I] = [g | u], float32; silu(g) = g / (1 + exp(-g)).
inline void silu_mul_row(const float* g, const float* u, float* y, int64_t n) {
  int64_t i = 0;
#if defined(TM_AVX2)
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_sub_ps(zero, x));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) y[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// out [..., I] contiguous float32 (the decoder stack passes a buffer it reuses).
void silu_mul_out(const torch::Tensor& gate_up, torch::Tensor& out) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.is_contiguous() && gate_up.dim() >= 1 &&
                  gate_up.size(-1) % 2 == 0,
              "silu_mul: gate_up must be contiguous float32 [..., 2 * intermediate]");
  const int64_t I = gate_up.size(-1) / 2, M = I == 0 ? 0 : gate_up.numel() / (2 * I);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == gate_up.dim() &&
                  out.size(-1) == I && out.numel() == M * I,
              "silu_mul: out must be contiguous float32 [..., intermediate]");
  const float* gp = gate_up.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, I)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) silu_mul_row(gp + m * 2 * I, gp + m * 2 * I + I, yp + m * I, I);
  });
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  const tokenmill_capi::ReleaseGilIfLong gil(gate_up.numel());
  std::vector<int64_t> sizes = gate_up.sizes().vec();
  TORCH_CHECK(!sizes.empty(), "silu_mul: gate_up must have a feature dimension");
  sizes.back() /= 2;
  torch::Tensor y = torch::empty(sizes, gate_up.options());
  silu_mul_out(gate_up, y);
  return y;
}

// ---------------------------------------------------------------------------------------------
// Greedy sampling's argmax over each row of logits [N, V] float32: the index of the largest value,
// the first one on ties and the first NaN if the row has any (torch.argmax's answer). ATen's CPU
// argmax carries an index per element and ran ~340 us for one 151936-wide row here (Qwen's
// vocabulary) against ~30 us for the max alone; this is the max as a vector reduction, then a
// vector scan for the first element equal to it.
// The largest non-NaN value of x[0, n) (-inf where there is none), and whether x holds a NaN: four
// independent max chains (one running max is a chain of dependent maxes, ~0.14 ms a 151,936 row).
static float row_max(const float* x, int64_t n, bool* has_nan) {
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if defined(TM_AVX2)
  __m256 m[4], unordered = _mm256_setzero_ps();
  for (auto& v : m) v = _mm256_set1_ps(best);
  for (; i + 32 <= n; i += 32) {
    for (int u = 0; u < 4; ++u) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * u);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      m[u] = _mm256_max_ps(v, m[u]);  // a NaN in v yields m[u]
    }
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
  for (float v : lanes) best = std::max(best, v);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < n; ++i) {
    if (std::isnan(x[i])) nan = true;
    else if (x[i] > best) best = x[i];
  }
  *has_nan = nan;
  return best;
}

static int64_t argmax_row(const float* x, int64_t n) {
  bool has_nan = false;
  const float best = row_max(x, n, &has_nan);  // NaNs are found by the scan below
  int64_t j = 0;
#if defined(TM_AVX2)
  const __m256 target = _mm256_set1_ps(best);
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    const int hit = _mm256_movemask_ps(has_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
    if (hit) return j + __builtin_ctz(static_cast<unsigned>(hit));
  }
#endif
  for (; j < n; ++j)
    if (has_nan ? std::isnan(x[j]) : x[j] == best) return j;
  return 0;
}

torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0,
              "argmax_rows: x must be contiguous float32 [N, V] with V > 0");
  const int64_t N = x.size(0), V = x.size(1);
  const tokenmill_capi::ReleaseGilIfLong gil(N * V);
  torch::Tensor out = torch::empty({N}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * V, V);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Sampling's inverse-CDF draw over rows of logits [N, V] float32 (engine/distributions.py): row r's
// weights w_i = exp((x_i - max x) / T_r) (a -inf logit, masked by a grammar or min_tokens, exactly 0),
// cut to its top-k tokens and then to the smallest most-likely-first set whose mass reaches top_p of
// theirs, zeroed below min_p (the top weight is 1), and the first index whose running sum exceeds
// u_r × Σ w. The cut needs no sort of the row: weights in (0, 1] order like their float bits, so a
// histogram of count and mass over the top 12 bits (1/16 of an octave a bucket) finds the one bucket
// the cut falls in, and only that bucket's tokens are sorted (by weight, then id). Sums are float64
// over blocks of 8 weights, the running sum the same sequence of block sums, so a target below the total
// lands on a token of positive weight (a zero never raises the sum); a target rounded up to the total
// falls back to the last positive weight. Torch ops took ~0.6 ms for a whole 151,936-wide row and
// ~0.45 ms for a top-p cut (topk, logsumexp, gathers); this is a handful of passes over the row in L2.
struct SampleScratch {
  std::vector<float> w;
  std::vector<double> blocks;
  std::vector<int64_t> count;
  std::vector<double> mass;
  std::vector<std::pair<float, int64_t>> edge;
};

constexpr int kSampleBucketShift = 19;  // float bits >> 19: sign, exponent and 4 mantissa bits
constexpr int64_t kSampleBuckets = (0x3F800000 >> kSampleBucketShift) + 1;  // weights in [0, 1]
// Weights below 2^-24 (a token 1.6e7 times less likely than the top one) are first binned together, in
// the rest bucket: most of a vocabulary sits there, and a block of eight of them takes one vector compare.
// A cut that reaches them (top-k past the tokens above the floor; top-p near 1 on a flat row) re-bins
// them at full resolution (cut_weights' refine), so it stays exact.
constexpr uint32_t kSampleFloorBits = 0x33800000;  // 2^-24
constexpr int64_t kSampleRest = kSampleFloorBits >> kSampleBucketShift;

inline int64_t weight_bucket(float w) {
  uint32_t bits;
  std::memcpy(&bits, &w, sizeof bits);
  return std::clamp<int64_t>(static_cast<int64_t>(bits >> kSampleBucketShift), kSampleRest, kSampleBuckets - 1);
}

inline float bucket_floor(int64_t bucket) {  // the least weight of a bucket above the rest
  const uint32_t bits = static_cast<uint32_t>(bucket) << kSampleBucketShift;
  float w;
  std::memcpy(&w, &bits, sizeof w);
  return w;
}

// Indices of the weights in [lo, hi), sorted by weight (descending), then id, into s.edge.
static void sorted_edge(const float* w, int64_t n, float lo, float hi, SampleScratch& s) {
  s.edge.clear();
  int64_t i = 0;
#if defined(TM_AVX2)
  const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(w + i);
    unsigned hit = static_cast<unsigned>(_mm256_movemask_ps(
        _mm256_and_ps(_mm256_cmp_ps(v, vlo, _CMP_GE_OQ), _mm256_cmp_ps(v, vhi, _CMP_LT_OQ))));
    for (; hit; hit &= hit - 1) {
      const int64_t j = i + __builtin_ctz(hit);
      s.edge.emplace_back(w[j], j);
    }
  }
#endif
  for (; i < n; ++i)
    if (w[i] >= lo && w[i] < hi) s.edge.emplace_back(w[i], i);
  std::sort(s.edge.begin(), s.edge.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
}

// Zero every weight outside the top-k / top-p cut (the tokens kept keep their weight).
static void cut_weights(float* w, int64_t n, int64_t top_k, float top_p, SampleScratch& s) {
  s.count.assign(kSampleBuckets, 0);
  s.mass.assign(kSampleBuckets, 0.0);
  const float floor_w = bucket_floor(kSampleRest + 1);
  auto bin = [&](size_t bucket, float weight) {
    s.count[bucket] += 1;
    s.mass[bucket] += weight;
  };
  int64_t i = 0;
#if defined(TM_AVX2)
  const __m256 vfloor = _mm256_set1_ps(floor_w);
  __m256d rest = _mm256_setzero_pd();
  int64_t rest_count = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(w + i);
    const unsigned big = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(v, vfloor, _CMP_GE_OQ)));
    if (big == 0) {  // eight weights of the rest
      rest = _mm256_add_pd(rest, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)),
                                               _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1))));
      rest_count += 8;
      continue;
    }
    for (int l = 0; l < 8; ++l) bin(static_cast<size_t>(weight_bucket(w[i + l])), w[i + l]);
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, rest);
  s.count[kSampleRest] += rest_count;
  s.mass[kSampleRest] += (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
  for (; i < n; ++i) bin(static_cast<size_t>(weight_bucket(w[i])), w[i]);
  auto edge_of = [&](int64_t bucket) { sorted_edge(w, n, bucket_floor(bucket), bucket_floor(bucket + 1), s); };
  // A walk that reaches the rest (a top-k of more tokens than lie above the floor: common for small k on
  // a peaked row) bins the weights below the floor at full resolution first, one more pass, so that only
  // the bucket the cut falls in is sorted (sorting the rest, ~150,000 tokens, took ~10 ms).
  bool refined = false;
  auto refine = [&]() {
    if (refined) return;
    refined = true;
    for (int64_t b = 0; b <= kSampleRest; ++b) {
      s.count[static_cast<size_t>(b)] = 0;
      s.mass[static_cast<size_t>(b)] = 0.0;
    }
    for (int64_t j = 0; j < n; ++j) {
      if (w[j] >= floor_w) continue;
      uint32_t bits;
      std::memcpy(&bits, &w[j], sizeof bits);
      bin(std::min<size_t>(bits >> kSampleBucketShift, kSampleRest), w[j]);
    }
  };
  // top-k: buckets above kb whole, then the first k_left of bucket kb (in s.edge order).
  int64_t kb = -1, k_left = 0;
  double z = 0.0;  // mass of the top-k set
  if (top_k < n) {
    int64_t above = 0;
    for (int64_t b = kSampleBuckets - 1; b >= 0; --b) {
      if (b == kSampleRest) refine();
      if (above + s.count[static_cast<size_t>(b)] >= top_k) {
        kb = b;
        k_left = top_k - above;
        break;
      }
      above += s.count[static_cast<size_t>(b)];
      z += s.mass[static_cast<size_t>(b)];
    }
    edge_of(kb);
    k_left = std::min<int64_t>(k_left, static_cast<int64_t>(s.edge.size()));  // equal unless the bins disagree
    for (int64_t j = 0; j < k_left; ++j) z += s.edge[static_cast<size_t>(j)].first;
  } else {
    for (int64_t b = 0; b < kSampleBuckets; ++b) z += s.mass[static_cast<size_t>(b)];
  }
  int64_t cut_bucket = kb;  // tokens of buckets above it are kept whole; of it, the first `keep` of s.edge
  int64_t keep = k_left;
  if (top_p < 1.f) {
    const double target = static_cast<double>(top_p) * z;
    double before = 0.0;
    for (int64_t b = kSampleBuckets - 1; b >= 0; --b) {
      if (b == kSampleRest) refine();
      const bool partial = b == kb;
      double bucket_mass = s.mass[static_cast<size_t>(b)];
      if (partial) {
        bucket_mass = 0.0;
        for (int64_t j = 0; j < k_left; ++j) bucket_mass += s.edge[static_cast<size_t>(j)].first;
      }
      if (before + bucket_mass >= target || partial) {  // the cut falls in this bucket (or top-k ends here)
        if (!partial) edge_of(b);
        const int64_t limit = partial ? k_left : static_cast<int64_t>(s.edge.size());
        keep = 0;
        while (keep < limit && before < target) before += s.edge[static_cast<size_t>(keep++)].first;
        cut_bucket = b;
        break;
      }
      before += bucket_mass;
    }
  }
  // No top-k and a top-p walk that met its target only with every token (p within rounding of 1): no cut.
  if (cut_bucket < 0) return;
  std::vector<float> kept_w(static_cast<size_t>(keep));
  for (int64_t j = 0; j < keep; ++j) kept_w[static_cast<size_t>(j)] = s.edge[static_cast<size_t>(j)].first;
  const float cut_w = bucket_floor(cut_bucket + 1);  // everything below it goes (bar the kept edge)
  i = 0;
#if defined(TM_AVX2)
  const __m256 vcut = _mm256_set1_ps(cut_w);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(w + i);
    _mm256_storeu_ps(w + i, _mm256_andnot_ps(_mm256_cmp_ps(v, vcut, _CMP_LT_OQ), v));
  }
#endif
  for (; i < n; ++i)
    if (w[i] < cut_w) w[i] = 0.f;
  for (int64_t j = 0; j < keep; ++j) w[s.edge[static_cast<size_t>(j)].second] = kept_w[static_cast<size_t>(j)];
}

// The row's weights in s.w (padded to whole blocks of 8 with zeros): exp((x - max) / T), cut, min-p.
static void sample_weights_row(const float* x, int64_t n, float inv_temp, int64_t top_k, float top_p, float min_p,
                               SampleScratch& s) {
  bool has_nan = false;
  const float mx = row_max(x, n, &has_nan);  // NaN logits weigh 0 below
  const int64_t nb = (n + 7) / 8;
  s.w.resize(static_cast<size_t>(nb * 8));
  s.blocks.resize(static_cast<size_t>(nb));
  float* w = s.w.data();
  int64_t i = 0;
#if defined(TM_AVX2)
  const __m256 vmx = _mm256_set1_ps(mx), vt = _mm256_set1_ps(inv_temp);
  const __m256 floor = _mm256_set1_ps(cephes::kMin);
  for (; i + 8 <= n; i += 8) {
    const __m256 arg = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmx), vt);
    // Past exp8's clamp (a -inf logit) or NaN: exactly 0.
    _mm256_storeu_ps(w + i, _mm256_andnot_ps(_mm256_cmp_ps(arg, floor, _CMP_NGE_UQ), exp8(arg)));
  }
#endif
  for (; i < nb * 8; ++i) {
    const float arg = i < n ? (x[i] - mx) * inv_temp : -std::numeric_limits<float>::infinity();
    w[i] = arg >= cephes::kMin ? std::exp(arg) : 0.f;  // NaN: 0
  }
  if (top_k < n || top_p < 1.f) cut_weights(w, n, top_k, top_p, s);
  if (min_p > 0.f)
    for (int64_t j = 0; j < n; ++j) w[j] = w[j] < min_p ? 0.f : w[j];
}

static int64_t sample_row(const float* x, int64_t n, float inv_temp, int64_t top_k, float top_p, float min_p,
                          double u, SampleScratch& s) {
  sample_weights_row(x, n, inv_temp, top_k, top_p, min_p, s);
  const int64_t nb = (n + 7) / 8;
  const float* w = s.w.data();
  // Each block's sum as a tree (independent across blocks, so the adds overlap; a running sum over all
  // 151,936 weights was a chain of dependent adds, ~0.14 ms alone). The search below adds a block's
  // weights one by one: where that lands an ulp off the tree, the block is passed over and the next
  // positive weight taken, a shift of ~1e-16 in probability.
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    const float* q = w + 8 * b;
    const double sum = ((static_cast<double>(q[0]) + q[1]) + (static_cast<double>(q[2]) + q[3])) +
                       ((static_cast<double>(q[4]) + q[5]) + (static_cast<double>(q[6]) + q[7]));
    s.blocks[static_cast<size_t>(b)] = sum;
    total += sum;
  }
  const double target = u * total;
  double running = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    const double next = running + s.blocks[static_cast<size_t>(b)];
    if (next > target) {
      double r = running;
      for (int l = 0; l < 8; ++l) {
        r += w[8 * b + l];
        if (r > target) return 8 * b + l;
      }
    }
    running = next;
  }
  for (int64_t j = n - 1; j > 0; --j)
    if (w[j] > 0.f) return j;
  return 0;
}

torch::Tensor sample_rows(const torch::Tensor& x, const torch::Tensor& temps, const torch::Tensor& top_ks,
                          const torch::Tensor& top_ps, const torch::Tensor& min_ps, const torch::Tensor& uniforms) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0,
              "sample_rows: x must be contiguous float32 [N, V] with V > 0");
  const int64_t N = x.size(0), V = x.size(1);
  TORCH_CHECK(temps.numel() == N && top_ks.numel() == N && top_ps.numel() == N && min_ps.numel() == N &&
              uniforms.numel() == N, "sample_rows: one value a row");
  const auto t = temps.to(at::kFloat).contiguous(), mp = min_ps.to(at::kFloat).contiguous();
  const auto tk = top_ks.to(at::kLong).contiguous(), tp = top_ps.to(at::kFloat).contiguous();
  const auto u = uniforms.to(at::kDouble).contiguous();
  const tokenmill_capi::ReleaseGilIfLong gil(N * V);
  torch::Tensor out = torch::empty({N}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    SampleScratch scratch;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t k = tk.data_ptr<int64_t>()[r];
      op[r] = sample_row(xp + r * V, V, 1.f / t.data_ptr<float>()[r], k > 0 && k < V ? k : V, tp.data_ptr<float>()[r],
                         mp.data_ptr<float>()[r], u.data_ptr<double>()[r], scratch);
    }
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

// out [M, N] contiguous float32 (the decoder stack passes a buffer it reuses).
void skinny_linear_out(const torch::Tensor& x_in, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                       torch::Tensor& out) {
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(1), "x [M, K] and W [N, K] expected");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(x_in.size(0) >= 1 && x_in.size(0) <= 4, "1 to 4 rows");
  TORCH_CHECK(w.is_contiguous(), "W must be contiguous");
  const torch::Tensor x = x_in.contiguous();
  const float* b = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.scalar_type() == at::kFloat && bias_c.numel() == w.size(0), "bias [N] fp32 expected");
    b = bias_c.data_ptr<float>();
  }
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == m &&
                  out.size(1) == n, "out must be contiguous float32 [M, N]");
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = out.data_ptr<float>();
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
}

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x [M, K] and W [N, K] expected");
  const tokenmill_capi::ReleaseGilIfLong gil(w.numel());
  auto y = torch::empty({x.size(0), w.size(0)}, x.options().dtype(at::kFloat));
  skinny_linear_out(x, w, bias, y);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("decode_chunks", [](int64_t keys, int64_t threads, int64_t key_bytes) {
    std::vector<int64_t> lens;
    const int64_t chunk = decode_chunk_len(keys, threads, key_bytes);
    for (int64_t t0 = 0; t0 < keys; t0 += chunk) lens.push_back(std::min(chunk, keys - t0));
    return lens;
  }, "the key counts of the chunks paged decode attention splits one sequence into (tests)");
  m.def("set_decode_split_threads", [](int64_t threads) {
    TORCH_CHECK(threads >= 0, "split threads must be >= 0");
    return g_split_threads.exchange(threads);
  }, "fix the thread count decode attention splits a sequence's keys for (0: the running count); returns the old one");
  m.def("decode_split_threads", [] { return split_threads(); }, "the thread count decode attention splits keys for");
  m.def("set_wide_attention", [](bool wide) { return g_wide_attention.exchange(wide); },
        "take the AVX-512 attention kernels where built (True, the default): decode tiles and the prefill kernel; "
        "False: the AVX2 decode tiles and no native prefill; returns the old setting");
  m.def("wide_attention_built", [] {
#if defined(TM_AVX512)
    return true;
#else
    return false;
#endif
  }, "whether this build has the AVX-512 attention kernels");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of each sequence's last query_lens positions over its paged keys, read in place; "
        "k_scale / v_scale for an int8 cache (CPU, AVX-512 builds)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_table"),
        pybind11::arg("seq_lens"), pybind11::arg("query_lens"), pybind11::arg("scale"), pybind11::arg("window"),
        pybind11::arg("k_scale") = pybind11::none(), pybind11::arg("v_scale") = pybind11::none());
  m.def("prefill_attention_available", [] {
#if defined(TM_AVX512)
    return g_wide_attention.load();
#else
    return false;
#endif
  }, "whether paged_prefill_attention runs here: an AVX-512 build with the wide kernels on");
  m.def("paged_decode_attention_int8", &paged_decode_attention_int8,
        "paged decode attention over an int8 KV cache with fp16 scales per (slot, kv head) (CPU)");
  // kv_write and kv_write_int8 are C API entry points too (called there without the GIL): the GIL
  // is released here, in the Python binding only.
  m.def("kv_write", [](torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& slots, const torch::Tensor& k,
                       const torch::Tensor& v) {
    const tokenmill_capi::ReleaseGilIfLong gil(2 * k.numel());
    kv_write(k_cache, v_cache, slots, k, v);
  }, "k, v [T, KVH, hd] into the paged caches at flat slots [T], dtype-converted (CPU)");
  m.def("kv_write_int8", [](torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k_scale, torch::Tensor v_scale,
                            const torch::Tensor& slots, const torch::Tensor& k, const torch::Tensor& v,
                            const c10::optional<torch::Tensor>& k_shift, const c10::optional<torch::Tensor>& k_inv_sigma,
                            const c10::optional<torch::Tensor>& v_shift, const c10::optional<torch::Tensor>& v_inv_sigma) {
    const tokenmill_capi::ReleaseGilIfLong gil(2 * k.numel());
    kv_write_int8(k_cache, v_cache, k_scale, v_scale, slots, k, v, k_shift, k_inv_sigma, v_shift, v_inv_sigma);
  },
        "k, v [T, KVH, hd] quantized to int8 with an fp16 scale per (token, head) into the int8 caches; keys "
        "as (k - k_shift) * k_inv_sigma and values as (v - v_shift) * v_inv_sigma when given (CPU)",
        pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("k_scale"), pybind11::arg("v_scale"),
        pybind11::arg("slots"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("k_shift") = pybind11::none(),
        pybind11::arg("k_inv_sigma") = pybind11::none(), pybind11::arg("v_shift") = pybind11::none(),
        pybind11::arg("v_inv_sigma") = pybind11::none());
  m.def("silu_mul", &silu_mul, "silu(gate) * up from [..., 2I] = [gate | up], float32 (CPU)");
  m.def("skinny_linear", &skinny_linear, "y = x W^T + b for 1-4 rows of x, fp32, threads over W's rows (CPU)");
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=-1) for contiguous float32 [N, V], vectorised (CPU)");
  m.def("sample_weights", [](const torch::Tensor& x, double temp, int64_t top_k, double top_p, double min_p) {
    TORCH_CHECK(x.dim() == 1 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(0) > 0,
                "sample_weights: x must be contiguous float32 [V]");
    const int64_t V = x.size(0);
    SampleScratch scratch;
    sample_weights_row(x.data_ptr<float>(), V, static_cast<float>(1.0 / temp), top_k > 0 && top_k < V ? top_k : V,
                       static_cast<float>(top_p), static_cast<float>(min_p), scratch);
    return torch::from_blob(scratch.w.data(), {V}, torch::kFloat).clone();
  }, "the weights sample_rows draws one row from, cut and min-p applied (tests)");
  m.def("sample_rows", &sample_rows,
        "each row's token by inverse CDF over exp((x - max) / T) cut to top-k, then top-p, then min-p, with its "
        "uniform (float32 [N, V]; temps, top_ks, top_ps, min_ps, uniforms [N]; CPU)");
  m.def("c_api", [] {
    pybind11::dict api;
    TM_CAPI_ENTRY(api, KvWrite, kv_write);
    TM_CAPI_ENTRY_V(api, KvWriteInt8, kv_write_int8, 3);
    TM_CAPI_ENTRY(api, DecodeOut, paged_decode_attention_out);
    TM_CAPI_ENTRY(api, DecodeInt8Out, paged_decode_attention_int8_out);
    TM_CAPI_ENTRY(api, SiluMulOut, silu_mul_out);
    TM_CAPI_ENTRY(api, SkinnyOut, skinny_linear_out);
    return api;
  }, "the entry points as C function pointers (c_api.h), for stack_kernels.cpp");
}
