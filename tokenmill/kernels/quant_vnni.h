// The AVX-512 VNNI tiles of quant_kernels.cpp (included there, inside its anonymous namespace, after
// the shared definitions: Weights, Act, prefetch_ahead, the TM_SIMD_TILES macro, the constants):
// the 256-bit tiles stamped out with vpdpwssd, the duo tiles for 1-8 activation rows, the 512-bit
// tiles over two row groups, and for q8 the four-group tiles of 8 rows. Every tile takes the 256-bit tile's integer sums and float steps in order,
// so all of them give the same bits (tests/unit/test_quant_kernels.py). Layout and measurements:
// docs/quantization.md.
#pragma once

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace vnni {
constexpr bool kSplitChains = true;
constexpr bool kByteBits = false;  // high bits through add_bit's masked adds (see avx2::kByteBits)
constexpr int64_t kPanelRows = 0;  // no panels: a masked add makes a q5 chunk nearly q8's cost (avx2::kPanelRows)
inline __m256i madd_acc(__m256i acc, __m256i w, __m256i a) { return _mm256_dpwssd_epi32(acc, w, a); }
// v + bit in the lanes `mask` names (q5's fifth bit: 16; q6's bits 4 and 5): one masked add (AVX-512BW + VL;
// v has no such bit yet, so an OR).
inline __m256i add_bit(__m256i v, uint32_t mask, int16_t bit) {
  return _mm256_mask_add_epi16(v, static_cast<__mmask16>(mask), v, _mm256_set1_epi16(bit));
}
// The valid output rows of group g (only a matrix's last group may be partial).
inline __mmask8 group_mask(const Weights& w, int64_t g) {
  const int64_t valid = std::min<int64_t>(RG, w.rows - g * RG);
  return static_cast<__mmask8>(valid >= RG ? 0xFF : (1u << valid) - 1);
}
// A mask plane's words as the 32 int16 lanes of a zmm hold them, for its low-nibble (lo) and high-nibble (hi)
// vectors: two groups' chunk c side by side (words a, b = [low, high] of each; the 512-bit tiles), or one
// group's chunks c, c + 1 ([low c, high c, low c + 1, high c + 1]; the duo tiles, before their permute).
struct HalfMasks {
  __mmask32 lo, hi;
};
inline HalfMasks two_group_masks(uint32_t a, uint32_t b) {
  return {static_cast<__mmask32>((a & 0xFFFFu) | (b << 16)), static_cast<__mmask32>((a >> 16) | (b & 0xFFFF0000u))};
}
inline HalfMasks chunk_pair_masks(uint64_t words) {
  return {static_cast<__mmask32>((words & 0xFFFFu) | ((words >> 16) & 0xFFFF0000u)),
          static_cast<__mmask32>(((words >> 16) & 0xFFFFu) | ((words >> 32) & 0xFFFF0000u))};
}
TM_SIMD_TILES

// 512-bit tiles: two groups g and g2 (16 output rows; span2 picks them half a span apart) side by side
// in one zmm, lane r = row r of group g, lane 8 + r = row r of group g2. The layout is unchanged: a
// 16-byte pair of each group fills one half, so an activation pair is still one broadcast (from memory, no shuffle) and
// one vpdpwssd does 32 multiply-adds where the 256-bit tile did 16. Each lane does exactly the
// 256-bit tile's integer and float steps in the same order, so the result is bit-identical.
inline __m512 lanes16(const Weights& w, const Lanes& l, int64_t i0, int64_t i1) {
  if (w.two) {  // the two groups' uint8 multipliers times their super-blocks' fp16 lanes (exact products)
    const __m128i m = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.lane_ptr(l, i0))),
                                         _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.lane_ptr(l, i1))));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(l.d + Weights::super(i1)),
                                                         reinterpret_cast<const __m128i*>(l.d + Weights::super(i0))));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m)), d);
  }
  if (w.half)
    return _mm512_cvtph_ps(_mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(w.lane_ptr(l, i1)),
                                               reinterpret_cast<const __m128i*>(w.lane_ptr(l, i0))));
  const __m512d lo = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(reinterpret_cast<const float*>(w.lane_ptr(l, i0)))));
  return _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(_mm256_loadu_ps(reinterpret_cast<const float*>(w.lane_ptr(l, i1)))), 1));
}
inline __m512i load_two(const uint8_t* p0, const uint8_t* p1) {
  return _mm512_castsi256_si512(_mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p1), reinterpret_cast<const __m128i*>(p0)));
}

// acc + the int32 pair sums of w x the activation pair at p in every lane: one vpdpwssd with an embedded
// {1to16} broadcast of p (Embedded), or a vpbroadcastd and a vpdpwssd. GCC 12 does not fold
// _mm512_set1_epi32 of a load into the instruction, and the separate vpbroadcastd takes a vector pipe on
// Zen 5: in a scratch loop of 8 independent chains a dot product ran at 0.175 ns with its own broadcast,
// 0.12-0.13 embedded, 0.11 from a register.
struct Pair { int16_t v[2]; };
template <bool Embedded>
inline __m512i dp_pair(__m512i acc, __m512i w, const int16_t* p) {
  if constexpr (Embedded) {
    asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const Pair*>(p)));
    return acc;
  } else {
    int32_t v;
    std::memcpy(&v, p, sizeof v);
    return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(v));
  }
}

// Rows m0 .. m0 + RM - 1 of a two-group tile: lanes 0-7 are group g's rows, 8-15 group g2's (only the matrix's
// last group may be partial).
template <int RM>
inline void store_two(const Weights& w, int64_t g, int64_t g2, const __m512* acc, int64_t m0, float* out, int64_t ld) {
  const __mmask8 mask = group_mask(w, g), mask2 = group_mask(w, g2);
  for (int r = 0; r < RM; ++r) {
    float* y = out + (m0 + r) * ld;
    _mm256_mask_storeu_ps(y + g * RG, mask, _mm512_castps512_ps256(acc[r]));
    _mm256_mask_storeu_ps(y + g2 * RG, mask2, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)));
  }
}

// iq4: 32 nibble-pair bytes (two 16-byte chunks) → the table's int8 at their low (lo) and high (hi) nibbles,
// sign-extended to int16, in the bytes' order (what q4's zero-extension and mask/shift give for its nibbles).
inline void iq4_nibbles(const Weights& w, __m256i bytes, __m512i& lo, __m512i& hi) {
  const __m256i nib = _mm256_set1_epi8(0x0F), table = iq4_table(w);
  lo = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(table, _mm256_and_si256(bytes, nib)));
  hi = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nib)));
}

template <int RM, bool Q4, bool Q5, bool IQ = false>
void tile2(const Weights& w, int64_t g, int64_t g2, const Act& a, int64_t m0, float* out, int64_t ld, bool first_pass) {
  // Independent chains a row (summed exactly at the block's end): vpdpwssd's latency is 4 cycles at two
  // a cycle, so fewer than 8 chains in flight leave it idle.
  constexpr int NCH = RM >= 8 ? 1 : RM >= 4 ? 2 : 4;
  // The embedded broadcast below 8 rows only: the 8-row tile (8 chains, exactly vpdpwssd's latency times
  // its rate) ran slower with it (a batch-64 step 0.968x the explicit broadcasts' against 0.987x; GCC
  // schedules around the opaque asm as it cannot around an intrinsic).
  constexpr bool kEmbed = RM < 8;
  __m512 acc[RM];
  const int16_t* arow[RM];
  for (int r = 0; r < RM; ++r) { acc[r] = _mm512_setzero_ps(); arow[r] = a.a + (m0 + r) * a.K; }
  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* b0 = w.block(g, b);
    const uint8_t* b1 = w.block(g2, b);
    if (first_pass) {  // as the 256-bit tile, for both groups' streams
      prefetch_ahead<Q4, Q5>(w, g, b);
      prefetch_ahead<Q4, Q5>(w, g2, b);
    }
    __m512i isum[RM][NCH];
    for (int r = 0; r < RM; ++r) for (int k = 0; k < NCH; ++k) isum[r][k] = _mm512_setzero_si512();
    if (Q4) {
      const __m512i low = _mm512_set1_epi16(0x0F);
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        __m512i lo, hi;
        if constexpr (IQ) {  // iq4: both groups' chunks through the table
          iq4_nibbles(w, _mm512_castsi512_si256(load_two(b0 + 16 * c, b1 + 16 * c)), lo, hi);
        } else {
          const __m512i raw = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(load_two(b0 + 16 * c, b1 + 16 * c)));
          lo = _mm512_and_si512(raw, low);
          hi = _mm512_srli_epi16(raw, 4);
        }
        if (Q5) {  // lanes 0-15 are group g's chunk, 16-31 group g2's: their two mask words side by side
          uint32_t w0, w1;
          std::memcpy(&w0, w.high_block(g, b) + 4 * c, sizeof w0);
          std::memcpy(&w1, w.high_block(g2, b) + 4 * c, sizeof w1);
          const __m512i sixteen = _mm512_set1_epi16(16);
          const HalfMasks m = two_group_masks(w0, w1);
          lo = _mm512_mask_add_epi16(lo, m.lo, lo, sixteen);
          hi = _mm512_mask_add_epi16(hi, m.hi, hi, sixteen);
        }
        for (int r = 0; r < RM; ++r) {
          const int16_t* ab = arow[r] + b * QK + 2 * c;
          const int k = (2 * c) % NCH;
          isum[r][k] = dp_pair<kEmbed>(isum[r][k], lo, ab);
          isum[r][(k + 1) % NCH] = dp_pair<kEmbed>(isum[r][(k + 1) % NCH], hi, ab + 16);
        }
      }
    } else {
#pragma GCC unroll 16
      for (int p = 0; p < 16; ++p) {
        const __m512i wv = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(load_two(b0 + 16 * p, b1 + 16 * p)));
        for (int r = 0; r < RM; ++r) isum[r][p % NCH] = dp_pair<kEmbed>(isum[r][p % NCH], wv, arow[r] + b * QK + 2 * p);
      }
    }
    const __m512 sw = lanes16(w, w.scale, w.lanes(g, b), w.lanes(g2, b));
    for (int r = 0; r < RM; ++r) {
      __m512i s = isum[r][0];
      for (int k = 1; k < NCH; ++k) s = _mm512_add_epi32(s, isum[r][k]);
      const __m512 scale = _mm512_mul_ps(sw, _mm512_set1_ps(a.d[(m0 + r) * a.nb + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r]);
    }
    if (Q4 && !IQ) {
      const __m512 off = w.offset.p ? lanes16(w, w.offset, w.lanes(g, b), w.lanes(g2, b))
                                    : _mm512_mul_ps(sw, _mm512_set1_ps(-16.f));  // q5 from Q5_0: -16 * scale
      for (int r = 0; r < RM; ++r) acc[r] = _mm512_fmadd_ps(off, _mm512_set1_ps(a.s[(m0 + r) * a.nb + b]), acc[r]);
    }
  }
  store_two<RM>(w, g, g2, acc, m0, out, ld);
}

// Four-group tile for q8 weights (prefill and wide batches: 8 activation rows, 32 output rows): groups
// g, g2 in one zmm and g3, g4 in another, so each activation pair's broadcast feeds two vpdpwssd instead
// of one, at the 8-row tile's widening per multiply-add; 16 integer chains. Each lane takes tile2's steps
// in its order: the same bits. Not for q4/q5, whose nibble decode per pair (two groups' worth of
// ands, shifts and mask adds for each broadcast) left them no faster and a 16 x 110-token Qwen2.5-Coder
// prefill 0.96x (docs/quantization.md).
void tile4(const Weights& w, const int64_t (&gs)[4], const Act& a, int64_t m0, float* out, int64_t ld) {
  constexpr int RM = 8;
  // The float sums stay in memory (touched once a block): in registers next to the 16 integer chains,
  // GCC spilled one of the chains instead, a store and a reload on it every pair.
  volatile __m512 acc[RM][2];
  const int16_t* arow[RM];
  for (int r = 0; r < RM; ++r) {
    acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    arow[r] = a.a + (m0 + r) * a.K;
  }
  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* bl[4];
    for (int j = 0; j < 4; ++j) {
      bl[j] = w.block(gs[j], b);
      if (m0 == 0) prefetch_ahead<false, false>(w, gs[j], b);  // the first pass over the chunk, as tile2
    }
    __m512i isum[RM][2];
    for (int r = 0; r < RM; ++r) isum[r][0] = isum[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int p = 0; p < 16; ++p) {
      const __m512i w0 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(load_two(bl[0] + 16 * p, bl[1] + 16 * p)));
      const __m512i w1 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(load_two(bl[2] + 16 * p, bl[3] + 16 * p)));
      for (int r = 0; r < RM; ++r) {
        int32_t v;
        std::memcpy(&v, arow[r] + b * QK + 2 * p, sizeof v);
        const __m512i av = _mm512_set1_epi32(v);
        isum[r][0] = _mm512_dpwssd_epi32(isum[r][0], w0, av);
        isum[r][1] = _mm512_dpwssd_epi32(isum[r][1], w1, av);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m512 sw = lanes16(w, w.scale, w.lanes(gs[2 * h], b), w.lanes(gs[2 * h + 1], b));
      for (int r = 0; r < RM; ++r) {
        const __m512 scale = _mm512_mul_ps(sw, _mm512_set1_ps(a.d[(m0 + r) * a.nb + b]));
        acc[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][h]), scale, acc[r][h]);
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    __m512 sums[RM];
    for (int r = 0; r < RM; ++r) sums[r] = acc[r][h];
    store_two<RM>(w, gs[2 * h], gs[2 * h + 1], sums, m0, out, ld);
  }
}

// Duo tiles (few activation rows): one group, two neighbouring 16-byte pairs p, p + 1 per zmm. The
// 32 bytes are widened at once and their 32-bit lanes permuted so lane 2r holds row r's pair p and
// lane 2r + 1 its pair p + 1; one 8-byte broadcast of the activation pairs p, p + 1 ([p, p+1] in each
// 64-bit lane) then meets every row with a full-width vpdpwssd. Per 8 weights of a row (q4) that is
// one widening, one permute, one and, one shift and a vpdpwssd a row, where the 256-bit tile takes
// two widenings, two ands, two shifts and two vpdpwssd a row. At a block's end lanes 2r and 2r + 1
// are added (exact int32) and packed to the 256-bit tile's eight lanes, whose float steps follow in
// the same order: the same bits as `tile`. Worth it where a 512-bit op runs at full width (Zen 5).
inline __m512i duo_order(__m512i v) {
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15), v);
}
inline __m512 twice(__m256 v) {  // v in both halves (AVX-512F: no insertf32x8)
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(v)), _mm256_castps_pd(v), 1));
}
inline __m512i bcast_duo(const int16_t* p) {  // activation pairs p, p + 1 in every 64-bit lane
  int64_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi64(v);
}
template <int RM, bool Q4, bool Q5, bool IQ = false>
void tile_duo(const Weights& w, int64_t g, const Act& a, int64_t m0, float* out, int64_t ld) {
  // Independent vpdpwssd chains a row, summed exactly at the block's end: vpdpwssd's latency is 4 cycles
  // at two a cycle on Zen 5 (measured), so a tile keeps at least 8 chains in flight.
  constexpr int NCH = RM <= 2 ? 4 : 2;
  // Rows 2i and 2i + 1 share a zmm of float accumulators (lanes 0-7 and 8-15; a last odd row has a ymm):
  // their int32 sums fold into one vector with two permutes and an add, and the float steps run once
  // for both rows at full width, half the ops of a ymm per row. Each lane still takes the 256-bit tile's
  // steps in its order, so the bits do not change.
  constexpr int NP = RM / 2;
  __m512 acc2[NP > 0 ? NP : 1];
  __m256 acc_last = _mm256_setzero_ps();
  const int16_t* arow[RM];
  for (int i = 0; i < NP; ++i) acc2[i] = _mm512_setzero_ps();
  for (int r = 0; r < RM; ++r) arow[r] = a.a + (m0 + r) * a.K;
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* blk = w.block(g, b);
    prefetch_ahead<Q4, Q5>(w, g, b);
    __m512i isum[RM][NCH];
    for (int r = 0; r < RM; ++r) for (int k = 0; k < NCH; ++k) isum[r][k] = _mm512_setzero_si512();
    if (Q4) {
      const __m512i low = _mm512_set1_epi16(0x0F);
      #pragma GCC unroll 4
      for (int c = 0; c < 8; c += 2) {
        __m512i lo, hi;
        if (Q5) {
          // The fifth bits go in before the permute, where chunk c's lanes are 0-15 and c + 1's 16-31
          // (as tile2): its mask words [low c, high c, low c + 1, high c + 1] join with shifts, then
          // lo and hi are permuted apart. (Permuting first needed the masks' bits interleaved, four
          // pdeps a duo, which bound the 1-row tile.)
          const __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 * c)));
          uint64_t words;
          std::memcpy(&words, w.high_block(g, b) + 4 * c, sizeof words);
          const HalfMasks m = chunk_pair_masks(words);
          const __m512i sixteen = _mm512_set1_epi16(16), lo0 = _mm512_and_si512(raw, low), hi0 = _mm512_srli_epi16(raw, 4);
          lo = duo_order(_mm512_mask_add_epi16(lo0, m.lo, lo0, sixteen));
          hi = duo_order(_mm512_mask_add_epi16(hi0, m.hi, hi0, sixteen));
        } else if constexpr (IQ) {  // iq4: chunks c, c + 1 through the table, then permuted
          iq4_nibbles(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 * c)), lo, hi);
          lo = duo_order(lo);
          hi = duo_order(hi);
        } else {
          const __m512i raw = duo_order(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 * c))));
          lo = _mm512_and_si512(raw, low);
          hi = _mm512_srli_epi16(raw, 4);
        }
        for (int r = 0; r < RM; ++r) {
          const int16_t* ab = arow[r] + b * QK + 2 * c;
          isum[r][c % NCH] = _mm512_dpwssd_epi32(isum[r][c % NCH], lo, bcast_duo(ab));
          isum[r][(c + 1) % NCH] = _mm512_dpwssd_epi32(isum[r][(c + 1) % NCH], hi, bcast_duo(ab + 16));
        }
      }
    } else {
      #pragma GCC unroll 8
      for (int p = 0; p < 16; p += 2) {
        const __m512i wv = duo_order(_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 * p))));
        for (int r = 0; r < RM; ++r) {
          const int k = (p / 2) % NCH;
          isum[r][k] = _mm512_dpwssd_epi32(isum[r][k], wv, bcast_duo(arow[r] + b * QK + 2 * p));
        }
      }
    }
    __m512i s[RM];
    for (int r = 0; r < RM; ++r) {
      s[r] = isum[r][0];
      for (int k = 1; k < NCH; ++k) s[r] = _mm512_add_epi32(s[r], isum[r][k]);
    }
    const __m256 sw = lanes8(w, w.scale, w.lanes(g, b));
    const __m256 off = !Q4 ? sw : offsets8(w, sw, w.lanes(g, b));
    const float* d = a.d + m0 * a.nb + b;  // row r's at d[r * a.nb]
    const float* bs = a.s + m0 * a.nb + b;
    if constexpr (NP > 0) {
      const __m512 sw2 = twice(sw), off2 = twice(off);
      for (int i = 0; i < NP; ++i) {
        const int r = 2 * i;
        const __m512i folded = _mm512_add_epi32(_mm512_permutex2var_epi32(s[r], even, s[r + 1]),
                                                _mm512_permutex2var_epi32(s[r], odd, s[r + 1]));
        const __m512 dd = _mm512_mask_broadcastss_ps(_mm512_set1_ps(d[r * a.nb]), 0xFF00, _mm_load_ss(d + (r + 1) * a.nb));
        acc2[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(folded), _mm512_mul_ps(sw2, dd), acc2[i]);
        if (Q4 && !IQ) {
          const __m512 ss = _mm512_mask_broadcastss_ps(_mm512_set1_ps(bs[r * a.nb]), 0xFF00, _mm_load_ss(bs + (r + 1) * a.nb));
          acc2[i] = _mm512_fmadd_ps(off2, ss, acc2[i]);
        }
      }
    }
    if constexpr (RM % 2) {
      constexpr int r = RM - 1;
      const __m256i folded = _mm512_cvtepi64_epi32(_mm512_add_epi32(s[r], _mm512_srli_epi64(s[r], 32)));
      const __m256 scale = _mm256_mul_ps(sw, _mm256_set1_ps(d[r * a.nb]));
      acc_last = _mm256_fmadd_ps(_mm256_cvtepi32_ps(folded), scale, acc_last);
      if (Q4 && !IQ) acc_last = _mm256_fmadd_ps(off, _mm256_set1_ps(bs[r * a.nb]), acc_last);
    }
  }
  const __mmask8 mask = group_mask(w, g);
  for (int i = 0; i < NP; ++i) {
    _mm256_mask_storeu_ps(out + (m0 + 2 * i) * ld + g * RG, mask, _mm512_castps512_ps256(acc2[i]));
    _mm256_mask_storeu_ps(out + (m0 + 2 * i + 1) * ld + g * RG, mask,
                          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc2[i]), 1)));
  }
  if constexpr (RM % 2) _mm256_mask_storeu_ps(out + (m0 + RM - 1) * ld + g * RG, mask, acc_last);
}

template <int RM>
void tile_duo6(const Weights& w, int64_t g, const Act& a, int64_t m0, float* out, int64_t ld);  // q6, below

template <int RM>
void span_duo(const Weights& w, int64_t g0, int64_t g1, const Act& a, int64_t m0, float* out, int64_t ld) {
  for (int64_t g = g0; g < g1; ++g) {
    if (w.q6) tile_duo6<RM>(w, g, a, m0, out, ld);
    else if (w.q5) tile_duo<RM, true, true>(w, g, a, m0, out, ld);
    else if (w.iq4) tile_duo<RM, true, false, true>(w, g, a, m0, out, ld);
    else if (w.q4) tile_duo<RM, true, false>(w, g, a, m0, out, ld);
    else tile_duo<RM, false, false>(w, g, a, m0, out, ld);
  }
}

// Activation rows m0 .. m0 + rows - 1 (rows <= kDuoRows) in one tile: each group's weights are decoded once
// for every row.
void groups_duo(const Weights& w, const Act& a, int64_t m0, int64_t rows, int64_t g0, int64_t g1, float* out,
                int64_t ld) {
  switch (rows) {
    case 1: return span_duo<1>(w, g0, g1, a, m0, out, ld);
    case 2: return span_duo<2>(w, g0, g1, a, m0, out, ld);
    case 3: return span_duo<3>(w, g0, g1, a, m0, out, ld);
    case 4: return span_duo<4>(w, g0, g1, a, m0, out, ld);
    case 5: return span_duo<5>(w, g0, g1, a, m0, out, ld);
    case 6: return span_duo<6>(w, g0, g1, a, m0, out, ld);
    case 7: return span_duo<7>(w, g0, g1, a, m0, out, ld);
    default: return span_duo<8>(w, g0, g1, a, m0, out, ld);
  }
}

constexpr int64_t kDuoStreamRows = 6;  // least rows a streamed matrix takes the duo tiles for

// q6 duo tiles: tile_duo's plan for Q6_K's 6-bit weights. A chunk pair's nibbles widen at once; bits 4 and
// 5 go in from the two mask planes before the permute as q5's fifth bits do, with q - 32 = nibble + 16 b4
// - 32 (1 - b5): one masked add and one masked subtract a half. The 16-column halves (the low and high
// nibbles) sum apart and take tile6's two float steps, low half first: the same bits as tile6.
template <int RM>
void tile_duo6(const Weights& w, int64_t g, const Act& a, int64_t m0, float* out, int64_t ld) {
  constexpr int NCH = RM <= 2 ? 2 : 1;  // chains a half and row: 4 at one row (vpdpwssd's latency x rate / 2)
  __m256 acc[RM];
  const int16_t* arow[RM];
  for (int r = 0; r < RM; ++r) { acc[r] = _mm256_setzero_ps(); arow[r] = a.a + (m0 + r) * a.K; }
  const __m512i low = _mm512_set1_epi16(0x0F), s16 = _mm512_set1_epi16(16), s32 = _mm512_set1_epi16(32);
  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* blk = w.block(g, b);
    const uint8_t* hb = w.high_block(g, b);
    prefetch_ahead<true, true>(w, g, b);
    __m512i sl[RM][NCH], sh[RM][NCH];
    for (int r = 0; r < RM; ++r) for (int k = 0; k < NCH; ++k) sl[r][k] = sh[r][k] = _mm512_setzero_si512();
    #pragma GCC unroll 4
    for (int c = 0; c < 8; c += 2) {
      const __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 * c)));
      uint64_t w4, w5;  // [low c, high c, low c + 1, high c + 1] of the bit-4 and bit-5 planes
      std::memcpy(&w4, hb + 4 * c, sizeof w4);
      std::memcpy(&w5, hb + 32 + 4 * c, sizeof w5);
      const HalfMasks m4 = chunk_pair_masks(w4), m5 = chunk_pair_masks(w5);
      const __m512i lo0 = _mm512_and_si512(raw, low), hi0 = _mm512_srli_epi16(raw, 4);
      const __m512i lo1 = _mm512_mask_add_epi16(lo0, m4.lo, lo0, s16), hi1 = _mm512_mask_add_epi16(hi0, m4.hi, hi0, s16);
      const __m512i lo = duo_order(_mm512_mask_sub_epi16(lo1, static_cast<__mmask32>(~m5.lo), lo1, s32));
      const __m512i hi = duo_order(_mm512_mask_sub_epi16(hi1, static_cast<__mmask32>(~m5.hi), hi1, s32));
      for (int r = 0; r < RM; ++r) {
        const int16_t* ab = arow[r] + b * QK + 2 * c;
        const int k = (c / 2) % NCH;
        sl[r][k] = _mm512_dpwssd_epi32(sl[r][k], lo, bcast_duo(ab));
        sh[r][k] = _mm512_dpwssd_epi32(sh[r][k], hi, bcast_duo(ab + 16));
      }
    }
    const __m256 llo = q6_lanes8(w, g, b, 0), lhi = q6_lanes8(w, g, b, 1);
    for (int r = 0; r < RM; ++r) {
      __m512i l = sl[r][0], h = sh[r][0];
      for (int k = 1; k < NCH; ++k) { l = _mm512_add_epi32(l, sl[r][k]); h = _mm512_add_epi32(h, sh[r][k]); }
      const __m256i l8 = _mm512_cvtepi64_epi32(_mm512_add_epi32(l, _mm512_srli_epi64(l, 32)));
      const __m256i h8 = _mm512_cvtepi64_epi32(_mm512_add_epi32(h, _mm512_srli_epi64(h, 32)));
      const __m256 ad = _mm256_set1_ps(a.d[(m0 + r) * a.nb + b]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l8), _mm256_mul_ps(llo, ad), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h8), _mm256_mul_ps(lhi, ad), acc[r]);
    }
  }
  const __mmask8 mask = group_mask(w, g);
  for (int r = 0; r < RM; ++r) _mm256_mask_storeu_ps(out + (m0 + r) * ld + g * RG, mask, acc[r]);
}

// q6 512-bit tiles: tile2's plan (two groups side by side, up to 8 activation rows, each broadcast
// embedded below 8 rows) with tile6's arithmetic: bits 4 and 5 from both groups' mask planes, q - 32 as
// in tile_duo6, the 16-column halves summed apart and stepped low half first (the same bits as tile6).
inline __m512 q6_lanes16(const Weights& w, int64_t g, int64_t g2, int64_t b, int h) {
  const __m128i q = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.q6_mults(g, b, h))),
                                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.q6_mults(g2, b, h))));
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(w.supers_of(w.scale, g2, b)),
                                                       reinterpret_cast<const __m128i*>(w.supers_of(w.scale, g, b))));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
}

template <int RM>
void tile2_6(const Weights& w, int64_t g, int64_t g2, const Act& a, int64_t m0, float* out, int64_t ld, bool first_pass) {
  constexpr int NCH = RM >= 4 ? 1 : 2;  // chains a half and row (two halves: 8 chains in flight from 4 rows)
  constexpr bool kEmbed = RM < 8;
  __m512 acc[RM];
  const int16_t* arow[RM];
  for (int r = 0; r < RM; ++r) { acc[r] = _mm512_setzero_ps(); arow[r] = a.a + (m0 + r) * a.K; }
  const __m512i low = _mm512_set1_epi16(0x0F), s16 = _mm512_set1_epi16(16), s32 = _mm512_set1_epi16(32);
  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* b0 = w.block(g, b);
    const uint8_t* b1 = w.block(g2, b);
    const uint8_t* h0 = w.high_block(g, b);
    const uint8_t* h1 = w.high_block(g2, b);
    if (first_pass) {
      prefetch_ahead<true, true>(w, g, b);
      prefetch_ahead<true, true>(w, g2, b);
    }
    __m512i sl[RM][NCH], sh[RM][NCH];
    for (int r = 0; r < RM; ++r) for (int k = 0; k < NCH; ++k) sl[r][k] = sh[r][k] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m512i raw = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(load_two(b0 + 16 * c, b1 + 16 * c)));
      uint32_t a4, b4, a5, b5;  // [low, high] words of chunk c in group g's and g2's bit-4 and bit-5 planes
      std::memcpy(&a4, h0 + 4 * c, sizeof a4);
      std::memcpy(&b4, h1 + 4 * c, sizeof b4);
      std::memcpy(&a5, h0 + 32 + 4 * c, sizeof a5);
      std::memcpy(&b5, h1 + 32 + 4 * c, sizeof b5);
      const HalfMasks m4 = two_group_masks(a4, b4), m5 = two_group_masks(a5, b5);
      const __m512i lo0 = _mm512_and_si512(raw, low), hi0 = _mm512_srli_epi16(raw, 4);
      const __m512i lo1 = _mm512_mask_add_epi16(lo0, m4.lo, lo0, s16), hi1 = _mm512_mask_add_epi16(hi0, m4.hi, hi0, s16);
      const __m512i lo = _mm512_mask_sub_epi16(lo1, static_cast<__mmask32>(~m5.lo), lo1, s32);
      const __m512i hi = _mm512_mask_sub_epi16(hi1, static_cast<__mmask32>(~m5.hi), hi1, s32);
      for (int r = 0; r < RM; ++r) {
        const int16_t* ab = arow[r] + b * QK + 2 * c;
        const int k = c % NCH;
        sl[r][k] = dp_pair<kEmbed>(sl[r][k], lo, ab);
        sh[r][k] = dp_pair<kEmbed>(sh[r][k], hi, ab + 16);
      }
    }
    const __m512 llo = q6_lanes16(w, g, g2, b, 0), lhi = q6_lanes16(w, g, g2, b, 1);
    for (int r = 0; r < RM; ++r) {
      __m512i l = sl[r][0], h = sh[r][0];
      for (int k = 1; k < NCH; ++k) { l = _mm512_add_epi32(l, sl[r][k]); h = _mm512_add_epi32(h, sh[r][k]); }
      const __m512 ad = _mm512_set1_ps(a.d[(m0 + r) * a.nb + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l), _mm512_mul_ps(llo, ad), acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h), _mm512_mul_ps(lhi, ad), acc[r]);
    }
  }
  store_two<RM>(w, g, g2, acc, m0, out, ld);
}

template <int RM>
void tile2(const Weights& w, int64_t g, int64_t g2, const Act& a, int64_t m0, float* out, int64_t ld) {
  if (w.q6) tile2_6<RM>(w, g, g2, a, m0, out, ld, m0 == 0);
  else if (w.q5) tile2<RM, true, true>(w, g, g2, a, m0, out, ld, m0 == 0);
  else if (w.iq4) tile2<RM, true, false, true>(w, g, g2, a, m0, out, ld, m0 == 0);
  else if (w.q4) tile2<RM, true, false>(w, g, g2, a, m0, out, ld, m0 == 0);
  else tile2<RM, false, false>(w, g, g2, a, m0, out, ld, m0 == 0);
}

constexpr int kRM512 = 8;  // activation rows per 512-bit tile

// Groups c0 .. c1 - 1 paired half the span apart, (c0 + i, c0 + h + i): each half is read as one
// sequential stream across the tiles. Pairing neighbours (g, g + 1) started a fresh stream every two
// groups, which the hardware prefetchers had to pick up again each time: from DRAM (the 145 MB lm_head
// of Qwen2.5-Coder-0.5B at 8 rows) one thread took twice its L3-resident time, at 10 GB/s (measured in
// docs/quantization.md; software prefetch at any distance did not help).
template <int RM>
void span2(const Weights& w, int64_t c0, int64_t c1, const Act& a, int64_t m0, float* out, int64_t ld) {
  const int64_t h = (c1 - c0) / 2;
  for (int64_t i = 0; i < h; ++i) tile2<RM>(w, c0 + i, c0 + h + i, a, m0, out, ld);
  const int64_t g = c0 + 2 * h;
  if (g == c1) return;
  int64_t m = m0;  // an odd group left over: the 256-bit tiles, 4 rows at a time
  for (; m + 4 <= m0 + RM; m += 4) tile<4>(w, g, a, m, out, ld);
  const int64_t rest = m0 + RM - m;
  if (rest == 3) tile<3>(w, g, a, m, out, ld);
  else if (rest == 2) tile<2>(w, g, a, m, out, ld);
  else if (rest == 1) tile<1>(w, g, a, m, out, ld);
}

// q8 groups c0 .. c1 - 1 in four-group tiles a quarter of the span apart (four sequential streams), then
// the groups left over (at most three) as span2 does.
void span4(const Weights& w, int64_t c0, int64_t c1, const Act& a, int64_t m0, float* out, int64_t ld) {
  const int64_t q = (c1 - c0) / 4;
  for (int64_t i = 0; i < q; ++i) {
    const int64_t gs[4] = {c0 + i, c0 + q + i, c0 + 2 * q + i, c0 + 3 * q + i};
    tile4(w, gs, a, m0, out, ld);
  }
  if (c0 + 4 * q < c1) span2<kRM512>(w, c0 + 4 * q, c1, a, m0, out, ld);
}

template <int R>
void rest2(int64_t rest, const Weights& w, int64_t c0, int64_t c1, const Act& a, int64_t m0, float* out, int64_t ld) {
  if constexpr (R > 0) {
    if (rest == R) return span2<R>(w, c0, c1, a, m0, out, ld);
    rest2<R - 1>(rest, w, c0, c1, a, m0, out, ld);
  }
}

// q6 on the avx512vnni path: where the duo tiles run (Zen 5), duo tiles for up to 8 rows (and a streamed
// matrix's 9-24, in 8-row passes), the whole range a pass; from wide_rows rows the 512-bit tiles over ~128 KiB
// chunks of groups, 8 rows a tile and the rest in one tile of as many; below it the 256-bit tiles.
void groups_q6(const Weights& w, const Act& a, int64_t M, int64_t g0, int64_t g1, float* out, int64_t ld,
               int64_t wide_rows, int64_t duo_rows, bool streamed) {
  if (duo_rows > 0 && (M <= kDuoRows || (M <= 3 * kDuoRows && streamed))) {
    for (int64_t m0 = 0; m0 < M; m0 += kDuoRows) groups_duo(w, a, m0, std::min(kDuoRows, M - m0), g0, g1, out, ld);
    return;
  }
  if (M < wide_rows) return groups256(w, a, M, g0, g1, out, ld);
  int64_t chunk = std::max<int64_t>(2, (128 << 10) / std::max<int64_t>(1, w.nb * w.block_bytes()));
  chunk += chunk & 1;
  for (int64_t c0 = g0; c0 < g1; c0 += chunk) {
    const int64_t c1 = std::min(g1, c0 + chunk);
    int64_t m0 = 0;
    for (; m0 + kRM512 <= M; m0 += kRM512) span2<kRM512>(w, c0, c1, a, m0, out, ld);
    rest2<kRM512 - 1>(M - m0, w, c0, c1, a, m0, out, ld);
  }
}

void groups(const Weights& w, const Act& a, int64_t M, int64_t g0, int64_t g1, float* out, int64_t ld,
            int64_t wide_rows, int64_t duo_rows) {
  // A matrix far past L3 (a large vocabulary's lm_head: Qwen2.5-0.5B's is 145 MB) streams from memory
  // whatever the tiles do; duo_rows > 16 treats every matrix so (tests: the same bits either way).
  const int64_t matrix_bytes = (w.rows + RG - 1) / RG * w.nb * w.block_bytes();
  const bool forced = duo_rows > 2 * kDuoRows;
  const bool streamed = matrix_bytes > kStreamBytes || forced;
  if (w.q6) return groups_q6(w, a, M, g0, g1, out, ld, wide_rows, duo_rows, streamed);
  if (duo_rows > 0 && M <= kDuoRows) {
    // 2-8 activation rows where the duo tiles run (Zen 5): the 512-bit tiles, whose embedded broadcasts
    // made them faster than the duo tiles' 64-bit broadcasts (batch-1 steps of 2-8 query rows 1.06-1.13x;
    // docs/quantization.md), except on a streamed matrix from kDuoStreamRows rows, where one sequential
    // duo stream a thread beat the 512-bit tiles' two (the lm_head at 6-8 rows 2.7-3.6 ms against
    // 3.4-5.7). One row stays on the duo tiles (whole decode steps alike, SmolLM2 0.98x with the 512-bit).
    if (M == 1 || forced || (streamed && M >= kDuoStreamRows)) return groups_duo(w, a, 0, M, g0, g1, out, ld);
    wide_rows = 1;
  }

  // 9-24 rows of a streamed matrix: passes of 8-row duo tiles, each streaming the whole range from
  // memory, beat one pass in L2-sized chunks (short streams: ~14 GB/s) on Zen 5: that lm_head at 16 rows
  // 9.8 -> 7.6 ms, at 24 rows 12.4 -> ~10.8 (docs/quantization.md; at 32 rows the chunks' denser tiles
  // catch up). Layers that fit L3 keep the chunks (all-duo there: a batch-16 step 0.959x).
  if (M > kDuoRows && M <= 3 * kDuoRows && duo_rows > kDuoRows && streamed) {
    for (int64_t m0 = 0; m0 < M; m0 += kDuoRows)
      groups_duo(w, a, m0, std::min(kDuoRows, M - m0), g0, g1, out, ld);
    return;
  }
  if (M < wide_rows) return groups256(w, a, M, g0, g1, out, ld);
  // As groups256: ~128 KiB chunks of weights (an even number of groups) that every m-tile passes over.
  const int64_t group_bytes = w.nb * w.block_bytes();
  int64_t chunk = std::max<int64_t>(2, (128 << 10) / std::max<int64_t>(1, group_bytes));
  chunk += chunk & 1;
  // One m-tile passes over the weights once: no chunk needs to stay in L2, so the whole range is one
  // span, two long sequential streams (span2).
  if (M <= kRM512) chunk = g1 - g0;
  for (int64_t c0 = g0; c0 < g1; c0 += chunk) {
    const int64_t c1 = std::min(g1, c0 + chunk);
    int64_t m0 = 0;
    for (; m0 + kRM512 <= M; m0 += kRM512) {
      if (w.q4) span2<kRM512>(w, c0, c1, a, m0, out, ld);
      else span4(w, c0, c1, a, m0, out, ld);
    }
    // Rows past the last 8-row tile (the chunk is in L2 by now): the 512-bit tiles of as many rows, or
    // the duo tiles where forced (tests).
    if (M > m0 && forced) groups_duo(w, a, m0, M - m0, c0, c1, out, ld);
    else rest2<kRM512 - 1>(M - m0, w, c0, c1, a, m0, out, ld);
  }
}
}  // namespace vnni
#pragma GCC pop_options
