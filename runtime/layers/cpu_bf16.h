// bfloat16 <-> float32 for the project's C++ CPU operators: bf16 storage, float32 arithmetic.
//
// A bfloat16 is the upper half of a float32, so widening is a 16-bit shift and exact. Narrowing
// rounds to nearest, ties to even (as torch's .to(torch.bfloat16) does), keeping NaNs NaN. The
// vector forms widen or narrow one register of floats (kExpLanes of them, cpu_math.h); with
// AVX512-BF16 the narrowing is one instruction, elsewhere integer arithmetic on the bits.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu_math.h"

namespace spmd_cpu {

using bf16_bits = uint16_t;

inline float bf16_to_float(bf16_bits b) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(b) << 16);
}

inline bf16_bits float_to_bf16(float f) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_bits>((bits >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<bf16_bits>((bits + rounding) >> 16);
}

// Element loads and stores that read or write either storage type as float32.
inline float load_as_float(const float* p) { return *p; }
inline float load_as_float(const bf16_bits* p) { return bf16_to_float(*p); }
inline void store_from_float(float* p, float x) { *p = x; }
inline void store_from_float(bf16_bits* p, float x) { *p = float_to_bf16(x); }

#if defined(__AVX512F__)
inline vfloat vload_bf16(const bf16_bits* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline void vstore_bf16(bf16_bits* p, vfloat x) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
#else
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16),
                                 _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
#endif
}
#elif defined(__AVX2__) && defined(__FMA__)
inline vfloat vload_bf16(const bf16_bits* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline void vstore_bf16(bf16_bits* p, vfloat x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, quiet, nan);
  // 32-bit lanes to 16: packus saturates, but every lane already fits in 16 bits; it packs
  // within 128-bit halves, so the permute puts the two halves' results next to each other.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

// Overloads so that a kernel templated on its storage type loads and stores registers alike.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
inline vfloat vload_any(const float* p) { return vload(p); }
inline vfloat vload_any(const bf16_bits* p) { return vload_bf16(p); }
inline void vstore_any(float* p, vfloat x) { vstore(p, x); }
inline void vstore_any(bf16_bits* p, vfloat x) { vstore_bf16(p, x); }
#endif

}  // namespace spmd_cpu
