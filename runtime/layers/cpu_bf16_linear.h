// The few-row bfloat16 products of cpu_bf16_linear.cpp, for the library's other operators:
// spmd_cpu::decode_layers multiplies a plain bf16 weight where the Python layer loop does
// (runtime/layers/plain_bf16.py asks bf16_linear_takes too), so both give the same bits.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace spmd_cpu {

// Whether the build has the tiles (AVX512-BF16) and they take this weight's shape.
bool bf16_linear_supported(int64_t in_features, int64_t out_features);

// Whether `rows` rows against an [out_features, in_features] weight go to the tiles rather
// than oneDNN: the row counts where they measured faster, on shapes they take.
bool bf16_linear_takes(int64_t rows, int64_t in_features, int64_t out_features);

// x [rows, in_features] @ weight [out_features, in_features]^T, both contiguous bf16.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight);

}  // namespace spmd_cpu
