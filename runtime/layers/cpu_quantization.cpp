// The element-wise ends of an int8 projection (runtime/layers/quantization.py), each one pass:
// quantizing the activations per token in two int8 parts, and scaling the integer GEMM's sums
// back to float. In torch each is a chain of 6-8 operators, a few dozen per layer per step.
// Both compute exactly what the torch chain computes (same operations in the same order, round
// half to even), so either path gives the same bits.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "cpu_math.h"

namespace {

constexpr float kLoSteps = 254.f;   // hi's rounding error, in [-0.5, 0.5], times 254 fills int8

// x [M, K] float32 -> (parts [2M, K]: hi rows then lo rows, scale [M, 1] float32). Parts are
// int8, or with `shifted` uint8 holding code + 128 (the unsigned activations of oneDNN's
// prepacked int8 linear, whose zero point 128 takes the shift off again).
template <typename code_t>
void quantize_into(const at::Tensor& rows, code_t* hi_dst, float* scale_dst, int offset) {
  const int64_t M = rows.size(0), K = rows.size(1);
  const float* src = rows.data_ptr<float>();
  code_t* lo_dst = hi_dst + M * K;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* in = src + r * K;
      float peak = 0.f;
#pragma omp simd reduction(max : peak)
      for (int64_t k = 0; k < K; ++k) peak = std::max(peak, std::fabs(in[k]));
      const float s = std::max(peak, 1e-12f) / 127.f;
      scale_dst[r] = s;
      code_t* hi = hi_dst + r * K;
      code_t* lo = lo_dst + r * K;
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) {
        const float t = in[k] / s;
        const float h = std::nearbyint(t);
        hi[k] = static_cast<code_t>(static_cast<int>(h) + offset);
        lo[k] = static_cast<code_t>(static_cast<int>(std::nearbyint((t - h) * kLoSteps)) + offset);
      }
    }
  });
}

void check_float(const at::Tensor& t, const char* op, const char* name) {
  spmd_cpu::check_cpu_tensor(t, op, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " is ", t.scalar_type(),
              ", float32 expected");
}

std::tuple<at::Tensor, at::Tensor> quantize_rows_two_part(const at::Tensor& x, bool shifted) {
  check_float(x, "quantize_rows_two_part", "x");
  TORCH_CHECK(x.dim() == 2, "quantize_rows_two_part: x has ", x.dim(),
              " dimensions, [rows, features] expected");
  const at::Tensor rows = x.contiguous();
  const int64_t M = rows.size(0), K = rows.size(1);
  at::Tensor parts = at::empty({2 * M, K}, rows.options().dtype(shifted ? at::kByte : at::kChar));
  at::Tensor scale = at::empty({M, 1}, rows.options());
  if (shifted) {
    quantize_into<uint8_t>(rows, parts.data_ptr<uint8_t>(), scale.data_ptr<float>(), 128);
  } else {
    quantize_into<int8_t>(rows, parts.data_ptr<int8_t>(), scale.data_ptr<float>(), 0);
  }
  return {parts, scale};
}

// sums [2M, N] (hi rows then lo rows; int32, or float32 holding the same integers as
// oneDNN's int8 linear gives them), x_scale [M, 1], w_scale [N] -> float32 [M, N]:
// (lo / 254 + hi) * x_scale * w_scale.
template <typename sum_t>
void dequantize_into(const at::Tensor& sums, const at::Tensor& xs_t, const at::Tensor& ws_t,
                     at::Tensor& out) {
  const int64_t M = sums.size(0) / 2, N = sums.size(1);
  const sum_t* hi_src = sums.data_ptr<sum_t>();
  const sum_t* lo_src = hi_src + M * N;
  const float* xs = xs_t.data_ptr<float>();
  const float* ws = ws_t.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const sum_t* hi = hi_src + r * N;
      const sum_t* lo = lo_src + r * N;
      float* o = dst + r * N;
      const float row_scale = xs[r];
#pragma omp simd
      for (int64_t n = 0; n < N; ++n)
        o[n] = (static_cast<float>(lo[n]) / kLoSteps + static_cast<float>(hi[n])) * row_scale * ws[n];
    }
  });
}

at::Tensor dequantize_two_part(const at::Tensor& sums, const at::Tensor& x_scale,
                               const at::Tensor& w_scale) {
  constexpr const char* op = "dequantize_two_part";
  spmd_cpu::check_cpu_tensor(sums, op, "sums");
  TORCH_CHECK(sums.scalar_type() == at::kInt || sums.scalar_type() == at::kFloat, op, ": sums is ",
              sums.scalar_type(), ", int32 or float32 expected");
  TORCH_CHECK(sums.dim() == 2 && sums.size(0) % 2 == 0, op, ": sums has shape ", sums.sizes(),
              ", [2 * rows, out] (hi rows, then as many lo rows) expected");
  TORCH_CHECK(sums.is_contiguous(), op, ": sums has strides ", sums.strides(),
              ", a contiguous tensor expected");
  const int64_t M = sums.size(0) / 2, N = sums.size(1);
  check_float(x_scale, op, "x_scale");
  TORCH_CHECK(x_scale.numel() == M, op, ": x_scale has ", x_scale.numel(), " values and sums ",
              M, " rows of each part (one scale per row expected)");
  check_float(w_scale, op, "w_scale");
  TORCH_CHECK(w_scale.numel() == N, op, ": w_scale has ", w_scale.numel(), " values and sums ",
              N, " columns (one scale per column expected)");
  const at::Tensor xs_t = x_scale.contiguous(), ws_t = w_scale.contiguous();
  at::Tensor out = at::empty({M, N}, xs_t.options());
  if (sums.scalar_type() == at::kInt) {
    dequantize_into<int32_t>(sums, xs_t, ws_t, out);
  } else {
    dequantize_into<float>(sums, xs_t, ws_t, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spmd_cpu, m) {
  m.def("quantize_rows_two_part(Tensor x, bool shifted=False) -> (Tensor, Tensor)");
  m.def("dequantize_two_part(Tensor sums, Tensor x_scale, Tensor w_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(spmd_cpu, CPU, m) {
  m.impl("quantize_rows_two_part", &quantize_rows_two_part);
  m.impl("dequantize_two_part", &dequantize_two_part);
}
