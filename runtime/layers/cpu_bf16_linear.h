// The few-row bfloat16 products of cpu_bf16_linear.cpp, for the library's other operators:
// spmd_cpu::decode_layers multiplies a plain bf16 weight where the Python layer loop does
// (runtime/layers/plain_bf16.py asks bf16_linear_takes too), so both give the same bits.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

#include "cpu_bf16.h"

namespace spmd_cpu {

// Output features a task's accumulators hold: the weight rows of one panel.
constexpr int64_t kBf16Panel = 8;

// The first output feature of panel p of N, panels of WIDTH features (N >= WIDTH): the last
// panel overlaps the one before rather than running short.
template <int64_t WIDTH = kBf16Panel>
inline int64_t bf16_panel_start(int64_t p, int64_t N) {
  return std::min(p * WIDTH, N - WIDTH);
}

// Whether the build has the tiles (AVX512-BF16) and they take this weight's shape.
bool bf16_linear_supported(int64_t in_features, int64_t out_features);

// Whether `rows` rows against an [out_features, in_features] weight go to the tiles rather
// than oneDNN: the row counts where they measured faster, on shapes they take.
bool bf16_linear_takes(int64_t rows, int64_t in_features, int64_t out_features);

#if defined(__AVX512BF16__)
// x [rows, K] against one panel (kBf16Panel weight rows of K, contiguous): out[r * ldo + f]
// receives row r's output f, rounded to bf16 (or, into float32 out, its float32 sum). Rows go
// two at a time; the panel stays in L1.
void bf16_panel_rows(const bf16_bits* x, int64_t rows, int64_t K, const bf16_bits* panel,
                     bf16_bits* out, int64_t ldo);
void bf16_panel_rows(const bf16_bits* x, int64_t rows, int64_t K, const bf16_bits* panel,
                     float* out, int64_t ldo);
#endif

// x [rows, in_features] @ weight [out_features, in_features]^T, both contiguous bf16.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight);

}  // namespace spmd_cpu
