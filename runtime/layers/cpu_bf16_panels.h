// bfloat16 weights packed once at load into panels of 32 output features (cpu_bf16_panels.cpp),
// for the library's other operators: spmd_cpu::decode_layers and prompt_layers multiply a
// projection held so where the Python layer loop does (runtime/layers/bf16_panels.py), with the
// same tiles, so both give the same bits.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace spmd_cpu {

// Whether the build has the panels' tiles (AVX512-BF16) and they take an [out_features,
// in_features] weight: both multiples of 32.
bool bf16_panels_supported(int64_t in_features, int64_t out_features);

// Whether `panels` is a packed weight (int32 words) rather than a plain or oneDNN one.
inline bool is_bf16_panels(const at::Tensor& panels) {
  return panels.scalar_type() == at::kInt && !panels.is_mkldnn();
}

// Whether `panels` has the shape bf16_panels_pack gives an [out, in] weight: [out / 32, in * 16]
// int32 words (32 features a panel, one word a pair of inputs and a feature).
inline bool bf16_panels_fit(const at::Tensor& panels, int64_t out, int64_t in) {
  return panels.dim() == 2 && panels.size(0) * 32 == out && panels.size(1) == in * 16;
}

// x [M, K] bf16 @ W^T -> [M, N] bf16, W [N, K] packed by bf16_panels_pack (stand_in: a
// zero-byte [N, K] bf16 view giving its shape).
at::Tensor bf16_panels_linear(const at::Tensor& x, const at::Tensor& panels,
                              const at::Tensor& stand_in);

// residual + x @ W^T, the product rounded to bf16 first and the sum again: bit for bit
// residual + bf16_panels_linear(x, W), as torch adds two bf16 tensors.
at::Tensor bf16_panels_residual_linear(const at::Tensor& x, const at::Tensor& panels,
                                       const at::Tensor& stand_in, const at::Tensor& residual);

// SiLU(x @ Wg^T) * (x @ Wu^T) for W = [Wg; Wu] (gate rows first) -> [M, N / 2]: bit for bit
// silu_mul(bf16_panels_linear(x, W)), without the [M, N] product in memory.
at::Tensor bf16_panels_silu_linear(const at::Tensor& x, const at::Tensor& panels,
                                   const at::Tensor& stand_in);

}  // namespace spmd_cpu
