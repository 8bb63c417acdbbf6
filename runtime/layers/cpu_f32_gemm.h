// float32 register tiles for weights made on the fly (a GGUF projection's blocks dequantized to
// float32 a panel of output features at a time, cpu_group_quant.cpp gguf_linear): the float32
// counterparts of cpu_bf16_gemm.h's tiles, one FMA (16 products) where VDPBF16PS takes 32.
// - Few rows (f32_panel_rows): the panel's rows of weights read row-major, two rows of x at a
//   time, each output's 16 lanes of partial sums added across lanes at the end (lane_sums).
// - 16 to kF32LanesMaxRows rows (f32_lanes_tile): the rows in the lanes, x packed once per
//   product as [input][row] (16 rows a register); each feature's weight is broadcast.
// - More rows (f32_gemm_tile): the panel packed as [input][feature] (32 features, two
//   registers), each row's input broadcast, 12 rows x 32 features of accumulators.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>

#include "cpu_avx512.h"

namespace spmd_cpu {

constexpr int64_t kF32FewPanel = 8;      // weight rows of a few-row panel
constexpr int64_t kF32GemmPanel = 32;    // output features of a packed panel
constexpr int64_t kF32GemmRows = 12;     // rows of a packed panel's register tile
constexpr int64_t kF32LanesMaxRows = 48;
constexpr int64_t kF32LanesFromRows = 16;

// Rows a and b (K floats each, K a multiple of 16) against kF32FewPanel weight rows from w (K
// apart): out_a[f] and out_b[f] receive the panel's outputs.
inline void f32_panel_pair(const float* a, const float* b, const float* w, int64_t K,
                           float* out_a, float* out_b) {
  __m512 acc[2 * kF32FewPanel];
  for (auto& v : acc) v = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 xa = _mm512_loadu_ps(a + k), xb = _mm512_loadu_ps(b + k);
    for (int64_t f = 0; f < kF32FewPanel; ++f) {
      const __m512 wf = _mm512_loadu_ps(w + f * K + k);
      acc[f] = _mm512_fmadd_ps(xa, wf, acc[f]);
      acc[kF32FewPanel + f] = _mm512_fmadd_ps(xb, wf, acc[kF32FewPanel + f]);
    }
  }
  alignas(64) float sums[2 * kF32FewPanel];
  _mm512_store_ps(sums, lane_sums(acc));
  for (int64_t f = 0; f < kF32FewPanel; ++f) {
    out_a[f] = sums[f];
    out_b[f] = sums[kF32FewPanel + f];
  }
}

// x [rows, K] against one few-row panel (kF32FewPanel weight rows of K, contiguous):
// out[r * ldo + f] receives row r's output f. A lone last row runs paired with itself.
inline void f32_panel_rows(const float* x, int64_t rows, int64_t K, const float* panel,
                           float* out, int64_t ldo) {
  alignas(64) float spare[kF32FewPanel];
  for (int64_t r = 0; r < rows; r += 2) {
    const bool pair = r + 1 < rows;
    f32_panel_pair(x + r * K, x + (pair ? r + 1 : r) * K, panel, K, out + r * ldo,
                   pair ? out + (r + 1) * ldo : spare);
  }
}

// x [M, K] (K a multiple of 16) packed for f32_lanes_tile: float (k * RV + v) * 16 + j holds
// row 16v + j's input k (zero for rows >= M), RV = lane_registers(M).
inline void f32_pack_lanes(const float* x, int64_t M, int64_t K, float* packed) {
  pack_word_lanes(x, M, K, reinterpret_cast<uint32_t*>(packed));
}

// Rows [0, M) (M <= 16 * RV) packed by f32_pack_lanes against F weight rows of K floats (row f
// at w + f * K): out[r * ldo + f] receives row r's output f.
template <int RV, int F>
inline void f32_lanes_tile(const float* packed, int64_t M, int64_t K, const float* w, float* out,
                           int64_t ldo) {
  static_assert(F <= 16 && RV * F <= 24);
  __m512 acc[F][RV];
  for (int f = 0; f < F; ++f)
    for (int v = 0; v < RV; ++v) acc[f][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 rows[RV];
    for (int v = 0; v < RV; ++v) rows[v] = _mm512_loadu_ps(packed + (k * RV + v) * 16);
    for (int f = 0; f < F; ++f) {
      const __m512 wf = _mm512_set1_ps(w[f * K + k]);
      for (int v = 0; v < RV; ++v) acc[f][v] = _mm512_fmadd_ps(wf, rows[v], acc[f][v]);
    }
  }
  const __mmask16 features = static_cast<__mmask16>((1u << F) - 1);
  store_lane_rows(acc, M, [&](int64_t r, __m512 sums) {
    _mm512_mask_storeu_ps(out + r * ldo, features, sums);
  });
}

// kF32GemmPanel weight rows of K floats (row j at rows + j * K; K a multiple of 16) packed:
// float k * kF32GemmPanel + j holds row j's input k.
inline void f32_pack_panel(const float* rows, int64_t K, float* packed) {
  static_assert(kF32GemmPanel == 32);
  pack_word_panel(rows, K, reinterpret_cast<uint32_t*>(packed));
}

// Rows x[0, R) (K apart) against a packed panel: out[r * ldo + f] (f < 32) receives row r's
// output f.
template <int R>
inline void f32_gemm_tile(const float* x, int64_t K, const float* packed, float* out,
                          int64_t ldo) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(packed + k * kF32GemmPanel);
    const __m512 w1 = _mm512_loadu_ps(packed + k * kF32GemmPanel + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * ldo, acc[r][0]);
    _mm512_storeu_ps(out + r * ldo + 16, acc[r][1]);
  }
}

// Every row of x [M, K] against a packed panel, kF32GemmRows at a time.
inline void f32_gemm_panel_rows(const float* x, int64_t M, int64_t K, const float* packed,
                                float* out, int64_t ldo) {
  int64_t r = 0;
  for (; r + kF32GemmRows <= M; r += kF32GemmRows)
    f32_gemm_tile<kF32GemmRows>(x + r * K, K, packed, out + r * ldo, ldo);
  with_row_count<1, kF32GemmRows - 1>(M - r, [&](auto rows) {
    f32_gemm_tile<decltype(rows)::value>(x + r * K, K, packed, out + r * ldo, ldo);
  });
}

}  // namespace spmd_cpu

#endif
