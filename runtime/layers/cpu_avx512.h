// What the AVX-512 kernels share (bf16 and float32 tiles, attention): a row count made a
// template argument, a 16 x 16 transpose of 32-bit words, the lane sums of 16 registers, and
// the packing of rows into the lanes (16 rows a register) or of a 32-row panel feature-minor.
#pragma once

#include <cstdint>
#include <type_traits>

namespace spmd_cpu {

// f(std::integral_constant<int, count>{}) for a count in [N, MOST]: a register tile's row count
// or a query group's size made a template argument; nothing for other counts.
template <int N, int MOST, class F>
inline void with_row_count(int64_t count, F&& f) {
  if constexpr (N <= MOST) {
    if (count == N) return f(std::integral_constant<int, N>{});
    with_row_count<N + 1, MOST>(count, f);
  }
}

}  // namespace spmd_cpu

#if defined(__AVX512F__)
#include <immintrin.h>

namespace spmd_cpu {

// Registers of 16 rows (the lanes) for M rows.
inline int64_t lane_registers(int64_t M) { return (M + 15) / 16; }

// r[0..16) as 16 rows of 16 32-bit words -> r[c] = column c (word c of each row, in row order).
inline void transpose_words(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4g + e]: in each 128-bit lane L, rows 4g .. 4g+3's word 4L + e.
  for (int g = 0; g < 4; ++g) {
    const __m512i* q = t + 4 * g;
    u[4 * g + 0] = _mm512_unpacklo_epi64(q[0], q[2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(q[0], q[2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(q[1], q[3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(q[1], q[3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i s0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44);
    const __m512i s1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44);
    const __m512i s3 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
    r[e] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    r[8 + e] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
}

// The lane sums of 16 registers: lane i of the result is the sum of a[i]'s lanes. Four rounds
// each add two registers' halves side by side (two-source permutes), halving the lanes per
// register and doubling the registers per vector: 45 instructions for 16 sums. a is clobbered.
inline __m512 lane_sums(__m512* a) {
  static const struct Indices {
    __m512i low[4], high[4];
    Indices() {
      for (int round = 0; round < 4; ++round) {
        const int width = 8 >> round, per = 1 << round;     // lanes a token keeps; tokens a row
        alignas(64) int32_t low_at[16], high_at[16];
        for (int i = 0; i < 16; ++i) {
          const int token = i / width, lane = i % width;
          const int from = (token % per) * 2 * width + lane + (token >= per ? 16 : 0);
          low_at[i] = from;
          high_at[i] = from + width;
        }
        low[round] = _mm512_load_si512(low_at);
        high[round] = _mm512_load_si512(high_at);
      }
    }
  } idx;
  for (int round = 0, n = 16; round < 4; ++round, n /= 2)
    for (int i = 0; i < n / 2; ++i)
      a[i] = _mm512_add_ps(_mm512_permutex2var_ps(a[2 * i], idx.low[round], a[2 * i + 1]),
                           _mm512_permutex2var_ps(a[2 * i], idx.high[round], a[2 * i + 1]));
  return a[0];
}

// 32-bit words, `words` a row (a float each, or a bf16 pair), of 16-row groups packed so that
// a register holds one word of 16 rows: rows [0, M) of x (row r at x + r * words) into
// packed[(p * RV + v) * 16 + j] = row 16v + j's word p (zero for rows >= M), RV =
// lane_registers(M). `words` a multiple of 16.
inline void pack_word_lanes(const void* x, int64_t M, int64_t words, uint32_t* packed) {
  const auto* rows = static_cast<const uint32_t*>(x);
  const int64_t RV = lane_registers(M);
  for (int64_t v = 0; v < RV; ++v)
    for (int64_t p = 0; p < words; p += 16) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j)
        r[j] = 16 * v + j < M ? _mm512_loadu_si512(rows + (16 * v + j) * words + p)
                              : _mm512_setzero_si512();
      transpose_words(r);
      for (int c = 0; c < 16; ++c) _mm512_storeu_si512(packed + ((p + c) * RV + v) * 16, r[c]);
    }
}

// 32 rows of `words` 32-bit words (row j at x + j * words; `words` a multiple of 16) packed
// feature-minor: packed[p * 32 + j] = row j's word p.
inline void pack_word_panel(const void* x, int64_t words, uint32_t* packed) {
  const auto* rows = static_cast<const uint32_t*>(x);
  for (int64_t p = 0; p < words; p += 16)
    for (int64_t half = 0; half < 32; half += 16) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(rows + (half + j) * words + p);
      transpose_words(r);
      for (int c = 0; c < 16; ++c) _mm512_storeu_si512(packed + (p + c) * 32 + half, r[c]);
    }
}

// A rows-in-the-lanes tile's sums out as rows: acc[f][v] holds output feature f of rows 16v ..
// 16v + 15 (lane j: row 16v + j); each row r < M gets its F sums through store(r, sums), lane f
// of `sums` holding feature f (lanes past F zero).
template <int F, int RV, class Store>
inline void store_lane_rows(const __m512 (&acc)[F][RV], int64_t M, Store&& store) {
  for (int v = 0; v < RV; ++v) {
    __m512i t[16];
    for (int f = 0; f < F; ++f) t[f] = _mm512_castps_si512(acc[f][v]);
    for (int f = F; f < 16; ++f) t[f] = _mm512_setzero_si512();
    transpose_words(t);   // t[j]: row 16v + j's F sums
    for (int j = 0; j < 16 && 16 * v + j < M; ++j) store(16 * v + j, _mm512_castsi512_ps(t[j]));
  }
}

}  // namespace spmd_cpu

#endif
