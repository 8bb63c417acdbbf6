// Prompt attention's register tiles (cpu_prefill_attention.cpp) for bfloat16 and float32
// elements, built on 32-bit words: a word holds one float32 or a pair of bf16. A step multiplies
// a broadcast word by 16 lanes of words: float32 with one FMA (16 products), bf16 with one
// VDPBF16PS (32 products, float32 sums), the same loops otherwise.
//
// Both products are register tiles of R query rows:
// - scores (qk_tile): lanes are 16 keys; each step broadcasts a query row's next word of
//   dimensions against 16 keys' same word, so the keys are first packed in groups of 16 as
//   [dimension word][key] (pack_keys).
// - value sums (pv_tile): lanes are 16 dimensions; each step broadcasts a row's weights of the
//   keys of one word (two keys in bf16, one in float32) against those keys' values of 16
//   dimensions, so the values are packed as [key word][dimension][key within it]
//   (pack_values), and the weights are rows of the same elements.
// Each tile keeps R x 4 (scores) or R x D/16 (sums) accumulators in the 32 vector registers.
// Keys past the end are packed as zeros, so tiles need no tail handling along the keys.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu_avx512.h"
#include "cpu_bf16.h"
#include "cpu_math.h"

namespace spmd_cpu {

constexpr int64_t kKeyGroup = 16;            // keys in a packed group (one register's lanes)
constexpr int64_t kKeyTile = 4 * kKeyGroup;  // keys in one score tile

// Elements of E in a 32-bit word.
template <class E>
constexpr int64_t kPerWord = 4 / static_cast<int64_t>(sizeof(E));

template <class E>
inline uint32_t load_word(const E* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof word);
  return word;
}

// acc + the products of a broadcast word and 16 lanes of words, summed per lane.
inline __m512 word_madd(__m512 acc, __m512i word, __m512i lanes, const float*) {
  return _mm512_fmadd_ps(_mm512_castsi512_ps(word), _mm512_castsi512_ps(lanes), acc);
}
inline void store_lanes(float* dst, __m512 v) { _mm512_storeu_ps(dst, v); }
inline void store_lanes_part(float* dst, __m512 v, __mmask16 lanes) {
  _mm512_mask_storeu_ps(dst, lanes, v);
}
#if defined(__AVX512BF16__)
inline __m512 word_madd(__m512 acc, __m512i word, __m512i lanes, const bf16_bits*) {
  return _mm512_dpbf16_ps(acc, (__m512bh)word, (__m512bh)lanes);
}
inline void store_lanes(bf16_bits* dst, __m512 v) { vstore_bf16(dst, v); }
inline void store_lanes_part(bf16_bits* dst, __m512 v, __mmask16 lanes) {
  _mm256_mask_storeu_epi16(dst, lanes, (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

// Keys [k0, k1) of one KV head (row_of(key): its D elements; k0 and k1 multiples of 16)
// packed for qk_tile: group g, word p, key j at word (g * W + p) * 16 + j, W = D / kPerWord<E>
// (a multiple of 16); keys from n on zero. Each 16 keys' 16 words are one register transpose.
template <class E, typename RowOf>
inline void pack_keys(RowOf row_of, int64_t n, int64_t k0, int64_t k1, int64_t D,
                      uint32_t* packed) {
  const int64_t words = D / kPerWord<E>;
  for (int64_t g = k0; g < k1; g += kKeyGroup) {
    uint32_t* dst = packed + g * words;
    for (int64_t p = 0; p < words; p += 16) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j)
        r[j] = g + j < n ? _mm512_loadu_si512(row_of(g + j) + kPerWord<E> * p)
                         : _mm512_setzero_si512();
      transpose_words(r);
      for (int c = 0; c < 16; ++c) _mm512_storeu_si512(dst + (p + c) * kKeyGroup, r[c]);
    }
  }
}

// Values [k0, k1) of one KV head (row_of(key); k0 and k1 even) packed for pv_tile: key word c
// (keys c * P .. c * P + P - 1, P = kPerWord<E>), dimension d at elements (c * D + d) * P +
// key % P; keys from n on zero. float32 rows are copied; a bf16 pair's rows are interleaved,
// 32 dimensions at a time (D a multiple of 32).
template <class E, typename RowOf>
inline void pack_values(RowOf row_of, int64_t n, int64_t k0, int64_t k1, int64_t D, E* packed) {
  constexpr int64_t P = kPerWord<E>;
  if constexpr (P == 1) {
    for (int64_t key = k0; key < k1; ++key) {
      if (key < n) std::memcpy(packed + key * D, row_of(key), D * sizeof(E));
      else std::memset(packed + key * D, 0, D * sizeof(E));
    }
  } else {
    alignas(64) static constexpr uint16_t kLow[32] = {
        0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i low = _mm512_load_si512(kLow);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int64_t key = k0; key < k1; key += 2) {
      E* dst = packed + key * D;
      for (int64_t d = 0; d < D; d += 32) {
        const __m512i a = key < n ? _mm512_loadu_si512(row_of(key) + d) : _mm512_setzero_si512();
        const __m512i b = key + 1 < n ? _mm512_loadu_si512(row_of(key + 1) + d)
                                      : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(a, low, b));
        _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(a, high, b));
      }
    }
  }
}

// Scores of R query rows (D elements each, `ldq` apart) against T groups of 16 keys (T <= 4, a
// score tile's kKeyTile keys or its first groups) packed at `keys` (pack_keys' layout, from a
// group boundary), times `scale`, into float rows `lds` apart.
template <int R, int T, class E>
inline void qk_tile(const E* q, int64_t ldq, const uint32_t* keys, int64_t D, float scale,
                    float* s, int64_t lds) {
  const int64_t words = D / kPerWord<E>, group = words * kKeyGroup;
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < words; ++p) {
    __m512i k[T];
    for (int t = 0; t < T; ++t) k[t] = _mm512_loadu_si512(keys + t * group + p * kKeyGroup);
    for (int r = 0; r < R; ++r) {
      const __m512i qr = _mm512_set1_epi32(
          static_cast<int>(load_word(q + r * ldq + kPerWord<E> * p)));
      for (int t = 0; t < T; ++t) acc[r][t] = word_madd(acc[r][t], qr, k[t], q);
    }
  }
  const __m512 scaled = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      _mm512_storeu_ps(s + r * lds + t * kKeyGroup, _mm512_mul_ps(acc[r][t], scaled));
}

// Value sums of R rows of weights (`ldw` apart, `words` words of keys each) over the values
// packed at `values` (pack_values' layout, from the same key), DV * 16 dimensions: row r's
// sums times inverse[r] go into out[r] (float32, or rounded to bf16).
template <int R, int DV, class E>
inline void pv_tile(const E* w, int64_t ldw, const E* values, int64_t words,
                    const float* inverse, E* const* out) {
  constexpr int64_t D = DV * 16, P = kPerWord<E>;
  __m512 acc[R][DV];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < DV; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < words; ++c) {
    __m512i v[DV];
    for (int t = 0; t < DV; ++t) v[t] = _mm512_loadu_si512(values + (c * D + t * 16) * P);
    for (int r = 0; r < R; ++r) {
      const __m512i wr = _mm512_set1_epi32(static_cast<int>(load_word(w + r * ldw + P * c)));
      for (int t = 0; t < DV; ++t) acc[r][t] = word_madd(acc[r][t], wr, v[t], w);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 inv = _mm512_set1_ps(inverse[r]);
    for (int t = 0; t < DV; ++t) store_lanes(out[r] + t * 16, _mm512_mul_ps(acc[r][t], inv));
  }
}

// A softmax row of n float32 scores as weights: exp(s - max) into w[0, n), float32 or rounded
// to bfloat16 (w may overlay s: each 16 floats are read before their bytes are written);
// returns 1 / the float32 sum of the unrounded exps. exp is cpu_math.h's vexp2 (within 2.6e-7).
template <class E>
inline float softmax_row(const float* s, int64_t n, E* w) {
  const __m512 log2e = _mm512_set1_ps(kLog2e);
  const __m512 shift = _mm512_set1_ps(-row_max(s, n) * kLog2e);
  __m512 sums = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = vexp2(_mm512_fmadd_ps(_mm512_loadu_ps(s + i), log2e, shift));
    sums = _mm512_add_ps(sums, e);
    store_lanes_part(w + i, e, static_cast<__mmask16>(0xFFFF));
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(
        tail, vexp2(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, s + i), log2e, shift)));
    sums = _mm512_add_ps(sums, e);
    store_lanes_part(w + i, e, tail);
  }
  return 1.f / _mm512_reduce_add_ps(sums);
}

}  // namespace spmd_cpu

#endif
