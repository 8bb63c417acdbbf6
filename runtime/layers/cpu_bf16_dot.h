// bfloat16 decode attention with AVX512-BF16 dot products (VDPBF16PS): bf16 x bf16 pairs
// summed into float32 lanes, 32 products an instruction, twice the float32 FMA's rate.
// (Prompt attention's register tiles, for bf16 and float32: cpu_prompt_tiles.h.)
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

inline uint32_t load_pair(const bf16_bits* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof word);
  return word;
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

}  // namespace spmd_cpu

#endif  // __AVX512BF16__
