// Projections whose weights stay in the GGUF file's own block bytes (runtime/layers/group_quant.py):
// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32) and the K-quants Q4_K, Q5_K, Q6_K (super-blocks
// of 256), each output feature's row of blocks exactly as the file stores it.
//
// Few rows (decode, up to `direct_rows`, which group_quant.py sets per block type): the
// activations are held as 16-bit fixed point per block of 32 (a float scale per block: x ~=
// scale * q, |q| <= 32767, round to nearest; nearly float32's precision), each block of weights
// is unpacked in registers to 32 integer codes, and the two are multiplied with integer dot
// products (AVX2 madd); the block's scales are applied once per block to the integer sums, its
// zero points and minimums through each row's sums of codes. More rows: where the build has
// AVX-512, each task dequantizes a panel of output features to float32 (gguf's own values) in
// buffers of its own and multiplies every row by it with FMA tiles (cpu_f32_gemm.h, fused_f32);
// elsewhere 64 output features at a time are dequantized to float32 and multiplied by MKL's
// GEMM. With bfloat16 activations, group_quant.py instead multiplies panels dequantized to
// bfloat16 inside the product (gguf_bf16_linear), or, built without AVX512-BF16, dequantizes
// chunks to bfloat16 (gguf_dequantize_bf16) for oneDNN's GEMM.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_bf16.h"
#include "cpu_bf16_gemm.h"
#include "cpu_bf16_linear.h"
#include "cpu_f32_gemm.h"
#include "cpu_math.h"

namespace {

// GGML's type ids for the block formats kept.
enum Kind : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12,
                      kQ5_K = 13, kQ6_K = 14 };

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 64;          // output features dequantized at a time for the GEMM
constexpr int64_t kGemmFromRows = 16;  // gguf_bf16_linear: packed 32-feature panels from here
                                       // (measured crossover 4-24 rows across SmolLM2's and
                                       // an 8B model's shapes)

struct Format {
  int64_t weights;   // weights per block (super-block for the K-quants)
  int64_t bytes;     // bytes per block
};

// A type's block shape; {0, 0} for a type without a kernel.
constexpr Format block_format(int64_t kind) {
  switch (kind) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default: return {0, 0};
  }
}

// f(std::integral_constant<int64_t, KIND>{}) for kind's block format: the one switch from a
// type id to the code compiled per type.
template <class F>
void with_kind(int64_t kind, F&& f) {
  switch (kind) {
    case kQ4_0: return f(std::integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int64_t, kQ4_1>{});
    case kQ5_0: return f(std::integral_constant<int64_t, kQ5_0>{});
    case kQ5_1: return f(std::integral_constant<int64_t, kQ5_1>{});
    case kQ8_0: return f(std::integral_constant<int64_t, kQ8_0>{});
    case kQ4_K: return f(std::integral_constant<int64_t, kQ4_K>{});
    case kQ5_K: return f(std::integral_constant<int64_t, kQ5_K>{});
    case kQ6_K: return f(std::integral_constant<int64_t, kQ6_K>{});
    default: TORCH_CHECK(false, "gguf_linear: GGML type ", kind, " has no kernel");
  }
}

Format format_of(int64_t kind) {
  const Format fmt = block_format(kind);
  TORCH_CHECK(fmt.weights != 0, "gguf_linear: GGML type ", kind, " has no kernel");
  return fmt;
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// Q4_K's and Q5_K's 6-bit scale and minimum of block j (of 8) from their 12 packed bytes.
inline void scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Block b (32 weights) of a block or super-block `s` as w_i = a_i (u_i - zero) + c, u_i the
// unsigned codes (Q8_0: signed, zero 0); a_i is `a` (Q6_K: a * sub[i / 16], its int8 scales
// of 16 weights).
struct Affine {
  float a = 0.f, c = 0.f;
  int zero = 0;
  int sub[2] = {1, 1};
};

// Block b's affine map in a K-quant super-block `s` (Q4_K, Q5_K, Q6_K).
inline void super_affine(int64_t kind, const uint8_t* s, int b, Affine& f) {
  if (kind == kQ6_K) {
    f.a = half_at(s + 208);
    f.zero = 32;
    f.sub[0] = static_cast<int8_t>(s[192 + 2 * b]);
    f.sub[1] = static_cast<int8_t>(s[192 + 2 * b + 1]);
    return;
  }
  int sc, m;
  scale_min(s + 4, b, sc, m);
  f.a = half_at(s) * static_cast<float>(sc);
  f.c = -half_at(s + 2) * static_cast<float>(m);
}

// The 32 codes of block b and their affine map, read one code at a time (the reference for
// the vector unpacking, and the dequantization of the GEMM's tiles).
void unpack_scalar(int64_t kind, const uint8_t* s, int b, int q[32], Affine& f) {
  switch (kind) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: {
      const bool with_min = kind == kQ4_1 || kind == kQ5_1;
      const bool five = kind == kQ5_0 || kind == kQ5_1;
      const uint8_t* qs = s + 2 + (with_min ? 2 : 0) + (five ? 4 : 0);
      uint32_t high = 0;
      if (five) std::memcpy(&high, s + 2 + (with_min ? 2 : 0), 4);
      for (int j = 0; j < 16; ++j) {
        q[j] = (qs[j] & 0x0F) | (five ? ((high >> j) & 1) << 4 : 0);
        q[j + 16] = (qs[j] >> 4) | (five ? ((high >> (j + 16)) & 1) << 4 : 0);
      }
      f.a = half_at(s);
      f.c = with_min ? half_at(s + 2) : 0.f;
      f.zero = with_min ? 0 : (five ? 16 : 8);
      return;
    }
    case kQ8_0:
      for (int j = 0; j < 32; ++j) q[j] = static_cast<int8_t>(s[2 + j]);
      f.a = half_at(s);
      return;
    case kQ4_K: case kQ5_K: {
      const uint8_t* qs = s + (kind == kQ4_K ? 16 : 48) + 32 * (b / 2);
      for (int j = 0; j < 32; ++j) {
        q[j] = (qs[j] >> (4 * (b % 2))) & 0x0F;
        if (kind == kQ5_K) q[j] |= ((s[16 + j] >> b) & 1) << 4;
      }
      super_affine(kind, s, b, f);
      return;
    }
    case kQ6_K: {
      const int h = b / 4, part = b % 4;
      const uint8_t* ql = s + 64 * h + 32 * (part % 2);
      const uint8_t* qh = s + 128 + 32 * h;
      for (int j = 0; j < 32; ++j)
        q[j] = ((ql[j] >> (4 * (part / 2))) & 0x0F) | (((qh[j] >> (2 * part)) & 3) << 4);
      super_affine(kind, s, b, f);
      return;
    }
    default: TORCH_CHECK(false, "gguf_linear: GGML type ", kind, " has no kernel");
  }
}

// One output feature's K weights as float32.
void dequantize_row(int64_t kind, const uint8_t* row, int64_t K, float* w) {
  const Format fmt = format_of(kind);
  int q[32];
  Affine f;
  for (int64_t k = 0; k < K; k += kBlock) {
    const uint8_t* s = row + (k / fmt.weights) * fmt.bytes;
    unpack_scalar(kind, s, static_cast<int>((k % fmt.weights) / kBlock), q, f);
    for (int j = 0; j < 32; ++j)
      w[k + j] = f.a * static_cast<float>(f.sub[j / 16]) * static_cast<float>(q[j] - f.zero) + f.c;
  }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Rows of x as 16-bit fixed point: x ~= scale * q, |q| <= 32767, one scale per `group` weights
// (32, or a K-quant super-block's 256: cpu_group_quant_vnni.h), held per block of 32 (a
// group's blocks repeat its scale); and per 16 and per 32 codes scale * (their sum), the
// factors of the zero points' and minimums' terms.
struct Quantized {
  at::Tensor q, scale, sum16, sum32;   // int16 [M, K]; float32 [M, K/32], [M, K/16], [M, K/32]
  const int16_t* q_at;
  const float *scale_at, *sum16_at, *sum32_at;
};

constexpr float kFixed = 32767.f;

Quantized quantize_rows(const at::Tensor& x, int64_t group = kBlock) {
  const int64_t M = x.size(0), K = x.size(1);
  Quantized out{at::empty({M, K}, x.options().dtype(at::kShort)), at::empty({M, K / kBlock}, x.options()),
                at::empty({M, K / 16}, x.options()), at::empty({M, K / kBlock}, x.options()),
                nullptr, nullptr, nullptr, nullptr};
  const float* src = x.data_ptr<float>();
  int16_t* q = out.q.data_ptr<int16_t>();
  float *scale = out.scale.data_ptr<float>(), *sum16 = out.sum16.data_ptr<float>(),
        *sum32 = out.sum32.data_ptr<float>();
  out.q_at = q;
  out.scale_at = scale;
  out.sum16_at = sum16;
  out.sum32_at = sum32;
  const int64_t per_group = group / kBlock;
  at::parallel_for(0, M * (K / group), 2048 / group, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const float* v = src + g * group;
      float amax = 0.f;
      for (int64_t j = 0; j < group; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float d = amax / kFixed, inv = amax > 0.f ? kFixed / amax : 0.f;
      for (int64_t i = g * per_group; i < (g + 1) * per_group; ++i) {
        int sum[2] = {0, 0};
        for (int j = 0; j < 32; ++j) {
          const int c = static_cast<int>(std::nearbyint(src[i * kBlock + j] * inv));
          q[i * kBlock + j] = static_cast<int16_t>(c);
          sum[j / 16] += c;
        }
        scale[i] = d;
        sum16[2 * i] = d * static_cast<float>(sum[0]);
        sum16[2 * i + 1] = d * static_cast<float>(sum[1]);
        sum32[i] = d * static_cast<float>(sum[0] + sum[1]);
      }
    }
  });
  return out;
}

// A Q4_K or Q5_K super-block's 8 six-bit scales and minimums (as scale_min), a byte each in the
// low 64 bits of two registers. Unpacked four to a 32-bit word, bytewise, and moved from 64-bit
// values (two 32-bit stores read back by one 64-bit load would miss store-to-load forwarding).
struct SixBit {
  __m128i scales, mins;
};

inline SixBit six_bit_scales(const uint8_t* s) {
  uint32_t w[3];
  std::memcpy(w, s + 4, 12);
  const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
  const uint64_t scales = (w[0] & six) | (static_cast<uint64_t>((w[2] & four) | (((w[0] >> 6) & two) << 4)) << 32);
  const uint64_t mins = (w[1] & six) | (static_cast<uint64_t>(((w[2] >> 4) & four) | (((w[1] >> 6) & two) << 4)) << 32);
  return {_mm_cvtsi64_si128(static_cast<int64_t>(scales)), _mm_cvtsi64_si128(static_cast<int64_t>(mins))};
}

// 32 bits as 32 bytes, byte j 0xFF where bit j is set.
inline __m256i bytes_of_bits(uint32_t bits) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)), spread);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

// The bytes `ahead` past p asked into the cache: the weights stream from memory once a token,
// and the hardware's prefetcher alone left the integer units waiting (about 5% at one row).
template <int64_t BYTES>
inline void prefetch(const uint8_t* p) {
#if defined(__AVX512VNNI__)
  constexpr int64_t ahead = 8192;   // the VNNI kernels consume a super-block in ~12 cycles
#else
  constexpr int64_t ahead = 2048;   // a few K-quant super-blocks
#endif
  for (int64_t line = 0; line < BYTES; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + ahead + line), _MM_HINT_T0);
}

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

inline __m256i nibbles_at(const uint8_t* p, int shift) {
  return _mm256_and_si256(_mm256_srli_epi16(load32(p), shift), _mm256_set1_epi8(0x0F));
}

// A block of 32's codes in a register (Q8_0: signed; the others unsigned, < 32) and its
// scale a, offset c and zero point (as unpack_scalar's).
template <int64_t KIND>
inline __m256i unpack_block(const uint8_t* s, Affine& f) {
  f.a = half_at(s);
  if constexpr (KIND == kQ8_0) {
    return load32(s + 2);
  } else {
    constexpr bool with_min = KIND == kQ4_1 || KIND == kQ5_1;
    constexpr bool five = KIND == kQ5_0 || KIND == kQ5_1;
    constexpr int at = 2 + (with_min ? 2 : 0);
    f.c = with_min ? half_at(s + 2) : 0.f;
    f.zero = with_min ? 0 : (five ? 16 : 8);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + at + (five ? 4 : 0)));
    const __m128i low = _mm_set1_epi8(0x0F);
    __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), _mm_and_si128(bytes, low));
    if constexpr (five) {
      uint32_t high;
      std::memcpy(&high, s + at, 4);
      q = _mm256_or_si256(q, _mm256_and_si256(bytes_of_bits(high), _mm256_set1_epi8(0x10)));
    }
    return q;
  }
}

// Block b (of 8) of a Q5_K or Q6_K super-block's codes in a register, unsigned (< 64). (Q4_K's
// are widened straight from their bytes: q4_k_block.)
template <int64_t KIND>
inline __m256i unpack_super(const uint8_t* s, int b) {
  static_assert(KIND == kQ5_K || KIND == kQ6_K);
  if constexpr (KIND == kQ6_K) {
    // Each pair of high bits masked where it lies, then moved to bits 4-5 (part 2's lie there).
    const int h = b / 4, part = b % 4;
    const __m256i low = nibbles_at(s + 64 * h + 32 * (part % 2), 4 * (part / 2));
    const __m256i bits = _mm256_and_si256(load32(s + 128 + 32 * h),
                                          _mm256_set1_epi8(static_cast<char>(3 << (2 * part))));
    const __m256i high = part == 0 ? _mm256_slli_epi16(bits, 4)
                         : part == 1 ? _mm256_slli_epi16(bits, 2)
                         : part == 2 ? bits : _mm256_srli_epi16(bits, 2);
    return _mm256_or_si256(low, high);
  } else {
    const __m256i q = nibbles_at(s + 48 + 32 * (b / 2), 4 * (b % 2));
    const __m256i fifth = _mm256_and_si256(_mm256_srli_epi16(load32(s + 16), b), _mm256_set1_epi8(1));
    return _mm256_or_si256(q, _mm256_slli_epi16(fifth, 4));
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// 32 codes (bytes) as two registers of 16-bit ones: weights 0-15 and 16-31.
struct Wide {
  __m256i low, high;
};

template <bool SIGNED>
inline Wide widen(__m256i codes) {
  const __m128i a = _mm256_castsi256_si128(codes), b = _mm256_extracti128_si256(codes, 1);
  if constexpr (SIGNED) return {_mm256_cvtepi8_epi16(a), _mm256_cvtepi8_epi16(b)};
  return {_mm256_cvtepu8_epi16(a), _mm256_cvtepu8_epi16(b)};
}

// Q4_K's block b as 16-bit codes, straight from its bytes: each byte widened once holds the
// codes of blocks b and b ^ 1 (low and high nibble), so no byte-wide unpacking in between.
inline Wide q4_k_block(const uint8_t* s, int b) {
  const uint8_t* qs = s + 16 + 32 * (b / 2);
  const __m256i low = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m256i high = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)));
  if (b % 2) return {_mm256_srli_epi16(low, 4), _mm256_srli_epi16(high, 4)};
  const __m256i nibble = _mm256_set1_epi16(0x0F);
  return {_mm256_and_si256(low, nibble), _mm256_and_si256(high, nibble)};
}

// Block b (of 8) of a K-quant super-block as 16-bit codes.
template <int64_t KIND>
inline Wide super_block_codes(const uint8_t* s, int b) {
  if constexpr (KIND == kQ4_K) return q4_k_block(s, b);
  else return widen<false>(unpack_super<KIND>(s, b));
}

// A block's 16-bit codes against 32 of x's 16-bit codes: 8 int32 sums of 4 products each.
inline __m256i dot32(const Wide& w, const int16_t* x) {
  return _mm256_add_epi32(_mm256_madd_epi16(w.low, load32(x)), _mm256_madd_epi16(w.high, load32(x + 16)));
}

// Eight vectors of int32 partial sums as one vector of their totals, lane b vector b's.
inline __m256i block_sums(const __m256i d[8]) {
  // hadd works within 128-bit halves: after two rounds each half holds 4 blocks' half-sums.
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(d[4], d[5]), _mm256_hadd_epi32(d[6], d[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

inline __m256 int8x8_to_float(const void* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// R rows of quantized x against one output feature of blocks of 32: per block, the integer dot
// products of its codes with each row's codes in 8 int32 lanes, scaled to float by a * x's
// block scale; the zero point's and minimum's terms from the rows' scaled sums of codes.
template <int64_t KIND, int R>
void dot_blocks(const uint8_t* row, int64_t K, const Quantized& xq, int64_t r0, float* out,
                int64_t N) {
  constexpr int64_t kBytes = block_format(KIND).bytes;
  const int64_t blocks = K / kBlock;
  __m256 acc[R];
  float extra[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    extra[r] = 0.f;
  }
  for (int64_t i = 0; i < blocks; ++i) {
    Affine f;
    if (i % 2 == 0) prefetch<2 * kBytes>(row + i * kBytes);
    const Wide codes = widen<KIND == kQ8_0>(unpack_block<KIND>(row + i * kBytes, f));
    const float shift = f.c - f.a * static_cast<float>(f.zero);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * blocks + i;
      const __m256i dots = dot32(codes, xq.q_at + at * kBlock);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_set1_ps(f.a * xq.scale_at[at]), acc[r]);
      if (KIND != kQ8_0) extra[r] += shift * xq.sum32_at[at];
    }
  }
  for (int r = 0; r < R; ++r) out[r * N] = hsum(acc[r]) + extra[r];
}

// R rows of quantized x against one output feature of K-quant super-blocks: each super-block's
// scales (and minimums) read once into vectors of its 8 blocks; per block the integer dot
// products (Q6_K: weighed by its two int8 sub-block scales) scaled to float by its lane of
// scale x x's block scales; the minimums' (Q6_K: zero point's) terms, one vector product per
// super-block and row.
template <int64_t KIND, int R>
void dot_supers(const uint8_t* row, int64_t K, const Quantized& xq, int64_t r0, float* out,
                int64_t N) {
  constexpr int64_t kBytes = block_format(KIND).bytes;
  const int64_t supers = K / 256, blocks = K / kBlock;
  __m256 acc[R], extra[R];
  for (int r = 0; r < R; ++r) acc[r] = extra[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < supers; ++i) {
    const uint8_t* s = row + i * kBytes;
    prefetch<kBytes>(s);
    __m256 scale, low_min, high_min = _mm256_setzero_ps();
    if constexpr (KIND == kQ6_K) {
      const float d = half_at(s + 208);
      scale = _mm256_set1_ps(d);
      low_min = _mm256_mul_ps(_mm256_set1_ps(-32.f * d), int8x8_to_float(s + 192));
      high_min = _mm256_mul_ps(_mm256_set1_ps(-32.f * d), int8x8_to_float(s + 200));
    } else {
      const SixBit six = six_bit_scales(s);
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(six.scales));
      const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(six.mins));
      scale = _mm256_mul_ps(_mm256_set1_ps(half_at(s)), sc);
      low_min = _mm256_mul_ps(_mm256_set1_ps(-half_at(s + 2)), m);
    }
    __m256 row_scale[R];
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * blocks + i * 8;
      row_scale[r] = _mm256_mul_ps(scale, _mm256_loadu_ps(xq.scale_at + at));
      if constexpr (KIND == kQ6_K) {
        // sum16's 16 values per super-block: lanes of low_min are sub-blocks 0-7, of high 8-15.
        extra[r] = _mm256_fmadd_ps(low_min, _mm256_loadu_ps(xq.sum16_at + 2 * at), extra[r]);
        extra[r] = _mm256_fmadd_ps(high_min, _mm256_loadu_ps(xq.sum16_at + 2 * at + 8), extra[r]);
      } else {
        extra[r] = _mm256_fmadd_ps(low_min, _mm256_loadu_ps(xq.sum32_at + at), extra[r]);
      }
    }
    // Integer sums per block (Q4_K, Q5_K: |sum| <= 32 * 31 * 32767) or per sub-block of 16
    // (Q6_K, whose int8 scales are applied in float: |sum| <= 16 * 63 * 32767), reduced to one
    // vector of 8 per super-block and row and scaled once.
    __m256i dots[R][KIND == kQ6_K && R <= 2 ? 16 : 8];
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) {
      const Wide codes = super_block_codes<KIND>(s, b);
      for (int r = 0; r < R; ++r) {
        const int16_t* x = xq.q_at + ((r0 + r) * blocks + i * 8 + b) * kBlock;
        if constexpr (KIND == kQ6_K && R > 2) {   // 16 sums a row would spill: scaled now
          const Wide scaled{_mm256_mullo_epi16(codes.low, _mm256_set1_epi16(static_cast<int8_t>(s[192 + 2 * b]))),
                            _mm256_mullo_epi16(codes.high, _mm256_set1_epi16(static_cast<int8_t>(s[193 + 2 * b])))};
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(scaled, x)),   // |lane| <= 4 * 63 * 128 * 32767
                                   _mm256_permutevar8x32_ps(row_scale[r], _mm256_set1_epi32(b)), acc[r]);
        } else if constexpr (KIND == kQ6_K) {
          dots[r][2 * b] = _mm256_madd_epi16(codes.low, load32(x));
          dots[r][2 * b + 1] = _mm256_madd_epi16(codes.high, load32(x + 16));
        } else {
          dots[r][b] = dot32(codes, x);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      if constexpr (KIND == kQ6_K && R > 2) {
        continue;
      } else if constexpr (KIND == kQ6_K) {   // sub-block j: scale d x (block j / 2) x sc_j
        const __m256 low = _mm256_mul_ps(int8x8_to_float(s + 192), _mm256_permutevar8x32_ps(
            row_scale[r], _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)));
        const __m256 high = _mm256_mul_ps(int8x8_to_float(s + 200), _mm256_permutevar8x32_ps(
            row_scale[r], _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_sums(dots[r])), low, acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_sums(dots[r] + 8)), high, acc[r]);
      } else {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_sums(dots[r])), row_scale[r], acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r * N] = hsum(_mm256_add_ps(acc[r], extra[r]));
}

#include "cpu_group_quant_vnni.h"
#include "cpu_group_quant_int8.h"
#include "cpu_int8_head.h"

#if defined(SPMD_GGUF_VNNI)
constexpr bool kVnni = true;
// From this many rows, K-quant products take tiled_supers (features four at a time). Measured on
// an 8B model's projections (Zen 5, 2 cores): where a row of x's codes outgrows L1 (K >= 8192:
// 16 KiB and more), single features read it again from L2 for each and the tiles win from one
// row (4096 x 14336 Q6_K: 0.9 ms against 1.3); below, Q4_K's single features are faster up to 5
// rows (14336 x 4096: 0.74 ms against 1.2 at 2 rows), Q6_K's tiles from 2.
constexpr int64_t tile_rows(int64_t kind, int64_t K) {
  return K >= 8192 ? 1 : kind == kQ6_K ? 2 : 6;
}
#else
constexpr bool kVnni = false;
#endif

template <int64_t KIND, int R>
inline void dot_feature(const uint8_t* row, int64_t K, const Quantized& xq, int64_t r0, float* out,
                        int64_t N) {
#if defined(SPMD_GGUF_VNNI)
  if constexpr (KIND >= kQ4_K) {
    dot_supers_vnni<KIND, R>(row, K, xq, r0, out, N);
  } else {
    dot_blocks_vnni<KIND, R>(row, K, xq, r0, out, N);
  }
#else
  if constexpr (KIND >= kQ4_K) {
    dot_supers<KIND, R>(row, K, xq, r0, out, N);
  } else {
    dot_blocks<KIND, R>(row, K, xq, r0, out, N);
  }
#endif
}

// The last `count` (1..MOST) rows from r, at once.
template <int64_t KIND, int MOST>
inline void dot_tail(const uint8_t* row, int64_t K, const Quantized& xq, int64_t r, int64_t count,
                     float* out, int64_t N) {
  if constexpr (MOST >= 1) {
    if (count == MOST) return dot_feature<KIND, MOST>(row, K, xq, r, out, N);
    dot_tail<KIND, MOST - 1>(row, K, xq, r, count, out, N);
  }
}

// 16 codes (16-bit lanes) as float32 weights a (q - zero) + c into w: multiplied, then added,
// as dequantize_row rounds them.
inline void store_weights(__m256i codes, float a, int zero, float c, float* w) {
  const __m256i q = _mm256_sub_epi16(codes, _mm256_set1_epi16(static_cast<int16_t>(zero)));
  const __m256 scale = _mm256_set1_ps(a), offset = _mm256_set1_ps(c);
  const __m256 low = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(q)));
  const __m256 high = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(q, 1)));
  _mm256_storeu_ps(w, _mm256_add_ps(_mm256_mul_ps(low, scale), offset));
  _mm256_storeu_ps(w + 8, _mm256_add_ps(_mm256_mul_ps(high, scale), offset));
}

// Each block of 32 of one output feature's K weights, the codes unpacked in registers:
// visit(codes, a_low, a_high, zero, c, k) for the block at input k, its weights
// w = a (q - zero) + c, a_low the first 16's and a_high the last 16's (Q6_K's sub-scales).
template <int64_t KIND, class Visit>
inline void walk_blocks(const uint8_t* row, int64_t K, Visit&& visit) {
  constexpr Format fmt = block_format(KIND);
  for (int64_t k = 0; k < K; k += fmt.weights) {
    const uint8_t* s = row + (k / fmt.weights) * fmt.bytes;
    prefetch<fmt.bytes>(s);
    if constexpr (KIND >= kQ4_K) {
      for (int b = 0; b < 8; ++b) {
        Affine f;
        super_affine(KIND, s, b, f);
        visit(super_block_codes<KIND>(s, b), f.a * static_cast<float>(f.sub[0]),
              f.a * static_cast<float>(f.sub[1]), f.zero, f.c, k + 32 * b);
      }
    } else {
      Affine f;
      const Wide codes = widen<KIND == kQ8_0>(unpack_block<KIND>(s, f));
      visit(codes, f.a, f.a, f.zero, f.c, k);
    }
  }
}

// One output feature's K weights as float32 (dequantize_row's values, for the GEMM's tiles).
template <int64_t KIND>
void dequantize_vector(const uint8_t* row, int64_t K, float* w) {
  walk_blocks<KIND>(row, K, [&](const Wide& q, float a_low, float a_high, int zero, float c,
                                int64_t k) {
    store_weights(q.low, a_low, zero, c, w + k);
    store_weights(q.high, a_high, zero, c, w + k + 16);
  });
}

template <int64_t KIND>
void direct_kind(const Quantized& xq, int64_t M, const uint8_t* blocks, int64_t row_bytes,
                 int64_t K, int64_t N, float* out) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = blocks + n * row_bytes;
      // Rows in groups, each block's codes unpacked once per group. AVX2: in fours; blocks of
      // 32 take the last 5 to 7 rows at once (a speculative verify step's 5 rows: 1.4x faster
      // than 4 + 1), super-blocks not (their vectors of scales and minimums would spill the
      // 16 registers). AVX-512's 32 registers take 8 at once.
      constexpr int64_t kGroup = kVnni ? 8 : 4;
      constexpr int64_t kMostAtOnce = kVnni ? 8 : KIND >= kQ4_K ? 4 : 7;
      int64_t r = 0;
      for (; M - r > kMostAtOnce; r += kGroup) dot_feature<KIND, kGroup>(row, K, xq, r, out + r * N + n, N);
      if (M > r) dot_tail<KIND, kMostAtOnce>(row, K, xq, r, M - r, out + r * N + n, N);
    }
  });
}

void direct(const at::Tensor& x, int64_t kind, const uint8_t* blocks, int64_t row_bytes,
            int64_t N, at::Tensor& out) {
  const Format fmt = format_of(kind);
  const Quantized xq = quantize_rows(x, kVnni ? fmt.weights : kBlock);
  const int64_t M = x.size(0), K = x.size(1);
  float* o = out.data_ptr<float>();
  with_kind(kind, [&](auto k) {
    constexpr int64_t KIND = decltype(k)::value;
#if defined(SPMD_GGUF_VNNI)
    if constexpr (KIND >= kQ4_K) {
      if (M >= tile_rows(KIND, K)) return tiled_supers<KIND>(xq, M, blocks, row_bytes, K, N, o);
    }
#endif
    direct_kind<KIND>(xq, M, blocks, row_bytes, K, N, o);
  });
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 32 weights (two registers of 16) into dst: float32 as they are, bf16 rounded (nearest, ties
// to even).
inline void store_halves(__m512 low, __m512 high, float* dst) {
  _mm512_storeu_ps(dst, low);
  _mm512_storeu_ps(dst + 16, high);
}
#if defined(__AVX512BF16__)
inline void store_halves(__m512 low, __m512 high, spmd_cpu::bf16_bits* dst) {
  _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(high, low));
}
#endif

// 32 codes as 16-bit lanes (q - zero) * a + c, multiplied then added as store_weights, into
// dst[0, 32): 16 weights a half.
template <class T>
inline void store_affine(__m512i codes, float a_low, float a_high, int zero, float c, T* dst) {
  const __m512i q = _mm512_sub_epi16(codes, _mm512_set1_epi16(static_cast<int16_t>(zero)));
  const __m512 offset = _mm512_set1_ps(c);
  const __m512 low = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(
      _mm512_castsi512_si256(q))), _mm512_set1_ps(a_low)), offset);
  const __m512 high = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(
      _mm512_extracti64x4_epi64(q, 1))), _mm512_set1_ps(a_high)), offset);
  store_halves(low, high, dst);
}

// The 16 weights (q - zero) * a + c a block of 16 levels can hold, as store_affine computes
// them: a table the codes look their weights up in.
inline __m512 level_table(float a, int zero, float c) {
  const __m512 levels = _mm512_sub_ps(
      _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_ps(static_cast<float>(zero)));
  return _mm512_add_ps(_mm512_mul_ps(levels, _mm512_set1_ps(a)), _mm512_set1_ps(c));
}

// 32 codes of 16 levels (16-bit lanes, < 16) as weights (q - zero) * a + c into dst[0, 32),
// looked up in level_table (float32: VPERMPS; bf16: the table rounded once, then VPERMW).
inline void store_by_table(__m512i codes, float a, int zero, float c, float* dst) {
  const __m512 table = level_table(a, zero, c);
  store_halves(_mm512_permutexvar_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(codes)), table),
               _mm512_permutexvar_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(codes, 1)),
                                     table), dst);
}
#if defined(__AVX512BF16__)
inline void store_by_table(__m512i codes, float a, int zero, float c, spmd_cpu::bf16_bits* dst) {
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(codes, _mm512_castsi256_si512(
      (__m256i)_mm512_cvtneps_pbh(level_table(a, zero, c)))));
}
#endif

// One output feature's K weights with AVX-512, into float32 (dequantize_vector's values) or
// bf16 (those rounded), without the float32 weights passing through memory for bf16.
template <int64_t KIND, class T>
void dequantize_vector_wide(const uint8_t* row, int64_t K, T* w) {
  constexpr Format fmt = block_format(KIND);
  if constexpr (KIND == kQ8_0) {   // signed bytes widened to float32 lanes directly: a q + 0
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += fmt.weights) {
      const uint8_t* s = row + k / fmt.weights * fmt.bytes;
      prefetch<fmt.bytes>(s);
      const __m512 a = _mm512_set1_ps(half_at(s));
      const auto part = [&](int at) {
        return _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + at)))), a), zero);
      };
      store_halves(part(2), part(18), w + k);
    }
    return;
  }
  if constexpr (KIND == kQ4_K) {   // super_affine's maps with d and dmin read once a super-block
    for (int64_t k = 0; k < K; k += fmt.weights) {
      const uint8_t* s = row + k / fmt.weights * fmt.bytes;
      prefetch<fmt.bytes>(s);
      const float d = half_at(s), dmin = half_at(s + 2);
      for (int b = 0; b < 8; b += 2) {   // blocks b and b + 1: the low and high nibbles of
        const __m512i bytes = _mm512_cvtepu8_epi16(   // the same 32 bytes, widened once
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16 + 16 * b)));
        const __m512i codes[2] = {_mm512_and_si512(bytes, _mm512_set1_epi16(0x0F)),
                                  _mm512_srli_epi16(bytes, 4)};
        for (int h = 0; h < 2; ++h) {
          int sc, m;
          scale_min(s + 4, b + h, sc, m);
          store_by_table(codes[h], d * static_cast<float>(sc), 0,
                         -dmin * static_cast<float>(m), w + k + 32 * (b + h));
        }
      }
    }
    return;
  }
  walk_blocks<KIND>(row, K, [&](const Wide& q, float a_low, float a_high, int zero, float c,
                                int64_t k) {
    const __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(q.low), q.high, 1);
    if constexpr (KIND == kQ4_0 || KIND == kQ4_1) {
      (void)a_high;
      store_by_table(codes, a_low, zero, c, w + k);
    } else {
      store_affine(codes, a_low, a_high, zero, c, w + k);
    }
  });
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// One output feature's K weights into w, float32 (dequantize_vector's values) or, with
// AVX512-BF16, bf16 (those rounded): AVX-512's dequantizer where the build has it.
template <int64_t KIND, class T>
inline void dequantize_into(const uint8_t* row, int64_t K, T* w) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  dequantize_vector_wide<KIND>(row, K, w);
#else
  dequantize_vector<KIND>(row, K, w);
#endif
}
#endif

// Rows [begin, end) of W's blocks as float32, `K` weights a row, into w.
void dequantize_rows(int64_t kind, const uint8_t* blocks, int64_t row_bytes, int64_t K,
                     int64_t begin, int64_t end, float* w) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  with_kind(kind, [&](auto k) {
    for (int64_t n = begin; n < end; ++n)
      dequantize_into<decltype(k)::value>(blocks + n * row_bytes, K, w + (n - begin) * K);
  });
#else
  for (int64_t n = begin; n < end; ++n) dequantize_row(kind, blocks + n * row_bytes, K, w + (n - begin) * K);
#endif
}

// Row n of W's blocks as bfloat16 into dst (nearest, ties to even), through `row` (K floats)
// where the build has no AVX512-BF16.
void dequantize_row_bf16(int64_t kind, const uint8_t* blocks, int64_t row_bytes, int64_t K,
                         int64_t n, float* row, spmd_cpu::bf16_bits* dst) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  (void)row;
  with_kind(kind, [&](auto k) {
    dequantize_vector_wide<decltype(k)::value>(blocks + n * row_bytes, K, dst);
  });
#else
  dequantize_rows(kind, blocks, row_bytes, K, n, n + 1, row);
  int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; k + spmd_cpu::kExpLanes <= K; k += spmd_cpu::kExpLanes)
    spmd_cpu::vstore_bf16(dst + k, spmd_cpu::vload(row + k));
#endif
  for (; k < K; ++k) dst[k] = spmd_cpu::float_to_bf16(row[k]);
#endif
}

#if defined(__AVX512F__)
// `panels` panels of P of W's output features (panel p's row f: feature(p, f)), each task's
// dequantized to T (P x K, row-major: float32 as gguf_dequantize makes them, bf16 as
// gguf_dequantize_bf16 rounds them) in buffers of its own and handed to multiply(panel, p,
// scratch of scratch_words words).
template <int64_t P, class T, class Scratch, class Feature, class Multiply>
void dequantized_panels_of(int64_t kind, const uint8_t* data, int64_t row_bytes, int64_t K,
                           int64_t panels, int64_t scratch_words, Feature&& feature,
                           Multiply&& multiply) {
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> panel(P * K);
    std::vector<Scratch> scratch(scratch_words);
    with_kind(kind, [&](auto k) {
      for (int64_t p = begin; p < end; ++p) {
        for (int64_t f = 0; f < P; ++f)
          dequantize_into<decltype(k)::value>(data + feature(p, f) * row_bytes, K,
                                              panel.data() + f * K);
        multiply(panel.data(), p, scratch.data());
      }
    });
  });
}

// W's N output features in consecutive panels of P (the last overlapping the one before):
// multiply(panel, first feature, scratch).
template <int64_t P, class T, class Scratch, class Multiply>
void dequantized_panels(int64_t kind, const uint8_t* data, int64_t row_bytes, int64_t K,
                        int64_t N, int64_t scratch_words, Multiply&& multiply) {
  const auto start = [N](int64_t p) { return spmd_cpu::bf16_panel_start<P>(p, N); };
  dequantized_panels_of<P, T, Scratch>(
      kind, data, row_bytes, K, (N + P - 1) / P, scratch_words,
      [&](int64_t p, int64_t f) { return start(p) + f; },
      [&](const T* panel, int64_t p, Scratch* scratch) { multiply(panel, start(p), scratch); });
}

// x [M, K] float32 @ W^T into out [M, N] with W's panels dequantized to float32 in cache
// (cpu_f32_gemm.h's tiles): few rows against row-major panels of 8, 16-48 rows in the lanes,
// more against packed panels of 32. N >= 8.
void fused_f32(const at::Tensor& x, int64_t kind, const uint8_t* data, int64_t row_bytes,
               int64_t N, at::Tensor& out) {
  namespace s = spmd_cpu;
  const int64_t M = x.size(0), K = x.size(1);
  const float* xp = x.const_data_ptr<float>();
  float* o = out.mutable_data_ptr<float>();
  const auto lanes = [&](auto registers, auto features) {
    constexpr int RV = decltype(registers)::value, F = decltype(features)::value;
    std::vector<float> packed(K * RV * 16);
    s::f32_pack_lanes(xp, M, K, packed.data());
    dequantized_panels<F, float, float>(kind, data, row_bytes, K, N, 0,
                                        [&](const float* panel, int64_t n0, float*) {
                                          s::f32_lanes_tile<RV, F>(packed.data(), M, K, panel,
                                                                   o + n0, N);
                                        });
  };
  using std::integral_constant;
  if (M >= s::kF32LanesFromRows && M <= s::kF32LanesMaxRows && N >= 16) {
    switch (s::lane_registers(M)) {
      case 1: return lanes(integral_constant<int, 1>{}, integral_constant<int, 16>{});
      case 2: return lanes(integral_constant<int, 2>{}, integral_constant<int, 12>{});
      default: return lanes(integral_constant<int, 3>{}, integral_constant<int, 8>{});
    }
  }
  if (M >= s::kF32LanesFromRows && N >= s::kF32GemmPanel) {
    return dequantized_panels<s::kF32GemmPanel, float, float>(
        kind, data, row_bytes, K, N, s::kF32GemmPanel * K,
        [&](const float* panel, int64_t n0, float* packed) {
          s::f32_pack_panel(panel, K, packed);
          s::f32_gemm_panel_rows(xp, M, K, packed, o + n0, N);
        });
  }
  dequantized_panels<s::kF32FewPanel, float, float>(
      kind, data, row_bytes, K, N, 0, [&](const float* panel, int64_t n0, float*) {
        s::f32_panel_rows(xp, M, K, panel, o + n0, N);
      });
}
#endif

void tiled(const at::Tensor& x, int64_t kind, const uint8_t* blocks, int64_t row_bytes,
           int64_t N, at::Tensor& out) {
  const int64_t K = x.size(1);
  at::Tensor tile = at::empty({kTile, K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += kTile) {
    const int64_t count = std::min(kTile, N - n0);
    float* w = tile.data_ptr<float>();
    at::parallel_for(0, count, 4, [&](int64_t begin, int64_t end) {
      dequantize_rows(kind, blocks, row_bytes, K, n0 + begin, n0 + end, w + begin * K);
    });
    out.narrow(1, n0, count).copy_(at::mm(x, tile.narrow(0, 0, count).t()));
  }
}

void check_blocks(const char* op, const at::Tensor& blocks, int64_t kind, int64_t K) {
  const Format fmt = format_of(kind);
  TORCH_CHECK(K > 0 && K % fmt.weights == 0, op, ": in_features (", K,
              ") must be a positive multiple of ", fmt.weights, " for GGML type ", kind);
  spmd_cpu::check_tensor(op, "blocks", blocks, 2);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous(), op,
              ": blocks must be a contiguous uint8 tensor");
  TORCH_CHECK(blocks.size(1) == K / fmt.weights * fmt.bytes, op, ": blocks has ", blocks.size(1),
              " bytes a row, ", K / fmt.weights * fmt.bytes, " expected for ", K,
              " weights of GGML type ", kind);
}

// Whether gguf_linear multiplies float32 rows past direct_rows by panels dequantized to
// float32 (fused_f32) rather than by MKL's GEMM of dequantized chunks.
bool gguf_linear_fused(int64_t in_features, int64_t out_features) {
#if defined(__AVX512F__)
  return in_features > 0 && in_features % 16 == 0 && out_features >= spmd_cpu::kF32FewPanel;
#else
  (void)in_features;
  (void)out_features;
  return false;
#endif
}

// x [M, K] float32 @ W^T, W [N, K] as its GGUF blocks ([N, bytes a row] uint8) -> [M, N] float32.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                       int64_t in_features, int64_t direct_rows) {
  constexpr const char* op = "gguf_linear";
  spmd_cpu::check_tensor(op, "x", x, 2);
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32");
  TORCH_CHECK(x.size(1) == in_features, op, ": x has ", x.size(1), " features, the weight ",
              in_features);
  check_blocks(op, blocks, kind, in_features);
  const at::Tensor rows = x.contiguous();
  const int64_t N = blocks.size(0);
  at::Tensor out = at::empty({rows.size(0), N}, rows.options());
  const uint8_t* data = blocks.data_ptr<uint8_t>();
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if (rows.size(0) <= direct_rows) {
    direct(rows, kind, data, blocks.size(1), N, out);
    return out;
  }
#endif
#if defined(__AVX512F__)
  if (gguf_linear_fused(in_features, N)) {
    fused_f32(rows, kind, data, blocks.size(1), N, out);
    return out;
  }
#endif
  tiled(rows, kind, data, blocks.size(1), N, out);
  return out;
}

// W [N, K] as its GGUF blocks -> float32 [N, K].
at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t kind, int64_t in_features) {
  check_blocks("gguf_dequantize", blocks, kind, in_features);
  at::Tensor out = at::empty({blocks.size(0), in_features}, blocks.options().dtype(at::kFloat));
  const uint8_t* data = blocks.data_ptr<uint8_t>();
  float* w = out.data_ptr<float>();
  at::parallel_for(0, blocks.size(0), 4, [&](int64_t begin, int64_t end) {
    dequantize_rows(kind, data, blocks.size(1), in_features, begin, end, w + begin * in_features);
  });
  return out;
}

// W [N, K] as its GGUF blocks -> bfloat16 [N, K]: each row dequantized to float32 in a buffer
// of the thread's (in L1), then rounded to bfloat16 (nearest, ties to even) as it is stored.
at::Tensor gguf_dequantize_bf16(const at::Tensor& blocks, int64_t kind, int64_t in_features) {
  check_blocks("gguf_dequantize_bf16", blocks, kind, in_features);
  at::Tensor out = at::empty({blocks.size(0), in_features}, blocks.options().dtype(at::kBFloat16));
  const uint8_t* data = blocks.data_ptr<uint8_t>();
  auto* w = reinterpret_cast<spmd_cpu::bf16_bits*>(out.data_ptr<at::BFloat16>());
  const int64_t K = in_features;
  at::parallel_for(0, blocks.size(0), 4, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t n = begin; n < end; ++n)
      dequantize_row_bf16(kind, data, blocks.size(1), K, n, row.data(), w + n * K);
  });
  return out;
}


// x: contiguous bfloat16 rows of in_features; blocks: W's rows of `kind`'s blocks.
void check_bf16_product(const char* op, const at::Tensor& x, const at::Tensor& blocks,
                        int64_t kind, int64_t in_features) {
  spmd_cpu::check_tensor(op, "x", x, 2);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous(), op,
              ": x must be a contiguous bfloat16 tensor, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) == in_features, op, ": x has ", x.size(1), " features, the weight ",
              in_features);
  check_blocks(op, blocks, kind, in_features);
}

// check_bf16_product, and a weight shape the plain products' tiles take.
void check_bf16_linear(const char* op, const at::Tensor& x, const at::Tensor& blocks,
                       int64_t kind, int64_t in_features) {
  check_bf16_product(op, x, blocks, kind, in_features);
  TORCH_CHECK(spmd_cpu::bf16_linear_supported(in_features, blocks.size(0)), op,
              ": runs where the build has AVX512-BF16, in_features is a multiple of 32 and "
              "out_features >= ", spmd_cpu::kBf16Panel, " (ask gguf_bf16_linear_supported), got [",
              blocks.size(0), ", ", in_features, "]");
}

// x [M, K] bfloat16 @ W^T, W [N, K] as its GGUF blocks -> [M, N] bfloat16 (float32 with
// float32_out: the sums as they are, for logits), without W in memory at any precision: each
// task dequantizes a panel of output features to bfloat16 in buffers of its own, as
// gguf_dequantize_bf16 rounds them, and multiplies every row of x by it.
// - kGemmFromRows to kLanesMaxRows rows: the rows in the lanes (x packed once as [pair of
//   inputs][row]) against panels of 16, 12 or 8 features left row-major (cpu_bf16_gemm.h
//   lanes_tile), no packing of the weights: 1.18x the packed panels at 16 rows, 1.17x at 32,
//   1.07x at 48 (SmolLM2's Q4_1 layer, 2 Zen 5 cores).
// - More rows: panels of 32 features, packed as [pair of inputs][feature] words
//   (cpu_bf16_gemm.h) for register tiles of 12 rows x 32 features: at 128-512 rows SmolLM2's
//   and an 8B model's shapes run at oneDNN's prepacked bf16 speed (~0.9 TFLOP/s on 2 Zen 5
//   cores), dequantization included.
// - Fewer rows: panels of 8 features row-major on the few-row tiles (cpu_bf16_linear.h), whose
//   result is bit for bit bf16_linear(x, gguf_dequantize_bf16(W)); packing would cost more
//   than it saves there (576 x 1536 at 2 rows: 0.053 ms packed against 0.031).
#if defined(__AVX512BF16__)
// residual (bf16 out only; may be null): each output becomes residual + the product, the
// product rounded to bf16 first, then the float32 sum rounded again (torch's bf16 add).
template <class Out>
void bf16_product_into(const spmd_cpu::bf16_bits* xp, int64_t M, int64_t K, const uint8_t* data,
                       int64_t row_bytes, int64_t N, int64_t kind, Out* o,
                       const spmd_cpu::bf16_bits* residual = nullptr) {
  const auto lanes = [&](auto registers, auto features) {
    constexpr int RV = decltype(registers)::value, F = decltype(features)::value;
    std::vector<uint32_t> packed(K / 2 * RV * 16);
    spmd_cpu::pack_lanes(xp, M, K, packed.data());
    dequantized_panels<F, spmd_cpu::bf16_bits, uint32_t>(kind, data, row_bytes, K, N, 0,
                          [&](const spmd_cpu::bf16_bits* panel, int64_t n0, uint32_t*) {
                            spmd_cpu::lanes_tile<RV, F>(packed.data(), M, K, panel, o + n0, N);
                          });
  };
  using std::integral_constant;
  if (M >= kGemmFromRows && M <= spmd_cpu::kLanesMaxRows && N >= 16) {
    switch (spmd_cpu::lane_registers(M)) {
      case 1: lanes(integral_constant<int, 1>{}, integral_constant<int, 16>{}); break;
      case 2: lanes(integral_constant<int, 2>{}, integral_constant<int, 12>{}); break;
      default: lanes(integral_constant<int, 3>{}, integral_constant<int, 8>{}); break;
    }
  } else if (M >= kGemmFromRows && N >= spmd_cpu::kGemmPanel) {
    dequantized_panels<spmd_cpu::kGemmPanel, spmd_cpu::bf16_bits, uint32_t>(
        kind, data, row_bytes, K, N, spmd_cpu::kGemmPanel * K / 2,
        [&](const spmd_cpu::bf16_bits* panel, int64_t n0, uint32_t* packed) {
          spmd_cpu::pack_gemm_panel(panel, K, packed);
          if constexpr (std::is_same_v<Out, spmd_cpu::bf16_bits>) {
            if (residual != nullptr) {   // the residual added in the tiles' epilogue
              spmd_cpu::gemm_panel_rows(xp, M, K, packed, [&](int64_t r, __m512 low, __m512 high) {
                const spmd_cpu::bf16_bits* add = residual + r * N + n0;
                low = spmd_cpu::plus_rounded(low, add);
                high = spmd_cpu::plus_rounded(high, add + 16);
                _mm512_storeu_si512(o + r * N + n0, (__m512i)_mm512_cvtne2ps_pbh(high, low));
              });
              return;
            }
          }
          spmd_cpu::gemm_panel_rows(xp, M, K, packed, o + n0, N);
        });
    return;   // any residual is in: the panels added it in their epilogue
  } else {
    dequantized_panels<spmd_cpu::kBf16Panel, spmd_cpu::bf16_bits, uint32_t>(
        kind, data, row_bytes, K, N, 0,
        [&](const spmd_cpu::bf16_bits* panel, int64_t n0, uint32_t*) {
          spmd_cpu::bf16_panel_rows(xp, M, K, panel, o + n0, N);
        });
  }
  if constexpr (std::is_same_v<Out, spmd_cpu::bf16_bits>) {
    if (residual != nullptr)
      at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin * N; i < end * N; ++i)
          o[i] = spmd_cpu::float_to_bf16(spmd_cpu::bf16_to_float(o[i]) +
                                         spmd_cpu::bf16_to_float(residual[i]));
      });
  }
}
#endif

at::Tensor gguf_bf16_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                            int64_t in_features, bool float32_out) {
  check_bf16_linear("gguf_bf16_linear", x, blocks, kind, in_features);
  const int64_t M = x.size(0), K = in_features, N = blocks.size(0);
  at::Tensor out = at::empty({M, N}, x.options().dtype(float32_out ? at::kFloat : at::kBFloat16));
#if defined(__AVX512BF16__)
  const auto* xp = static_cast<const spmd_cpu::bf16_bits*>(x.const_data_ptr());
  if (float32_out)
    bf16_product_into(xp, M, K, blocks.data_ptr<uint8_t>(), blocks.size(1), N, kind,
                      out.data_ptr<float>());
  else
    bf16_product_into(xp, M, K, blocks.data_ptr<uint8_t>(), blocks.size(1), N, kind,
                      static_cast<spmd_cpu::bf16_bits*>(out.mutable_data_ptr()));
#endif
  return out;
}

// residual + x @ W^T: gguf_bf16_linear's bf16 product added to residual [M, N] (contiguous
// bfloat16) as torch adds two bf16 tensors, bit for bit; past kLanesMaxRows rows (a prompt's
// down projection) in the packed panels' epilogue, so the product is never written alone.
at::Tensor gguf_bf16_residual_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                                     int64_t in_features, const at::Tensor& residual) {
  constexpr const char* op = "gguf_bf16_residual_linear";
  check_bf16_linear(op, x, blocks, kind, in_features);
  const int64_t M = x.size(0), K = in_features, N = blocks.size(0);
  TORCH_CHECK(residual.scalar_type() == at::kBFloat16 && residual.is_contiguous() &&
                  residual.dim() == 2 && residual.size(0) == M && residual.size(1) == N,
              op, ": residual must be a contiguous bfloat16 [", M, ", ", N, "] tensor, got ",
              residual.scalar_type(), " ", residual.sizes());
  at::Tensor out = at::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
  bf16_product_into(static_cast<const spmd_cpu::bf16_bits*>(x.const_data_ptr()), M, K,
                    blocks.data_ptr<uint8_t>(), blocks.size(1), N, kind,
                    static_cast<spmd_cpu::bf16_bits*>(out.mutable_data_ptr()),
                    static_cast<const spmd_cpu::bf16_bits*>(residual.const_data_ptr()));
#endif
  return out;
}

// SiLU(x @ Wg^T) * (x @ Wu^T) for W = [Wg; Wu] [2I, K] as its GGUF blocks (a fused gate/up
// projection of one block type, gate rows first) -> [M, I] bfloat16: gguf_bf16_linear's packed
// panels, each of 16 gate features and their 16 up features, whose sums are rounded to bf16
// and go through silu_mul's bf16 step in the tile's epilogue, so the [M, 2I] product is never
// written: bit for bit silu_mul(gguf_bf16_linear(x, W)) where that takes the packed panels
// (past kLanesMaxRows rows).
at::Tensor gguf_bf16_silu_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                                 int64_t in_features) {
  constexpr const char* op = "gguf_bf16_silu_linear";
  check_bf16_product(op, x, blocks, kind, in_features);
  const int64_t M = x.size(0), K = in_features, I = blocks.size(0) / 2;
  TORCH_CHECK(blocks.size(0) % 32 == 0 && spmd_cpu::bf16_linear_supported(K, 2 * I), op,
              ": runs where the build has AVX512-BF16, in_features is a multiple of 32 and the "
              "gate/up rows (gate first) are a multiple of 32, got [", blocks.size(0), ", ", K,
              "]");
  at::Tensor out = at::empty({M, I}, x.options());
#if defined(__AVX512BF16__)
  const auto* xp = static_cast<const spmd_cpu::bf16_bits*>(x.const_data_ptr());
  auto* o = static_cast<spmd_cpu::bf16_bits*>(out.mutable_data_ptr());
  dequantized_panels_of<spmd_cpu::kGemmPanel, spmd_cpu::bf16_bits, uint32_t>(
      kind, blocks.data_ptr<uint8_t>(), blocks.size(1), K, I / 16, spmd_cpu::kGemmPanel * K / 2,
      [I](int64_t p, int64_t f) { return spmd_cpu::gated_panel_feature(p, f, I); },
      [&](const spmd_cpu::bf16_bits* panel, int64_t p, uint32_t* packed) {
        spmd_cpu::pack_gemm_panel(panel, K, packed);
        spmd_cpu::gemm_panel_rows(xp, M, K, packed, [&](int64_t r, __m512 gate, __m512 up) {
          spmd_cpu::vstore_bf16(o + r * I + 16 * p, spmd_cpu::silu_mul_rounded(gate, up));
        });
      });
#endif
  return out;
}

// Whether this build has gguf_int8_linear (AVX-512 BW and VNNI).
bool gguf_int8_linear_supported() {
#if defined(SPMD_GGUF_INT8)
  return true;
#else
  return false;
#endif
}

// What gguf_int8_linear and its fused forms check of x and the blocks.
void check_int8_linear(const char* op, const at::Tensor& x, const at::Tensor& blocks,
                       int64_t kind, int64_t in_features) {
  spmd_cpu::check_tensor(op, "x", x, 2);
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              x.is_contiguous(), op, ": x must be a contiguous float32 or bfloat16 tensor, got ",
              x.scalar_type());
  TORCH_CHECK(x.size(1) == in_features, op, ": x has ", x.size(1), " features, the weight ",
              in_features);
  check_blocks(op, blocks, kind, in_features);
  TORCH_CHECK(block_format(kind).weights == kBlock, op, ": GGML type ", kind, " is not a block "
              "of 32 (Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0)");
  TORCH_CHECK(gguf_int8_linear_supported(), op, ": runs where the build has AVX-512 BW and "
              "VNNI (ask gguf_int8_linear_supported)");
}

// [M, N] in x's dtype: x's rows quantized to 8 bits per block of 32 and multiplied by the
// blocks' codes in integers (cpu_group_quant_int8.h), the sums going where Int8Out says (a
// residual in x's dtype shaped as the output, or a gate/up projection's up rows `up` past the
// gate's). The arguments are checked.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                       int64_t in_features, int64_t N, const at::Tensor* residual, int64_t up) {
  const int64_t M = x.size(0), K = in_features;
  at::Tensor out = at::empty({M, N}, x.options());
#if defined(SPMD_GGUF_INT8)
  if (M == 0 || N == 0) return out;
  Int8Rows rows;
  const auto run = [&](auto element) {
    using E = decltype(element);
    quantize_rows_int8(static_cast<const E*>(x.const_data_ptr()), M, K, rows);
    const Int8Out<E> o{static_cast<E*>(out.mutable_data_ptr()), N,
                       residual == nullptr ? nullptr
                                           : static_cast<const E*>(residual->const_data_ptr()),
                       up};
    with_kind(kind, [&](auto k) {
      constexpr int64_t KIND = decltype(k)::value;
      if constexpr (block_format(KIND).weights == kBlock)
        int8_blocks_product<KIND>(rows, M, K, blocks.data_ptr<uint8_t>(), blocks.size(1), N, o);
    });
  };
  if (x.scalar_type() == at::kFloat) run(float{});
  else run(spmd_cpu::bf16_bits{});
#endif
  return out;
}

// x [M, K] (float32 or bfloat16) @ W^T, W [N, K] as GGUF blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0) -> [M, N] in x's dtype, x quantized to 8 bits per block of 32 and multiplied by the
// blocks' codes in integers (cpu_group_quant_int8.h): `--quantization int8` over a GGUF file.
at::Tensor gguf_int8_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                            int64_t in_features) {
  check_int8_linear("gguf_int8_linear", x, blocks, kind, in_features);
  return int8_linear(x, blocks, kind, in_features, blocks.size(0), nullptr, 0);
}

// residual + gguf_int8_linear(x, W), added in the product's epilogue as torch adds two tensors
// of x's dtype (the product rounded to it first), bit for bit.
at::Tensor gguf_int8_residual_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                                     int64_t in_features, const at::Tensor& residual) {
  constexpr const char* op = "gguf_int8_residual_linear";
  check_int8_linear(op, x, blocks, kind, in_features);
  const int64_t M = x.size(0), N = blocks.size(0);
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && residual.is_contiguous() &&
                  residual.dim() == 2 && residual.size(0) == M && residual.size(1) == N &&
                  residual.device().is_cpu() && residual.layout() == at::kStrided,
              op, ": residual must be a contiguous CPU ", x.scalar_type(), " [", M, ", ", N,
              "] tensor (x's dtype, the product's shape), got ", residual.scalar_type(), " ",
              residual.sizes());
  return int8_linear(x, blocks, kind, in_features, N, &residual, 0);
}

// SiLU(x @ Wg^T) * (x @ Wu^T) for W = [Wg; Wu] [2I, K] as GGUF blocks of 32 (a fused gate/up
// projection of one block type, gate rows first) -> [M, I] in x's dtype: gguf_int8_linear's
// sums of each gate and up feature rounded to x's dtype and put through silu_mul's step in the
// tiles' epilogue, bit for bit silu_mul(gguf_int8_linear(x, W)), the [M, 2I] product never
// written.
at::Tensor gguf_int8_silu_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                                 int64_t in_features) {
  constexpr const char* op = "gguf_int8_silu_linear";
  check_int8_linear(op, x, blocks, kind, in_features);
  TORCH_CHECK(blocks.size(0) % 32 == 0, op, ": the gate/up weight has ", blocks.size(0),
              " rows (gate first), a multiple of 32 expected (silu_mul's 16 lanes a step)");
  const int64_t I = blocks.size(0) / 2;
  return int8_linear(x, blocks, kind, in_features, I, nullptr, I);
}

// The bound table of gguf_int8_head for a head's blocks [N, bytes a row] of a type of blocks of
// 32: [N (K / 32 + 1)] float32, feature v's bound per block of 32 inputs at [v K / 32 ..], then
// each feature's largest (cpu_int8_head.h).
at::Tensor gguf_int8_head_bounds(const at::Tensor& blocks, int64_t kind, int64_t in_features) {
  constexpr const char* op = "gguf_int8_head_bounds";
  check_blocks(op, blocks, kind, in_features);
  TORCH_CHECK(block_format(kind).weights == kBlock, op, ": GGML type ", kind, " is not a block "
              "of 32 (Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0)");
  TORCH_CHECK(gguf_int8_linear_supported(), op, ": runs where the build has AVX-512 BW and "
              "VNNI (ask gguf_int8_linear_supported)");
  const int64_t N = blocks.size(0), B = in_features / kBlock;
  at::Tensor out = at::empty({N * (B + 1)}, blocks.options().dtype(at::kFloat));
#if defined(SPMD_GGUF_INT8)
  head_bounds(kind, blocks.data_ptr<uint8_t>(), blocks.size(1), N, in_features,
              out.data_ptr<float>());
#endif
  return out;
}

// What gguf_int8_head and gguf_int8_greedy_head check: gguf_int8_linear's arguments, and the
// bound table's shape for these blocks.
void check_int8_head(const char* op, const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                     int64_t in_features, const at::Tensor& bounds) {
  check_int8_linear(op, x, blocks, kind, in_features);
  const int64_t N = blocks.size(0), B = in_features / kBlock;
  spmd_cpu::check_tensor(op, "bounds", bounds, 1);
  TORCH_CHECK(bounds.scalar_type() == at::kFloat && bounds.is_contiguous() &&
                  bounds.size(0) == N * (B + 1),
              op, ": bounds must be the contiguous float32 [", N * (B + 1),
              "] table gguf_int8_head_bounds makes of these blocks, got ", bounds.scalar_type(),
              " ", bounds.sizes());
}

// The LM head's logits [M, N] float32 for x [M, K] (float32 or bfloat16) and W [N, K] as GGUF
// blocks of 32: gguf_int8_linear's sums, with every logit the bound cannot rule out of the
// row's largest re-scored exactly (cpu_int8_head.h); `bounds` from gguf_int8_head_bounds. The
// first index of each row's largest logit is the exact product's.
at::Tensor gguf_int8_head(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                          int64_t in_features, const at::Tensor& bounds) {
  constexpr const char* op = "gguf_int8_head";
  check_int8_head(op, x, blocks, kind, in_features, bounds);
  const int64_t M = x.size(0), N = blocks.size(0);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
#if defined(SPMD_GGUF_INT8)
  if (M == 0 || N == 0) return out;
  const auto run = [&](auto element) {
    using E = decltype(element);
    int8_head(static_cast<const E*>(x.const_data_ptr()), M, in_features, kind,
              blocks.data_ptr<uint8_t>(), blocks.size(1), N, bounds.data_ptr<float>(),
              out.data_ptr<float>());
  };
  if (x.scalar_type() == at::kFloat) run(float{});
  else run(spmd_cpu::bf16_bits{});
#endif
  return out;
}

// Each row's greedy token, int64 [M]: the first index of the largest logit gguf_int8_head
// gives (the exact product's), its [M, N] logits never written (cpu_int8_head.h).
at::Tensor gguf_int8_greedy_head(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                                 int64_t in_features, const at::Tensor& bounds) {
  constexpr const char* op = "gguf_int8_greedy_head";
  check_int8_head(op, x, blocks, kind, in_features, bounds);
  const int64_t M = x.size(0), N = blocks.size(0);
  TORCH_CHECK(N > 0, op, ": the head has no features");
  at::Tensor tokens = at::empty({M}, x.options().dtype(at::kLong));
#if defined(SPMD_GGUF_INT8)
  if (M == 0) return tokens;
  const auto run = [&](auto element) {
    using E = decltype(element);
    int8_greedy_head(static_cast<const E*>(x.const_data_ptr()), M, in_features, kind,
                     blocks.data_ptr<uint8_t>(), blocks.size(1), N, bounds.data_ptr<float>(),
                     tokens.data_ptr<int64_t>());
  };
  if (x.scalar_type() == at::kFloat) run(float{});
  else run(spmd_cpu::bf16_bits{});
#endif
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spmd_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor blocks, int kind, int in_features, "
        "int direct_rows=32) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, int kind, int in_features) -> Tensor");
  m.def("gguf_dequantize_bf16(Tensor blocks, int kind, int in_features) -> Tensor");
  m.def("gguf_bf16_linear(Tensor x, Tensor blocks, int kind, int in_features, "
        "bool float32_out=False) -> Tensor");
  m.def("gguf_bf16_residual_linear(Tensor x, Tensor blocks, int kind, int in_features, "
        "Tensor residual) -> Tensor");
  m.def("gguf_bf16_linear_supported(int in_features, int out_features) -> bool",
        &spmd_cpu::bf16_linear_supported);
  m.def("gguf_linear_fused(int in_features, int out_features) -> bool", &gguf_linear_fused);
  m.def("gguf_bf16_silu_linear(Tensor x, Tensor blocks, int kind, int in_features) -> Tensor");
  m.def("gguf_int8_linear(Tensor x, Tensor blocks, int kind, int in_features) -> Tensor");
  m.def("gguf_int8_residual_linear(Tensor x, Tensor blocks, int kind, int in_features, "
        "Tensor residual) -> Tensor");
  m.def("gguf_int8_silu_linear(Tensor x, Tensor blocks, int kind, int in_features) -> Tensor");
  m.def("gguf_int8_linear_supported() -> bool", &gguf_int8_linear_supported);
  m.def("gguf_int8_head_bounds(Tensor blocks, int kind, int in_features) -> Tensor");
  m.def("gguf_int8_head(Tensor x, Tensor blocks, int kind, int in_features, Tensor bounds) "
        "-> Tensor");
  m.def("gguf_int8_greedy_head(Tensor x, Tensor blocks, int kind, int in_features, "
        "Tensor bounds) -> Tensor");
}

TORCH_LIBRARY_IMPL(spmd_cpu, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_dequantize", &gguf_dequantize);
  m.impl("gguf_dequantize_bf16", &gguf_dequantize_bf16);
  m.impl("gguf_bf16_linear", &gguf_bf16_linear);
  m.impl("gguf_bf16_residual_linear", &gguf_bf16_residual_linear);
  m.impl("gguf_bf16_silu_linear", &gguf_bf16_silu_linear);
  m.impl("gguf_int8_linear", &gguf_int8_linear);
  m.impl("gguf_int8_residual_linear", &gguf_int8_residual_linear);
  m.impl("gguf_int8_silu_linear", &gguf_int8_silu_linear);
  m.impl("gguf_int8_head_bounds", &gguf_int8_head_bounds);
  m.impl("gguf_int8_head", &gguf_int8_head);
  m.impl("gguf_int8_greedy_head", &gguf_int8_greedy_head);
}
