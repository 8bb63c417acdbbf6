// The LM head of `--quantization int8` over a GGUF file: every vocabulary logit from the 8-bit
// product (cpu_group_quant_int8.h, float32 sums; a Q8_0 head's greedy tokens for 16 rows or
// more from lane tiles of its own, below), then the few logits that could be the row's largest
// re-scored exactly, so the greedy token is the exact product's argmax (included in
// cpu_group_quant.cpp, inside its namespace, after cpu_group_quant_int8.h).
//
// The bound. A row's 8-bit codes q per block b of 32 (step s_b) stand for x with error
// |x - s_b q| <= 0.500024 s_b (round to nearest, plus the float32 roundings of 127 / max and
// of x times it), so the 8-bit logit of feature v is off its exact value by at most
//     0.500024 sum_b s_b n_vb,     n_vb = sum of block b's |w|
// plus the float32 roundings of folding the integer sums (under (2B + 2) 2^-24 times the folded
// terms' magnitudes, which 32 x 127 x (|a| u_max + |offset|) s_b bounds) and the rounding of the
// exact logit to float32 (2^-24 x 127 s_b n_vb). gguf_int8_head_bounds tabulates, per feature
// and block, m_vb = 0.5001 n_vb + 2^-23 (2B + 2) 4064 (|a| u_max + |offset|), rounded up, so
// that |int8 logit - exact logit| <= B_v = sum_b s_b m_vb; and per feature the largest over
// its blocks, widest_v = max_b m_vb.
//
// The candidates. Let L be the 8-bit logits, u0 an argmax of them and U_v = (sum_b s_b)
// max_b m_vb >= B_v (a table of one float a feature, which stays in L2). A feature with
// L_v + U_v < L_u0 - B_u0 is below u0's exact logit; of the rest (P, ~1.6x C), one with
// L_v + B_v < max_P (L_u - B_u) is below the exact logit of that u. The others (C: ~7 a row on
// SmolLM2 over English text, ~80 after prompts of random tokens, at most a few hundred) get
// their exact logit: the weights dequantized and the products summed in double, rounded once to
// float32. Every feature outside C keeps an 8-bit logit below some member's exact one, so the
// first index of the row's largest logit is the exact product's. A row whose inputs, steps or
// 8-bit logits are not finite is re-scored whole.
#pragma once

#include <atomic>

#if defined(SPMD_GGUF_INT8)

constexpr double kHeadQuantizationBound = 0.5001;
constexpr size_t kBoundsAhead = 16;   // features whose bounds are fetched ahead

// The largest unsigned code of a block type's int8 panels (Q8_0's signed codes shifted by 128).
constexpr double largest_code(int64_t kind) {
  return kind == kQ8_0 ? 255.0 : (kind == kQ5_0 || kind == kQ5_1) ? 31.0 : 15.0;
}

// x rounded to float32 upwards (never below x).
inline float round_up(double x) {
  const float f = static_cast<float>(x);
  return static_cast<double>(f) >= x ? f : std::nextafter(f, INFINITY);
}

// The bound table of `blocks` [N, bytes a row] (B blocks a row): m_vb of the bound above at
// out[v B + b], then widest_v at out[N B + v].
void head_bounds(int64_t kind, const uint8_t* blocks, int64_t row_bytes, int64_t N, int64_t K,
                 float* out) {
  const int64_t B = K / kBlock, bytes = block_format(kind).bytes;
  const double fold = std::ldexp(1.0, -23) * static_cast<double>(2 * B + 2) * 32.0 * 127.0;
  at::parallel_for(0, N, 256, [&](int64_t begin, int64_t end) {
    int q[32];
    for (int64_t v = begin; v < end; ++v) {
      float widest = 0.f;
      for (int64_t b = 0; b < B; ++b) {
        Affine f;
        unpack_scalar(kind, blocks + v * row_bytes + b * bytes, 0, q, f);
        double norm = 0.0;
        for (int j = 0; j < 32; ++j)
          norm += std::fabs(static_cast<double>(f.a) * (q[j] - f.zero) + f.c);
        const double offset = std::fabs(static_cast<double>(f.c) - static_cast<double>(f.a) * f.zero);
        out[v * B + b] = round_up(kHeadQuantizationBound * norm +
                                  fold * (std::fabs(f.a) * largest_code(kind) + offset));
        widest = std::max(widest, out[v * B + b]);
      }
      out[N * B + v] = widest;
    }
  });
}

// Feature v's exact logit for a row xd (K inputs, widened to double): its weights dequantized
// (exactly, in double: a (u - zero) + c), the products summed in double, rounded once to float32.
template <int64_t KIND>
float exact_logit(const uint8_t* row, const double* xd, int64_t K) {
  constexpr int64_t kBytes = block_format(KIND).bytes;
  __m512d sum = _mm512_setzero_pd();
  for (int64_t b = 0; b < K / kBlock; ++b) {
    Affine f;
    const __m256i codes = unpack_block<KIND>(row + b * kBytes, f);   // each < 128 but Q8_0's
    const __m512d a = _mm512_set1_pd(f.a), c = _mm512_set1_pd(f.c);
    const __m512d zero = _mm512_set1_pd(f.zero);
    for (int h = 0; h < 2; ++h) {
      const __m512i wide = _mm512_cvtepi8_epi32(h ? _mm256_extracti128_si256(codes, 1)
                                                  : _mm256_castsi256_si128(codes));
      for (int e = 0; e < 2; ++e) {
        const __m256i eight = e ? _mm512_extracti64x4_epi64(wide, 1) : _mm512_castsi512_si256(wide);
        const __m512d w = _mm512_fmadd_pd(a, _mm512_sub_pd(_mm512_cvtepi32_pd(eight), zero), c);
        sum = _mm512_fmadd_pd(w, _mm512_loadu_pd(xd + b * kBlock + 16 * h + 8 * e), sum);
      }
    }
  }
  return static_cast<float>(_mm512_reduce_add_pd(sum));
}

// B_v for one feature: sum_b step_b m_vb (B blocks) in float32, raised past its roundings (all
// terms non-negative: under (B + 32) 2^-24 of the sum).
inline double feature_bound(const float* m, const float* step, int64_t B) {
  __m512 acc = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 16 <= B; b += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(step + b), _mm512_loadu_ps(m + b), acc);
  if (b < B) {
    const __mmask16 rest = static_cast<__mmask16>((1u << (B - b)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(rest, step + b), _mm512_maskz_loadu_ps(rest, m + b),
                          acc);
  }
  return static_cast<double>(_mm512_reduce_add_ps(acc)) *
         (1.0 + std::ldexp(static_cast<double>(B + 32), -23));
}

// The largest of n float32 logits and an index of it; whether all are finite.
inline float largest_logit(const float* logits, int64_t n, int64_t& at, bool& finite) {
  __m512 most = _mm512_set1_ps(-INFINITY);
  __m512i most_at = _mm512_setzero_si512(), index = _mm512_setr_epi32(
      0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __mmask16 odd = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16, index = _mm512_add_epi32(index, _mm512_set1_epi32(16))) {
    const __m512 v = _mm512_loadu_ps(logits + i);
    const __mmask16 above = _mm512_cmp_ps_mask(v, most, _CMP_GT_OQ);
    most = _mm512_mask_blend_ps(above, most, v);
    most_at = _mm512_mask_blend_epi32(above, most_at, index);
    odd |= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_NEQ_UQ);
  }
  float result = _mm512_reduce_max_ps(most);
  const __mmask16 lane = _mm512_cmp_ps_mask(most, _mm512_set1_ps(result), _CMP_EQ_OQ);
  alignas(64) int32_t where[16];
  _mm512_store_si512(where, most_at);
  at = lane ? where[__builtin_ctz(lane)] : 0;
  finite = odd == 0;
  for (; i < n; ++i) {
    finite = finite && std::isfinite(logits[i]);
    if (logits[i] > result) result = logits[i], at = i;
  }
  return result;
}

// The features v of a row whose L_v + scale widest_v reaches `floor` (computed in float32 with
// an FMA; the caller lowers `floor` past its rounding), appended to `into`.
inline void features_reaching(const float* logits, const float* widest, int64_t n, float scale,
                              float floor, std::vector<int64_t>& into) {
  const __m512 limit = _mm512_set1_ps(floor), by = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 top = _mm512_fmadd_ps(by, _mm512_loadu_ps(widest + i), _mm512_loadu_ps(logits + i));
    for (__mmask16 hit = _mm512_cmp_ps_mask(top, limit, _CMP_GE_OQ); hit; hit &= hit - 1)
      into.push_back(i + __builtin_ctz(hit));
  }
  for (; i < n; ++i)
    if (std::fma(scale, widest[i], logits[i]) >= floor) into.push_back(i);
}

// a lowered past a float32 sum's or fma's rounding near it (relative 2^-20, plus 2^-20).
inline float lowered(double a) {
  const double low = a - std::ldexp(std::fabs(a) + 1.0, -20);
  const float f = static_cast<float>(low);
  return static_cast<double>(f) <= low ? f : std::nextafter(f, -INFINITY);
}

// x (K inputs) widened into xd; whether all are finite (a NaN's 8-bit code is garbage, and no
// bound holds for an infinite input's block).
template <class E>
inline bool widen_row(const E* x, int64_t K, std::vector<double>& xd) {
  bool finite = true;
  for (int64_t k = 0; k < K; ++k) {
    xd[k] = spmd_cpu::load_as_float(x + k);
    finite = finite && std::isfinite(xd[k]);
  }
  return finite;
}

// U_v's factor for a row whose steps sum to `steps`: that sum rounded up to float32 (past the
// double sum's roundings), so that scale widest_v >= B_v.
inline float reach_scale(double steps) { return round_up(steps * (1.0 + std::ldexp(1.0, -40))); }

// B_v of n features (feature(i), with 8-bit logit logit(i)) into bound[0 .. n), each one's table
// row fetched kBoundsAhead features ahead (they lie scattered: one at a time, their misses cost
// more than the re-scoring); returns the largest of `floor` and every logit(i) - bound[i].
template <class Feature, class Logit>
double bound_features(const float* table, const float* step, int64_t B, size_t n,
                      Feature&& feature, Logit&& logit, std::vector<double>& bound, double floor) {
  bound.resize(n);
  for (size_t i = 0; i < n; ++i) {
    if (i + kBoundsAhead < n) {
      const char* ahead = reinterpret_cast<const char*>(table + feature(i + kBoundsAhead) * B);
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 4 * B - 1, _MM_HINT_T0);
    }
    bound[i] = feature_bound(table + feature(i) * B, step, B);
    floor = std::max(floor, logit(i) - bound[i]);
  }
  return floor;
}

// One row's 8-bit logits [N] re-scored where the bound cannot rule a feature out (above); x
// the row's inputs (K), `near`, `bound` and `xd` scratch.
template <int64_t KIND, class E>
void rescore_head_row(const uint8_t* blocks, int64_t row_bytes, int64_t N, int64_t K, const E* x,
                      const float* step, const float* table, float* logits,
                      std::vector<int64_t>& near, std::vector<double>& bound,
                      std::vector<double>& xd) {
  const int64_t B = K / kBlock;
  const bool inputs_finite = widen_row(x, K, xd);
  const auto exact = [&](int64_t v) { return exact_logit<KIND>(blocks + v * row_bytes, xd.data(), K); };
  double steps = 0.0;
  for (int64_t b = 0; b < B; ++b) steps += step[b];
  int64_t top = 0;
  bool finite = false;
  const double most = largest_logit(logits, N, top, finite);
  const double floor0 = most - feature_bound(table + top * B, step, B);
  near.clear();
  if (!inputs_finite || !finite || !std::isfinite(floor0) || !std::isfinite(steps)) {
    for (int64_t v = 0; v < N; ++v) logits[v] = exact(v);
    return;
  }
  features_reaching(logits, table + N * B, N, reach_scale(steps), lowered(floor0), near);
  const double floor = bound_features(
      table, step, B, near.size(), [&](size_t i) { return near[i]; },
      [&](size_t i) { return logits[near[i]]; }, bound, floor0);
  size_t kept = 0;
  for (size_t i = 0; i < near.size(); ++i)
    if (logits[near[i]] + bound[i] >= floor) near[kept++] = near[i];
  for (size_t i = 0; i < kept; ++i) {   // their weights, like their bounds, fetched ahead
    if (i + 1 < kept) {
      const char* next = reinterpret_cast<const char*>(blocks + near[i + 1] * row_bytes);
      for (int64_t at = 0; at < row_bytes; at += 64) _mm_prefetch(next + at, _MM_HINT_T0);
      _mm_prefetch(next + row_bytes - 1, _MM_HINT_T0);
    }
    logits[near[i]] = exact(near[i]);
  }
}

// The head's logits [M, N] float32 for x [M, K] (float32 or bf16): the 8-bit product of every
// feature, then each row re-scored (rescore_head_row); `table` as head_bounds makes it.
// Arguments checked by the caller.
template <class E>
void int8_head(const E* x, int64_t M, int64_t K, int64_t kind, const uint8_t* blocks,
               int64_t row_bytes, int64_t N, const float* table, float* logits) {
  Int8Rows rows;
  quantize_rows_int8(x, M, K, rows);
  const int64_t B = K / kBlock;
  with_kind(kind, [&](auto k) {
    constexpr int64_t KIND = decltype(k)::value;
    if constexpr (block_format(KIND).weights == kBlock) {
      int8_blocks_product<KIND>(rows, M, K, blocks, row_bytes, N, Int8Out<float>{logits, N});
      at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
        std::vector<int64_t> near;
        std::vector<double> bound, xd(K);
        for (int64_t r = begin; r < end; ++r)
          rescore_head_row<KIND>(blocks, row_bytes, N, K, x + r * K, rows.step.data() + r * B,
                                 table, logits + r * N, near, bound, xd);
      });
    }
  });
}

// The greedy head: each row's token (the first index of its largest exact logit) without the
// [M, N] logits. Each task's tiles keep, per row, the features that could still be the row's
// argmax by what the task has seen: L_v + U_v reaching the largest L_u - B_u over the running
// bests u (GreedyRow); a row's token is then picked from its tasks' lists as rescore_head_row
// picks (the same candidates at the end, so the same token as the logits' first largest).
struct GreedyRow {
  float best = -INFINITY;     // the largest 8-bit logit seen
  double floor = -INFINITY;   // the largest L_u - B_u over the bests seen
  float reach = -INFINITY;    // floor lowered past the FMA's rounding: what a feature must reach
  bool odd = false;           // a non-finite logit or reach seen
  std::vector<std::pair<int64_t, float>> near;   // (feature, 8-bit logit) kept
};

// Feature v's 8-bit logit L kept for a row; a new best is bounded, and a higher floor raises
// the row's reach that every task reads (`shared`).
inline void keep_one(GreedyRow& g, int64_t v, float L, const float* table, const float* step,
                     int64_t B, std::atomic<float>& shared) {
  g.near.emplace_back(v, L);
  if (L > g.best) {
    g.best = L;
    g.floor = std::max(g.floor, L - feature_bound(table + v * B, step, B));
    g.reach = lowered(g.floor);
    float seen = shared.load(std::memory_order_relaxed);
    while (g.reach > seen &&
           !shared.compare_exchange_weak(seen, g.reach, std::memory_order_relaxed)) {
    }
  }
}

// Lanes `hit` of a tile row's sums (features f0 ..) kept (keep_one).
__attribute__((noinline, cold)) inline void keep_hits(GreedyRow& g, int64_t f0, __m512 v0,
                                                     __m512 v1, uint32_t hit, const float* table,
                                                     const float* step, int64_t B,
                                                     std::atomic<float>& shared) {
  alignas(64) float sums[32];
  _mm512_store_ps(sums, v0);
  _mm512_store_ps(sums + 16, v1);
  for (; hit; hit &= hit - 1) {
    const int lane = __builtin_ctz(hit);
    keep_one(g, f0 + lane, sums[lane], table, step, B, shared);
  }
}

// A task's panels [begin, end) of the greedy head: the 8-bit tiles' sums parked, then each
// row's checked against its reach (one FMA and one compare per 16 features), not stored.
template <int64_t KIND>
__attribute__((noinline)) void greedy_panels(const Int8Rows& x, int64_t M, int64_t K,
                                             const uint8_t* blocks, int64_t row_bytes, int64_t N,
                                             const float* table, const float* scale,
                                             GreedyRow* rows, std::atomic<float>* shared,
                                             int64_t begin, int64_t end) {
  const int64_t B = K / kBlock;
  const float* widest = table + N * B;
  Int8Panel panel;
  std::vector<float> sums(M * kInt8Panel);   // a panel's tile sums, parked (as fused_panels)
  for (int64_t p = begin; p < end; ++p) {
    const int64_t f0 = p * kInt8Panel, count = std::min(kInt8Panel, N - f0);
    const __mmask16 low = static_cast<__mmask16>(count >= 16 ? 0xFFFF : (1u << count) - 1);
    const __mmask16 high = static_cast<__mmask16>(
        count >= 32 ? 0xFFFF : count > 16 ? (1u << (count - 16)) - 1 : 0);
    const __m512 w0 = _mm512_maskz_loadu_ps(low, widest + f0);
    const __m512 w1 = _mm512_maskz_loadu_ps(high, widest + f0 + 16);
    unpack_int8_panel<KIND>(blocks, row_bytes, K, f0, count, panel);
    int8_panel_rows(x, M, K, panel, [&](int64_t r, __m512 v0, __m512 v1) {
      _mm512_storeu_ps(sums.data() + r * kInt8Panel, v0);
      _mm512_storeu_ps(sums.data() + r * kInt8Panel + 16, v1);
    });
    for (int64_t r = 0; r < M; ++r) {
      GreedyRow& g = rows[r];
      const __m512 v0 = _mm512_loadu_ps(sums.data() + r * kInt8Panel);
      const __m512 v1 = _mm512_loadu_ps(sums.data() + r * kInt8Panel + 16);
      const __m512 by = _mm512_set1_ps(scale[r]);
      const __m512 reach = _mm512_set1_ps(std::max(g.reach, shared[r].load(std::memory_order_relaxed)));
      const __m512 t0 = _mm512_fmadd_ps(by, w0, v0), t1 = _mm512_fmadd_ps(by, w1, v1);
      constexpr int kNotFinite = 0x99;   // NaNs and infinities
      if (_mm512_mask_fpclass_ps_mask(low, t0, kNotFinite) |
          _mm512_mask_fpclass_ps_mask(high, t1, kNotFinite))
        g.odd = true;
      const uint32_t hit = _mm512_mask_cmp_ps_mask(low, t0, reach, _CMP_GE_OQ) |
                           static_cast<uint32_t>(_mm512_mask_cmp_ps_mask(high, t1, reach,
                                                                         _CMP_GE_OQ)) << 16;
      if (hit) keep_hits(g, f0, v0, v1, hit, table, x.step.data() + r * B, B, shared[r]);
    }
  }
}

// A decode batch against a Q8_0 head with the rows in the vector lanes. The panels above
// unpack every 32 features of the head per call (a transpose and a gather a block), which at
// 32 rows was ~30% of the greedy head, and fold each block's sums with three operations on the
// VPDPBUSD pipes. Here each feature's code words are broadcast straight from the file's blocks
// (shifted by 128 to unsigned bytes) against 16 rows' words of x's codes a register, so nothing
// is unpacked; the shift's term, -128 sum(q) of each row's block, starts the integer sums, which
// are then the exact sum(code q); and a block folds with a multiply (x's steps, 16 rows a
// register) and an FMA (the block's d). The 8-bit logits are those of the panels up to float32
// rounding, within the same bound (fewer roundings, of smaller terms). Each tile fetches the
// next tile's rows a block ahead: without it the tiles ran 20% slower than the panels (six
// interleaved streams the hardware prefetcher missed); with it SmolLM2's greedy head took
// 1.46-1.50 against 2.19-2.23 ms at 32 rows, 0.95 against 1.21 at 16 and 2.86-2.93 against
// 3.26-3.54 at 64 (alternating builds, 2-core Zen 5).

// The 8-bit logits of F features from f0 for register rows g0 .. g0 + RV - 1: out[f][rv].
template <int F, int RV>
inline void lane_tile(const uint8_t* blocks, int64_t row_bytes, int64_t f0, int64_t B,
                      const LaneRows& x, int64_t g0, __m512 out[F][RV]) {
  constexpr int64_t kBytes = 34;   // Q8_0: d (fp16), then 32 signed codes
  __m512 acc[F][RV];
  for (int f = 0; f < F; ++f)
    for (int v = 0; v < RV; ++v) acc[f][v] = _mm512_setzero_ps();
  const __m512i to_unsigned = _mm512_set1_epi8(-128);
  for (int64_t b = 0; b < B; ++b) {
    prefetch_tile_rows<F>(blocks, row_bytes, f0 + F, b * kBytes);
    __m512i sums[F][RV];
    for (int v = 0; v < RV; ++v) {
      const __m512i shift = x.shift[(g0 + v) * B + b];
      for (int f = 0; f < F; ++f) sums[f][v] = shift;
    }
    const __m512i* codes = x.codes.data() + b * 8;
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {
      __m512i rows[RV];
      for (int v = 0; v < RV; ++v) rows[v] = codes[(g0 + v) * B * 8 + p];
      for (int f = 0; f < F; ++f) {
        int32_t word;
        std::memcpy(&word, blocks + (f0 + f) * row_bytes + b * kBytes + 2 + 4 * p, 4);
        const __m512i w = _mm512_xor_si512(_mm512_set1_epi32(word), to_unsigned);
        for (int v = 0; v < RV; ++v) sums[f][v] = _mm512_dpbusd_epi32(sums[f][v], w, rows[v]);
      }
    }
    for (int f = 0; f < F; ++f) {
      const __m512 d = _mm512_set1_ps(half_at(blocks + (f0 + f) * row_bytes + b * kBytes));
      for (int v = 0; v < RV; ++v)
        acc[f][v] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums[f][v]),
                                                  x.step[(g0 + v) * B + b]), d, acc[f][v]);
    }
  }
  for (int f = 0; f < F; ++f)
    for (int v = 0; v < RV; ++v) out[f][v] = acc[f][v];
}

constexpr int kLaneFeatures = 6;   // features a lane tile holds (6 x 2 registers of rows)

// A task's tiles [begin, end) of kLaneFeatures features against every row, as greedy_panels
// checks its panels: each row's logit against its reach, a feature that reaches it kept.
__attribute__((noinline)) inline void greedy_lane_tiles(
    const Int8Rows& x, const LaneRows& lanes, int64_t M, int64_t K, const uint8_t* blocks,
    int64_t row_bytes, int64_t N, const float* table, const float* scale, GreedyRow* rows,
    std::atomic<float>* shared, int64_t begin, int64_t end) {
  const int64_t B = K / kBlock;
  const float* widest = table + N * B;
  alignas(64) float reach[16], logits[16];
  for (int64_t tile = begin; tile < end; ++tile) {
    const int64_t f0 = tile * kLaneFeatures;
    const int64_t count = std::min<int64_t>(kLaneFeatures, N - f0);
    for (int64_t g0 = 0; g0 < lanes.groups; g0 += 2) {
      const int64_t groups = std::min<int64_t>(2, lanes.groups - g0);
      __m512 out[kLaneFeatures][2];
      spmd_cpu::with_row_count<1, kLaneFeatures>(count, [&](auto fc) {
        constexpr int Fc = decltype(fc)::value;
        __m512 part[Fc][2];
        if (groups == 2) {
          lane_tile<Fc, 2>(blocks, row_bytes, f0, B, lanes, g0, part);
        } else {
          __m512 one[Fc][1];
          lane_tile<Fc, 1>(blocks, row_bytes, f0, B, lanes, g0, one);
          for (int f = 0; f < Fc; ++f) part[f][0] = one[f][0];
        }
        for (int f = 0; f < Fc; ++f)
          for (int v = 0; v < groups; ++v) out[f][v] = part[f][v];
      });
      for (int64_t v = 0; v < groups; ++v) {
        const int64_t r0 = (g0 + v) * 16, n = std::min<int64_t>(16, M - r0);
        const __mmask16 real = static_cast<__mmask16>(n == 16 ? 0xFFFF : (1u << n) - 1);
        for (int64_t r = 0; r < n; ++r)
          reach[r] = std::max(rows[r0 + r].reach, shared[r0 + r].load(std::memory_order_relaxed));
        const __m512 by = _mm512_maskz_loadu_ps(real, scale + r0);
        const __m512 at_least = _mm512_maskz_loadu_ps(real, reach);
        for (int64_t f = 0; f < count; ++f) {
          const __m512 t = _mm512_fmadd_ps(by, _mm512_set1_ps(widest[f0 + f]), out[f][v]);
          constexpr int kNotFinite = 0x99;   // NaNs and infinities
          for (__mmask16 odd = _mm512_mask_fpclass_ps_mask(real, t, kNotFinite); odd;
               odd &= odd - 1)
            rows[r0 + __builtin_ctz(odd)].odd = true;
          __mmask16 hit = _mm512_mask_cmp_ps_mask(real, t, at_least, _CMP_GE_OQ);
          if (!hit) continue;
          _mm512_store_ps(logits, out[f][v]);
          for (; hit; hit &= hit - 1) {
            const int lane = __builtin_ctz(hit);
            keep_one(rows[r0 + lane], f0 + f, logits[lane], table,
                     x.step.data() + (r0 + lane) * B, B, shared[r0 + lane]);
          }
        }
      }
    }
  }
}

// Rows from which a Q8_0 greedy head takes the lane tiles (fewer fill too few lanes).
constexpr int64_t kLaneRowsFrom = 16;

// The first index of the largest of n values, or of the first NaN (as greedy_tokens picks).
inline int64_t first_largest_of(const std::vector<float>& values) {
  int64_t at = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(values.size()); ++i) {
    if (std::isnan(values[i])) return i;
    if (values[i] > values[at]) at = i;
  }
  return at;
}

// Row r's token from its tasks' states: every kept feature bounded, those whose exact logit
// could be the largest re-scored, the first largest of them taken; a row with a non-finite
// input, step or logit re-scored whole.
template <int64_t KIND, class E>
int64_t greedy_row_token(const std::vector<GreedyRow*>& parts, const uint8_t* blocks,
                         int64_t row_bytes, int64_t N, int64_t K, const E* x, const float* step,
                         double steps, float scale, const float* table,
                         std::vector<double>& xd) {
  const int64_t B = K / kBlock;
  const auto exact = [&](int64_t v) { return exact_logit<KIND>(blocks + v * row_bytes, xd.data(), K); };
  double floor = -INFINITY;
  bool odd = !widen_row(x, K, xd) || !std::isfinite(steps);
  for (const GreedyRow* g : parts) {
    floor = std::max(floor, g->floor);
    odd = odd || g->odd;
  }
  if (odd || !std::isfinite(floor)) {
    std::vector<float> all(N);
    for (int64_t v = 0; v < N; ++v) all[v] = exact(v);
    return first_largest_of(all);
  }
  // A task kept what reached its own running floor; most fall short of the row's (~1,100 kept
  // a row at 64 rows of random-token prompts, ~125 reach the row's floor).
  std::vector<std::pair<int64_t, float>> near;
  const float* widest = table + N * B;
  const float reach = lowered(floor);
  for (const GreedyRow* g : parts)
    for (const auto& [v, L] : g->near)
      if (std::fma(scale, widest[v], L) >= reach) near.emplace_back(v, L);
  std::vector<double> bound;
  floor = bound_features(
      table, step, B, near.size(), [&](size_t i) { return near[i].first; },
      [&](size_t i) { return near[i].second; }, bound, floor);
  int64_t token = -1;
  float most = -INFINITY;
  for (size_t i = 0; i < near.size(); ++i) {
    if (near[i].second + bound[i] < floor) continue;
    const float logit = exact(near[i].first);   // features in increasing order: the first kept
    if (token < 0 || logit > most) token = near[i].first, most = logit;
  }
  return token;
}

// Each row's greedy token (int64 [M]) for x [M, K] (float32 or bf16), the head's logits never
// stored: greedy_panels over a task's share of the panels, then greedy_row_token. `table` as
// head_bounds makes it; arguments checked by the caller.
template <class E>
void int8_greedy_head(const E* x, int64_t M, int64_t K, int64_t kind, const uint8_t* blocks,
                      int64_t row_bytes, int64_t N, const float* table, int64_t* tokens) {
  Int8Rows rows;
  quantize_rows_int8(x, M, K, rows);
  const int64_t B = K / kBlock, panels = (N + kInt8Panel - 1) / kInt8Panel;
  std::vector<double> steps(M);
  std::vector<float> scale(M);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < B; ++b) steps[r] += rows.step[r * B + b];
    scale[r] = reach_scale(steps[r]);
  }
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), panels));
  std::vector<std::vector<GreedyRow>> states(tasks, std::vector<GreedyRow>(M));
  std::vector<std::atomic<float>> reach(M);
  for (auto& r : reach) r.store(-INFINITY, std::memory_order_relaxed);
  with_kind(kind, [&](auto k) {
    constexpr int64_t KIND = decltype(k)::value;
    if constexpr (block_format(KIND).weights == kBlock) {
      // A task's share of the Q8_0 lane tiles (decode batches) or of the panels.
      const bool in_lanes = KIND == kQ8_0 && M >= kLaneRowsFrom;
      LaneRows lanes;
      if (in_lanes) lane_rows(rows, M, K, lanes);
      const int64_t units = in_lanes ? (N + kLaneFeatures - 1) / kLaneFeatures : panels;
      at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t first = units * t / tasks, last = units * (t + 1) / tasks;
          if (in_lanes)
            greedy_lane_tiles(rows, lanes, M, K, blocks, row_bytes, N, table, scale.data(),
                              states[t].data(), reach.data(), first, last);
          else
            greedy_panels<KIND>(rows, M, K, blocks, row_bytes, N, table, scale.data(),
                                states[t].data(), reach.data(), first, last);
        }
      });
      at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
        std::vector<double> xd(K);
        std::vector<GreedyRow*> parts(tasks);
        for (int64_t r = begin; r < end; ++r) {
          for (int64_t t = 0; t < tasks; ++t) parts[t] = &states[t][r];
          tokens[r] = greedy_row_token<KIND>(parts, blocks, row_bytes, N, K, x + r * K,
                                             rows.step.data() + r * B, steps[r], scale[r], table,
                                             xd);
        }
      });
    }
  });
}

#endif  // SPMD_GGUF_INT8
