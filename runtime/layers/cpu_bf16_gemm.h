// bfloat16 GEMM tiles for weights packed on the fly (a GGUF projection's blocks dequantized a
// panel at a time, cpu_group_quant.cpp gguf_bf16_linear): the weights of 32 output features
// packed as [pair of in_features][feature] 32-bit words, so that one VDPBF16PS multiplies a
// row's pair of inputs (broadcast) by 16 features' same pair and a register tile of R rows x 32
// features keeps 2R float32 accumulators with no sums across lanes (cf. cpu_bf16_linear.cpp,
// whose few-row tiles read the weights row-major and sum lanes at the end).
#pragma once

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu_avx512.h"
#include "cpu_bf16.h"
#include "cpu_math.h"

namespace spmd_cpu {

constexpr int64_t kGemmPanel = 32;   // output features a packed panel holds (two registers)
constexpr int64_t kGemmRows = 12;    // rows of a register tile: 24 accumulators

// kGemmPanel weight rows of K bf16 (row j at rows + j * K; K a multiple of 32) packed: word
// (p * kGemmPanel + j) holds row j's inputs 2p and 2p + 1.
inline void pack_gemm_panel(const bf16_bits* rows, int64_t K, uint32_t* packed) {
  static_assert(kGemmPanel == 32);
  pack_word_panel(rows, K / 2, packed);
}

// Rows x[0, R) (K apart) against a packed panel: done(r, low, high) receives row r's float32
// sums of features 0-15 (low) and 16-31 (high).
template <int R, class Done>
inline void gemm_tile(const bf16_bits* x, int64_t K, const uint32_t* packed, Done&& done) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  uint32_t word;
  for (int64_t p = 0; p < K / 2; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(packed + p * kGemmPanel);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(packed + p * kGemmPanel + 16);
    for (int r = 0; r < R; ++r) {
      std::memcpy(&word, x + r * K + 2 * p, sizeof word);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
    }
  }
  for (int r = 0; r < R; ++r) done(r, acc[r][0], acc[r][1]);
}

// Every row of x [M, K] against a packed panel, kGemmRows at a time: done(row, low, high) as
// gemm_tile's.
template <class Done>
inline void gemm_panel_rows(const bf16_bits* x, int64_t M, int64_t K, const uint32_t* packed,
                            Done&& done) {
  int64_t r = 0;
  const auto at = [&](int64_t r0) {
    return [&, r0](int64_t i, __m512 low, __m512 high) { done(r0 + i, low, high); };
  };
  for (; r + kGemmRows <= M; r += kGemmRows) gemm_tile<kGemmRows>(x + r * K, K, packed, at(r));
  with_row_count<1, kGemmRows - 1>(M - r, [&](auto rows) {
    gemm_tile<decltype(rows)::value>(x + r * K, K, packed, at(r));
  });
}

// The same, each row's 32 outputs rounded to bf16 once into out (rows ldo apart).
inline void gemm_panel_rows(const bf16_bits* x, int64_t M, int64_t K, const uint32_t* packed,
                            bf16_bits* out, int64_t ldo) {
  gemm_panel_rows(x, M, K, packed, [&](int64_t r, __m512 low, __m512 high) {
    _mm512_storeu_si512(out + r * ldo, (__m512i)_mm512_cvtne2ps_pbh(high, low));
  });
}

// The same, each row's 32 float32 sums stored as they are.
inline void gemm_panel_rows(const bf16_bits* x, int64_t M, int64_t K, const uint32_t* packed,
                            float* out, int64_t ldo) {
  gemm_panel_rows(x, M, K, packed, [&](int64_t r, __m512 low, __m512 high) {
    _mm512_storeu_ps(out + r * ldo, low);
    _mm512_storeu_ps(out + r * ldo + 16, high);
  });
}

// A float32 sum as bf16 rounds it (nearest, ties to even), widened back.
inline __m512 round_bf16(__m512 x) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

// The bf16 epilogues of a tile's float32 sums, each the bits of its separate pass over the
// product rounded to bf16: residual + product (torch's bf16 add; 16 residual values), and
// SiLU(gate) * up (silu_mul's bf16 step) of 16 gate features' sums and their up features'.
inline __m512 plus_rounded(__m512 sums, const bf16_bits* residual) {
  return _mm512_add_ps(round_bf16(sums), vload_bf16(residual));
}
inline __m512 silu_mul_rounded(__m512 gate, __m512 up) {
  return silu_mul_lanes(round_bf16(gate), round_bf16(up));
}

// A fused gate/up weight's panel p (gate rows first, `half` of each): its lane j < 16 holds
// gate feature 16p + j, lane 16 + j that gate's up feature, `half` rows later.
inline int64_t gated_panel_feature(int64_t p, int64_t j, int64_t half) {
  return j < 16 ? 16 * p + j : half + 16 * p + (j - 16);
}

// Rows in the lanes, for 16 to kLanesMaxRows rows: the transpose of the tiles above, so the
// weights need no packing. x is packed once per product as [pair of inputs][row] words (16 rows
// a register, zero past the last row), and a tile of RV registers of rows x F output features
// broadcasts each feature's pair of inputs from its bf16 row-major weights against the rows'
// same pair. Each output is the same sum, in the same order, as gemm_tile's.
constexpr int64_t kLanesMaxRows = 48;


// x [M, K] (K a multiple of 32) packed for lanes_tile: word (p * RV + v) * 16 + j holds row
// 16v + j's inputs 2p and 2p + 1 (zero for rows >= M), RV = lane_registers(M).
inline void pack_lanes(const bf16_bits* x, int64_t M, int64_t K, uint32_t* packed) {
  pack_word_lanes(x, M, K / 2, packed);
}

// F of a row's float32 sums into dst: rounded to bf16 once, or as they are.
inline void store_features(bf16_bits* dst, __mmask16 features, __m512 sums) {
  _mm256_mask_storeu_epi16(dst, features, (__m256i)_mm512_cvtneps_pbh(sums));
}
inline void store_features(float* dst, __mmask16 features, __m512 sums) {
  _mm512_mask_storeu_ps(dst, features, sums);
}

// Rows [0, M) (M <= 16 * RV) packed by pack_lanes against F weight rows of K bf16 (row f at
// w + f * K): out[r * ldo + f] receives row r's output f, its float32 sum (rounded to bf16 once
// where out is bf16).
template <int RV, int F, class Out>
inline void lanes_tile(const uint32_t* packed, int64_t M, int64_t K, const bf16_bits* w,
                       Out* out, int64_t ldo) {
  static_assert(F <= 16 && RV * F <= 24);
  __m512 acc[F][RV];
  for (int f = 0; f < F; ++f)
    for (int v = 0; v < RV; ++v) acc[f][v] = _mm512_setzero_ps();
  uint32_t word;
  for (int64_t p = 0; p < K / 2; ++p) {
    __m512bh rows[RV];
    for (int v = 0; v < RV; ++v) rows[v] = (__m512bh)_mm512_loadu_si512(packed + (p * RV + v) * 16);
    for (int f = 0; f < F; ++f) {
      std::memcpy(&word, w + f * K + 2 * p, sizeof word);
      const __m512bh wb = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
      for (int v = 0; v < RV; ++v) acc[f][v] = _mm512_dpbf16_ps(acc[f][v], wb, rows[v]);
    }
  }
  const __mmask16 features = static_cast<__mmask16>((1u << F) - 1);
  store_lane_rows(acc, M, [&](int64_t r, __m512 sums) {
    store_features(out + r * ldo, features, sums);
  });
}

}  // namespace spmd_cpu

#endif
