// bfloat16 x bfloat16 products of a few rows against a plain [out_features, in_features]
// weight, on AVX512-BF16 dot products (VDPBF16PS, float32 sums): the weights oneDNN cannot hold
// in its blocked layout without a second copy (an LM head tied to the embedding table, which
// the embedding lookups read row by row) or that are made afresh each step (GGUF blocks
// dequantized to bf16). oneDNN reorders such a weight on every call, reading and writing it
// once more than the product does: for SmolLM2's tied head (49,152 x 576) at 1 row 1.8 ms
// against 0.6-0.7 for the same weight prepacked; these tiles take 1.1.
//
// Each task takes a panel of 8 output features and walks the rows two at a time: 2 x 8 float32
// accumulators, each a feature's partial sums over 16 lanes of in_features, fed 32 products an
// instruction from the two rows' and eight weight rows' bf16 (10 loads a 16 instructions), then
// summed across lanes 16 at a time (cpu_avx512.h lane_sums) and rounded to bf16 once. A lone
// last row runs paired with itself. The weight panel (8 x in_features) stays in L1 across the
// rows, so the weight is read from memory once whatever the row count.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "cpu_bf16.h"
#include "cpu_bf16_dot.h"
#include "cpu_bf16_linear.h"
#include "cpu_math.h"

namespace {

using spmd_cpu::bf16_bits;

constexpr const char* kOp = "bf16_linear";
constexpr int64_t kChunk = 32;       // in_features a dot-product instruction takes
constexpr int64_t kPanel = spmd_cpu::kBf16Panel;

// Up to kAlwaysRows rows the tiles beat oneDNN on every shape measured; up to kPanelRows while a
// task's panel of kPanel weight rows fits kPanelBytes of L1, so that the row pairs reuse it
// (in_features 4096 at 32 rows: 1.2x oneDNN's time, so oneDNN keeps those).
constexpr int64_t kAlwaysRows = 8;
constexpr int64_t kPanelRows = 32;
constexpr int64_t kPanelBytes = 32 * 1024;

}  // namespace

namespace spmd_cpu {

bool bf16_linear_supported(int64_t in_features, int64_t out_features) {
#if defined(__AVX512BF16__)
  return in_features % kChunk == 0 && in_features > 0 && out_features >= kPanel;
#else
  (void)in_features;
  (void)out_features;
  return false;
#endif
}

bool bf16_linear_takes(int64_t rows, int64_t in_features, int64_t out_features) {
  const bool fits = rows <= kAlwaysRows ||
                    (rows <= kPanelRows && kPanel * in_features * 2 <= kPanelBytes);
  return rows > 0 && fits && bf16_linear_supported(in_features, out_features);
}

#if defined(__AVX512BF16__)
// Rows a and b (in_features K each) against the kPanel weight rows from w (K apart): out_a and
// out_b receive the panel's kPanel outputs (rounded to bf16 where Out is bf16).
namespace {

template <class Out>
inline void panel_pair(const bf16_bits* a, const bf16_bits* b, const bf16_bits* w, int64_t K,
                       Out* out_a, Out* out_b) {
  __m512 acc[2 * kPanel];
  for (auto& v : acc) v = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kChunk) {
    const __m512bh xa = (__m512bh)_mm512_loadu_si512(a + k);
    const __m512bh xb = (__m512bh)_mm512_loadu_si512(b + k);
    for (int64_t f = 0; f < kPanel; ++f) {
      const __m512bh wf = (__m512bh)_mm512_loadu_si512(w + f * K + k);
      acc[f] = _mm512_dpbf16_ps(acc[f], xa, wf);
      acc[kPanel + f] = _mm512_dpbf16_ps(acc[kPanel + f], xb, wf);
    }
  }
  alignas(64) Out sums[2 * kPanel];
  spmd_cpu::vstore_any(sums, spmd_cpu::lane_sums(acc));
  std::copy_n(sums, kPanel, out_a);
  std::copy_n(sums + kPanel, kPanel, out_b);
}

template <class Out>
void panel_rows(const bf16_bits* x, int64_t rows, int64_t K, const bf16_bits* panel, Out* out,
                int64_t ldo) {
  alignas(64) Out spare[kPanel];
  for (int64_t r = 0; r < rows; r += 2) {
    const bool pair = r + 1 < rows;
    panel_pair(x + r * K, x + (pair ? r + 1 : r) * K, panel, K, out + r * ldo,
               pair ? out + (r + 1) * ldo : spare);
  }
}

}  // namespace

void bf16_panel_rows(const bf16_bits* x, int64_t rows, int64_t K, const bf16_bits* panel,
                     bf16_bits* out, int64_t ldo) {
  panel_rows(x, rows, K, panel, out, ldo);
}

void bf16_panel_rows(const bf16_bits* x, int64_t rows, int64_t K, const bf16_bits* panel,
                     float* out, int64_t ldo) {
  panel_rows(x, rows, K, panel, out, ldo);
}
#endif

}  // namespace spmd_cpu

namespace {

using spmd_cpu::bf16_linear_supported;


void check_args(const at::Tensor& x, const at::Tensor& weight) {
  spmd_cpu::check_tensor(kOp, "x", x, 2);
  spmd_cpu::check_tensor(kOp, "weight", weight, 2);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, kOp,
              ": x and weight must be bfloat16, got ", x.scalar_type(), " and ",
              weight.scalar_type());
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), kOp,
              ": x and weight must be contiguous");
  TORCH_CHECK(x.size(1) == weight.size(1), kOp, ": x has ", x.size(1),
              " features but weight takes ", weight.size(1));
  TORCH_CHECK(bf16_linear_supported(weight.size(1), weight.size(0)), kOp,
              ": runs where the build has AVX512-BF16, in_features is a multiple of ", kChunk,
              " and out_features >= ", kPanel, " (ask bf16_linear_supported), got weight ",
              weight.sizes());
}

}  // namespace

// x [rows, K] @ weight[N, K]^T -> [rows, N], bf16.
at::Tensor spmd_cpu::bf16_linear(const at::Tensor& x, const at::Tensor& weight) {
  check_args(x, weight);
  const int64_t rows = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor out = at::empty({rows, N}, x.options());
#if defined(__AVX512BF16__)
  const auto* xp = static_cast<const bf16_bits*>(x.const_data_ptr());
  const auto* wp = static_cast<const bf16_bits*>(weight.const_data_ptr());
  auto* op = static_cast<bf16_bits*>(out.mutable_data_ptr());
  const int64_t panels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = spmd_cpu::bf16_panel_start(p, N);
      spmd_cpu::bf16_panel_rows(xp, rows, K, wp + n0 * K, op + n0, N);
    }
  });
#endif
  return out;
}

TORCH_LIBRARY_FRAGMENT(spmd_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("bf16_linear_supported(int in_features, int out_features) -> bool",
        &spmd_cpu::bf16_linear_supported);
  m.def("bf16_linear_takes(int rows, int in_features, int out_features) -> bool",
        &spmd_cpu::bf16_linear_takes);
}

TORCH_LIBRARY_IMPL(spmd_cpu, CPU, m) { m.impl("bf16_linear", &spmd_cpu::bf16_linear); }
