// The element-wise ends of an int8 projection (runtime/layers/quantization.py), each one pass:
// quantizing the activations per token in two int8 parts, and scaling the integer GEMM's sums
// back to float. In torch each is a chain of 6-8 operators, a few dozen per layer per step.
// Both compute exactly what the torch chain computes (same operations in the same order, round
// half to even), so either path gives the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

namespace {

constexpr float kLoSteps = 254.f;   // hi's rounding error, in [-0.5, 0.5], times 254 fills int8

// x [M, K] float32 -> (parts [2M, K] int8: hi rows then lo rows, scale [M, 1] float32).
std::tuple<at::Tensor, at::Tensor> quantize_rows_two_part(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x [rows, features] float32 expected");
  const at::Tensor rows = x.contiguous();
  const int64_t M = rows.size(0), K = rows.size(1);
  at::Tensor parts = at::empty({2 * M, K}, rows.options().dtype(at::kChar));
  at::Tensor scale = at::empty({M, 1}, rows.options());
  const float* src = rows.data_ptr<float>();
  int8_t* hi_dst = parts.data_ptr<int8_t>();
  int8_t* lo_dst = hi_dst + M * K;
  float* scale_dst = scale.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* in = src + r * K;
      float peak = 0.f;
#pragma omp simd reduction(max : peak)
      for (int64_t k = 0; k < K; ++k) peak = std::max(peak, std::fabs(in[k]));
      const float s = std::max(peak, 1e-12f) / 127.f;
      scale_dst[r] = s;
      int8_t* hi = hi_dst + r * K;
      int8_t* lo = lo_dst + r * K;
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) {
        const float t = in[k] / s;
        const float h = std::nearbyint(t);
        hi[k] = static_cast<int8_t>(h);
        lo[k] = static_cast<int8_t>(std::nearbyint((t - h) * kLoSteps));
      }
    }
  });
  return {parts, scale};
}

// sums [2M, N] int32 (hi rows then lo rows), x_scale [M, 1], w_scale [N] -> float32 [M, N]:
// (lo / 254 + hi) * x_scale * w_scale.
at::Tensor dequantize_two_part(const at::Tensor& sums, const at::Tensor& x_scale,
                               const at::Tensor& w_scale) {
  TORCH_CHECK(sums.dim() == 2 && sums.scalar_type() == at::kInt && sums.is_contiguous(),
              "sums [2 * rows, out] int32 expected");
  const int64_t M = sums.size(0) / 2, N = sums.size(1);
  TORCH_CHECK(x_scale.numel() == M && w_scale.numel() == N, "one scale per row and per column");
  const at::Tensor xs_t = x_scale.contiguous(), ws_t = w_scale.contiguous();
  at::Tensor out = at::empty({M, N}, xs_t.options());
  const int32_t* hi_src = sums.data_ptr<int32_t>();
  const int32_t* lo_src = hi_src + M * N;
  const float* xs = xs_t.data_ptr<float>();
  const float* ws = ws_t.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* hi = hi_src + r * N;
      const int32_t* lo = lo_src + r * N;
      float* o = dst + r * N;
      const float row_scale = xs[r];
#pragma omp simd
      for (int64_t n = 0; n < N; ++n)
        o[n] = (static_cast<float>(lo[n]) / kLoSteps + static_cast<float>(hi[n])) * row_scale * ws[n];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spmd_cpu, m) {
  m.def("quantize_rows_two_part(Tensor x) -> (Tensor, Tensor)");
  m.def("dequantize_two_part(Tensor sums, Tensor x_scale, Tensor w_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(spmd_cpu, CPU, m) {
  m.impl("quantize_rows_two_part", &quantize_rows_two_part);
  m.impl("dequantize_two_part", &dequantize_two_part);
}
