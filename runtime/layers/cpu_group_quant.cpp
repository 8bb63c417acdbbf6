// Projections whose weights stay in GGUF's block formats (runtime/layers/group_quant.py): each
// block of 32 weights along a row (16 for Q6_K) keeps its codes, 4-bit two to a byte or 8-bit,
// one float32 scale and, where the format has one, one float32 offset: w = scale * q + offset
// (Q4_1's d and m; Q4_0 as offset -8d; Q8_0 and Q6_K signed codes, no offset; Q4_K and Q5_K
// d sc and -dmin m). Activations and sums are float32.
//
// Few rows (decode): each thread takes a range of output features; a feature's weights are
// made in float32 once and every row of x multiplied into 32 running sums. Many rows
// (prefill): 64 output features at a time are expanded to float32 and multiplied by MKL's GEMM.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "cpu_math.h"

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kDirectRows = 8;     // up to this many rows of x: the direct kernel
constexpr int64_t kTile = 64;          // output features expanded at a time for the GEMM

struct Codes {
  const uint8_t* nibbles = nullptr;    // 4-bit: [N, K / 2], GGUF's layout per block of 32
  const int8_t* bytes = nullptr;       // 8-bit: [N, K]
  const float* scales;                 // [N, K / size]
  const float* offsets;                // [N, K / size] or nullptr
  int64_t K;
  int64_t size;                        // weights per block: 32 (16: Q6_K's 8-bit blocks)

  // 4-bit block b of output feature n as 32 floats q (without its scale and offset).
  inline void block(int64_t n, int64_t b, float* q) const {
    // Byte j of a block: element j in its low nibble, element j + 16 in its high one.
    const uint8_t* src = nibbles + n * (K / 2) + b * (kBlock / 2);
#pragma omp simd
    for (int j = 0; j < 16; ++j) {
      q[j] = static_cast<float>(src[j] & 0x0F);
      q[j + 16] = static_cast<float>(src[j] >> 4);
    }
  }

  // Output feature n's weights, expanded to float32 (K values): scale * q + offset.
  inline void row(int64_t n, float* w) const {
    const int64_t blocks = K / size;
    for (int64_t b = 0; b < blocks; ++b) {
      float* dst = w + b * size;
      if (nibbles != nullptr) {
        block(n, b, dst);
      } else {
        const int8_t* src = bytes + n * K + b * size;
#pragma omp simd
        for (int64_t j = 0; j < size; ++j) dst[j] = static_cast<float>(src[j]);
      }
      const float s = scales[n * blocks + b];
      const float o = offsets != nullptr ? offsets[n * blocks + b] : 0.f;
#pragma omp simd
      for (int64_t j = 0; j < size; ++j) dst[j] = dst[j] * s + o;
    }
  }
};

// Rows r0 .. r0 + R of x against one output feature's expanded weights w: R sets of 32 lane
// sums, kept in registers across the row, added up once.
template <int R>
inline void dot_rows(const float* w, const float* x, int64_t K, float* out, int64_t N) {
  float acc[R][kBlock] = {};
  for (int64_t k = 0; k < K; k += kBlock) {
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K + k;
#pragma omp simd
      for (int j = 0; j < kBlock; ++j) acc[r][j] += w[k + j] * xr[j];
    }
  }
  for (int r = 0; r < R; ++r) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < kBlock; ++j) sum += acc[r][j];
    out[r * N] = sum;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Eight codes as floats, times the block's scale plus its offset (one rounding: an FMA).
inline __m256 weights8(__m128i codes8, bool is_signed, __m256 scale, __m256 offset) {
  const __m256i wide = is_signed ? _mm256_cvtepi8_epi32(codes8) : _mm256_cvtepu8_epi32(codes8);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(wide), scale, offset);
}

// One output feature against R rows of x, the weights made in registers block by block and
// never stored: R x 4 vector sums (R <= 2 keeps them and a block's 4 weight vectors in the 16
// registers), added up once.
template <int R>
void fused_rows(const Codes& codes, int64_t n, const float* x, int64_t K, float* out, int64_t N) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
  const int64_t blocks = K / codes.size;
  const __m128i low_nibbles = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256 scale = _mm256_set1_ps(codes.scales[n * blocks + b]);
    const __m256 offset = _mm256_set1_ps(codes.offsets != nullptr ? codes.offsets[n * blocks + b] : 0.f);
    __m256 w[4];
    int lanes;       // vectors of 8 weights in this block: 4 (32 weights) or 2 (16)
    if (codes.nibbles != nullptr) {
      const __m128i bytes = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(codes.nibbles + n * (K / 2) + b * (kBlock / 2)));
      const __m128i lo = _mm_and_si128(bytes, low_nibbles);                     // weights 0-15
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibbles);  // 16-31
      w[0] = weights8(lo, false, scale, offset);
      w[1] = weights8(_mm_srli_si128(lo, 8), false, scale, offset);
      w[2] = weights8(hi, false, scale, offset);
      w[3] = weights8(_mm_srli_si128(hi, 8), false, scale, offset);
      lanes = 4;
    } else {
      const int8_t* src = codes.bytes + n * K + b * codes.size;
      lanes = static_cast<int>(codes.size / 8);
      for (int i = 0; i < lanes; ++i)
        w[i] = weights8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8 * i)), true,
                        scale, offset);
    }
    const int64_t k = b * codes.size;
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < lanes; ++i)
        acc[r][i] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(x + r * K + k + 8 * i), acc[r][i]);
  }
  for (int r = 0; r < R; ++r) {
    const __m256 sum8 = _mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]),
                                      _mm256_add_ps(acc[r][2], acc[r][3]));
    __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(sum8), _mm256_extractf128_ps(sum8, 1));
    sum4 = _mm_hadd_ps(sum4, sum4);
    sum4 = _mm_hadd_ps(sum4, sum4);
    out[r * N + n] = _mm_cvtss_f32(sum4);
  }
}

void direct(const float* x, int64_t M, const Codes& codes, int64_t N, float* out) {
  const int64_t K = codes.K;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      int64_t r = 0;
      for (; r + 2 <= M; r += 2) fused_rows<2>(codes, n, x + r * K, K, out + r * N, N);
      if (r < M) fused_rows<1>(codes, n, x + r * K, K, out + r * N, N);
    }
  });
}
#else
void direct(const float* x, int64_t M, const Codes& codes, int64_t N, float* out) {
  const int64_t K = codes.K;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    // One output feature's weights at a time, expanded once into a row that stays in cache
    // while every row of x passes over it, four at a time.
    std::vector<float> w(K);
    for (int64_t n = begin; n < end; ++n) {
      codes.row(n, w.data());
      int64_t r = 0;
      for (; r + 4 <= M; r += 4) dot_rows<4>(w.data(), x + r * K, K, out + r * N + n, N);
      switch (M - r) {
        case 3: dot_rows<3>(w.data(), x + r * K, K, out + r * N + n, N); break;
        case 2: dot_rows<2>(w.data(), x + r * K, K, out + r * N + n, N); break;
        case 1: dot_rows<1>(w.data(), x + r * K, K, out + r * N + n, N); break;
        default: break;
      }
    }
  });
}
#endif

void tiled(const at::Tensor& x, const Codes& codes, int64_t N, at::Tensor& out) {
  const int64_t K = codes.K;
  at::Tensor tile = at::empty({kTile, K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += kTile) {
    const int64_t count = std::min(kTile, N - n0);
    float* w = tile.data_ptr<float>();
    at::parallel_for(0, count, 4, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) codes.row(n0 + i, w + i * K);
    });
    out.narrow(1, n0, count).copy_(at::mm(x, tile.narrow(0, 0, count).t()));
  }
}

void check_blocks(const char* op, const char* name, const at::Tensor& t, int64_t N,
                  int64_t blocks) {
  spmd_cpu::check_tensor(op, name, t, 2);
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), op, ": ", name,
              " must be a contiguous float32 tensor");
  TORCH_CHECK(t.size(0) == N && t.size(1) == blocks, op, ": ", name, " has shape ",
              t.sizes(), ", [out_features, in_features / block size] expected");
}

// x [M, K] float32, codes ([N, K/2] uint8 for 4 bits, [N, K] int8 for 8), scales [N, K/size],
// offsets [N, K/size] or None, `size` weights a block (4 bits: 32; 8 bits: 32 or 16)
// -> [M, N] float32.
at::Tensor group_quant_linear(const at::Tensor& x, const at::Tensor& codes,
                              const at::Tensor& scales, const std::optional<at::Tensor>& offsets,
                              int64_t bits, int64_t size) {
  constexpr const char* op = "group_quant_linear";
  spmd_cpu::check_tensor(op, "x", x, 2);
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32");
  TORCH_CHECK(bits == 4 || bits == 8, op, ": bits must be 4 or 8");
  spmd_cpu::check_tensor(op, "codes", codes, 2);
  TORCH_CHECK(codes.is_contiguous() &&
                  codes.scalar_type() == (bits == 4 ? at::kByte : at::kChar),
              op, ": codes must be a contiguous ", bits == 4 ? "uint8" : "int8", " tensor");
  TORCH_CHECK(size == 32 || (size == 16 && bits == 8), op,
              ": blocks are 32 weights (8-bit codes: 32 or 16)");
  const int64_t K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % kBlock == 0, op, ": in_features must be a multiple of 32");
  TORCH_CHECK(codes.size(1) == (bits == 4 ? K / 2 : K), op,
              ": codes and x disagree on in_features");
  check_blocks(op, "scales", scales, N, K / size);
  if (offsets.has_value()) check_blocks(op, "offsets", *offsets, N, K / size);
  const at::Tensor rows = x.contiguous();
  Codes view{bits == 4 ? codes.data_ptr<uint8_t>() : nullptr,
             bits == 8 ? codes.data_ptr<int8_t>() : nullptr, scales.data_ptr<float>(),
             offsets.has_value() ? offsets->data_ptr<float>() : nullptr, K, size};
  at::Tensor out = at::empty({rows.size(0), N}, rows.options());
  if (rows.size(0) <= kDirectRows) {
    direct(rows.data_ptr<float>(), rows.size(0), view, N, out.data_ptr<float>());
  } else {
    tiled(rows, view, N, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spmd_cpu, m) {
  m.def("group_quant_linear(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, int bits, "
        "int size=32) -> Tensor");
}

TORCH_LIBRARY_IMPL(spmd_cpu, CPU, m) { m.impl("group_quant_linear", &group_quant_linear); }
