// Register shuffles of 32-bit lanes that the AVX-512 kernels share (bf16 and float32 tiles,
// attention): a 16 x 16 transpose of words and the lane sums of 16 registers.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

namespace spmd_cpu {

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

// f(std::integral_constant<int, count>{}) for a count in [N, MOST]: a register tile's row count
// made a template argument (the tails of the row loops); nothing for other counts.
template <int N, int MOST, class F>
inline void with_row_count(int64_t count, F&& f) {
  if constexpr (N <= MOST) {
    if (count == N) return f(std::integral_constant<int, N>{});
    with_row_count<N + 1, MOST>(count, f);
  }
}

}  // namespace spmd_cpu

#endif
