// bfloat16 attention products with AVX512-BF16 dot products (VDPBF16PS): bf16 x bf16 pairs
// summed into float32 lanes, 32 products an instruction, twice the float32 FMA's rate.
//
// Both products of prompt attention are register tiles of R query rows:
// - scores (qk_tile): lanes are 16 keys; each step broadcasts a query row's next pair of
//   dimensions against 16 keys' same pair, so the keys are first packed in groups of 16 as
//   [dimension pair][key] 32-bit words (pack_keys).
// - value sums (pv_tile): lanes are 16 dimensions; each step broadcasts a row's weights of two
//   consecutive keys against both keys' values of 16 dimensions, so the values are packed as
//   [key pair][dimension][2] (pack_values), and the weights are bf16 rows.
// Each tile keeps R x 4 (scores) or R x D/16 (sums) accumulators in the 32 vector registers.
// Keys past the end are packed as zeros, so tiles need no tail handling along the keys.
//
// Decode attention reads the paged cache in place, so its keys are not packed: a token's score
// is a row of D/32 dot products summed across lanes, 16 tokens' rows summed at once
// (lane_sums); its value sums interleave two tokens' rows (pair_rows) against their weights.
#pragma once

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu_avx512.h"
#include "cpu_bf16.h"

namespace spmd_cpu {

constexpr int64_t kKeyGroup = 16;            // keys in a packed group (one register's lanes)
constexpr int64_t kKeyTile = 4 * kKeyGroup;  // keys in one score tile

inline uint32_t load_pair(const bf16_bits* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof word);
  return word;
}

// Keys [0, n) of one KV head (row_of(key): its D elements) packed for qk_tile: group g, pair p,
// key j at word (g * D/2 + p) * 16 + j; keys n .. n_pad - 1 zero.
template <typename RowOf>
inline void pack_keys(RowOf row_of, int64_t n, int64_t n_pad, int64_t D, uint32_t* packed) {
  const int64_t pairs = D / 2;
  for (int64_t key = 0; key < n_pad; ++key) {
    uint32_t* dst = packed + (key / kKeyGroup) * pairs * kKeyGroup + key % kKeyGroup;
    if (key < n) {
      const bf16_bits* row = row_of(key);
      for (int64_t p = 0; p < pairs; ++p) dst[p * kKeyGroup] = load_pair(row + 2 * p);
    } else {
      for (int64_t p = 0; p < pairs; ++p) dst[p * kKeyGroup] = 0;
    }
  }
}

// Values [0, n) of one KV head (row_of(key)) packed for pv_tile: key pair c, dimension d at
// elements (c * D + d) * 2 + {0, 1} (keys 2c and 2c + 1); keys n .. n_pad - 1 zero (n_pad even).
template <typename RowOf>
inline void pack_values(RowOf row_of, int64_t n, int64_t n_pad, int64_t D, bf16_bits* packed) {
  for (int64_t key = 0; key < n_pad; ++key) {
    bf16_bits* dst = packed + (key / 2) * D * 2 + key % 2;
    if (key < n) {
      const bf16_bits* row = row_of(key);
      for (int64_t d = 0; d < D; ++d) dst[2 * d] = row[d];
    } else {
      for (int64_t d = 0; d < D; ++d) dst[2 * d] = 0;
    }
  }
}

// Scores of R query rows (bf16, D each, `ldq` apart) against T groups of 16 keys (T <= 4, a
// score tile's kKeyTile keys or its first groups) packed at `keys` (pack_keys' layout, from a
// group boundary), times `scale`, into float rows `lds` apart.
template <int R, int T = 4>
inline void qk_tile(const bf16_bits* q, int64_t ldq, const uint32_t* keys, int64_t D,
                    float scale, float* s, int64_t lds) {
  const int64_t pairs = D / 2, group = pairs * kKeyGroup;
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh k[T];
    for (int t = 0; t < T; ++t)
      k[t] = (__m512bh)_mm512_loadu_si512(keys + t * group + p * kKeyGroup);
    for (int r = 0; r < R; ++r) {
      const __m512bh qr = (__m512bh)_mm512_set1_epi32(static_cast<int>(load_pair(q + r * ldq + 2 * p)));
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], qr, k[t]);
    }
  }
  const __m512 scaled = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      _mm512_storeu_ps(s + r * lds + t * kKeyGroup, _mm512_mul_ps(acc[r][t], scaled));
}

// Value sums of R rows of weights (bf16, `ldw` apart, `pairs` pairs of keys each) over the
// values packed at `values` (pack_values' layout, from the same key), DV * 16 dimensions: row
// r's sums times inverse[r] are rounded into out[r] (bf16).
template <int R, int DV>
inline void pv_tile(const bf16_bits* w, int64_t ldw, const bf16_bits* values, int64_t pairs,
                    const float* inverse, bf16_bits* const* out) {
  constexpr int64_t D = DV * 16;
  __m512 acc[R][DV];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < DV; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < pairs; ++c) {
    __m512bh v[DV];
    for (int t = 0; t < DV; ++t)
      v[t] = (__m512bh)_mm512_loadu_si512(values + (c * D + t * 16) * 2);
    for (int r = 0; r < R; ++r) {
      const __m512bh wr = (__m512bh)_mm512_set1_epi32(static_cast<int>(load_pair(w + r * ldw + 2 * c)));
      for (int t = 0; t < DV; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wr, v[t]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 inv = _mm512_set1_ps(inverse[r]);
    for (int t = 0; t < DV; ++t) vstore_bf16(out[r] + t * 16, _mm512_mul_ps(acc[r][t], inv));
  }
}

// Two value rows' 32 dimensions from `offset` interleaved for VDPBF16PS: lane 4j + e of `low`
// holds dimension offset + 8j + e of both rows, of `high` dimension offset + 8j + 4 + e.
inline void pair_rows(const bf16_bits* a, const bf16_bits* b, int64_t offset, __m512bh& low,
                      __m512bh& high) {
  const __m512i x = _mm512_loadu_si512(a + offset), y = _mm512_loadu_si512(b + offset);
  low = (__m512bh)_mm512_unpacklo_epi16(x, y);
  high = (__m512bh)_mm512_unpackhi_epi16(x, y);
}

// Undoes pair_rows' order: 32 dimensions from the sums of `low` and `high`, times `scale`.
inline void store_paired(__m512 low, __m512 high, float scale, bf16_bits* out) {
  alignas(64) float lo[16], hi[16], natural[32];
  _mm512_store_ps(lo, low);
  _mm512_store_ps(hi, high);
  for (int j = 0; j < 4; ++j)
    for (int e = 0; e < 4; ++e) {
      natural[8 * j + e] = lo[4 * j + e];
      natural[8 * j + 4 + e] = hi[4 * j + e];
    }
  const __m512 s = _mm512_set1_ps(scale);
  vstore_bf16(out, _mm512_mul_ps(_mm512_load_ps(natural), s));
  vstore_bf16(out + 16, _mm512_mul_ps(_mm512_load_ps(natural + 16), s));
}

// A softmax row of n float32 scores as bfloat16 weights: exp(s - max) rounded into w[0, n)
// (w may overlay s: each 16 floats are read before their bytes are written); returns 1 / the
// float32 sum of the unrounded exps.
inline float softmax_bf16_row(const float* s, int64_t n, bf16_bits* w) {
  const __m512 log2e = _mm512_set1_ps(kLog2e);
  const __m512 shift = _mm512_set1_ps(-row_max(s, n) * kLog2e);
  __m512 sums = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = vexp2(_mm512_fmadd_ps(_mm512_loadu_ps(s + i), log2e, shift));
    sums = _mm512_add_ps(sums, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + i), (__m256i)_mm512_cvtneps_pbh(e));
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(
        tail, vexp2(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, s + i), log2e, shift)));
    sums = _mm512_add_ps(sums, e);
    _mm256_mask_storeu_epi16(w + i, tail, (__m256i)_mm512_cvtneps_pbh(e));
  }
  return 1.f / _mm512_reduce_add_ps(sums);
}

}  // namespace spmd_cpu

#endif  // __AVX512BF16__
