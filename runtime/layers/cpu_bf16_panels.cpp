// bfloat16 projections on weights packed once at load, in the library's own layout: panels of
// 32 output features stored as [pair of in_features][feature] 32-bit words (cpu_bf16_gemm.h),
// so that every row count, a decode row to a prompt's thousands, runs the register tiles of
// 12 rows x 32 features (fewer rows: the same tiles, shorter) with float32 sums that never cross
// lanes. oneDNN's prepacked bf16 product is opaque (no address to fetch ahead, no epilogue of
// ours) and was the slower one on SmolLM2's four shapes on 2 Zen 5 cores at 1-32 rows, 24
// layers' distinct weights in turn (bench/bf16_panels_ab.py): the panels took 0.69-0.96x its
// time, 0.98-1.02x at 512 rows. Wider inputs stay with oneDNN (bf16_panels.py).
//
// Panel p holds output features 16p .. 16p + 15 and N/2 + 16p .. N/2 + 16p + 15 (its low and
// high register): for a fused gate/up weight (gate rows first) a panel's two halves are a gate
// and its up, so SiLU x up runs in the tile's epilogue; a plain product stores each half where
// it belongs. Each output is one float32 sum in one order whatever the row count or the
// epilogue, so a row's product does not depend on the rows batched with it.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cpu_bf16.h"
#include "cpu_bf16_gemm.h"
#include "cpu_bf16_panels.h"
#include "cpu_math.h"

namespace {

using spmd_cpu::bf16_bits;

constexpr int64_t kPanel = 32;   // output features of a panel

void check_shape(const char* op, int64_t out, int64_t in) {
  TORCH_CHECK(spmd_cpu::bf16_panels_supported(in, out), op, ": runs where the build has "
              "AVX512-BF16 and the weight's in_features and out_features are positive multiples "
              "of 32 (ask bf16_panels_supported), got [", out, ", ", in, "]");
}

// x [M, K] and a packed weight with its [N, K] stand-in, as every product takes them.
void check_product(const char* op, const at::Tensor& x, const at::Tensor& panels,
                   const at::Tensor& stand_in) {
  spmd_cpu::check_tensor(op, "x", x, 2);
  spmd_cpu::check_tensor(op, "panels", panels, 2);
  spmd_cpu::check_tensor(op, "stand_in", stand_in, 2);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous(), op,
              ": x must be a contiguous bfloat16 tensor, got ", x.scalar_type());
  TORCH_CHECK(stand_in.scalar_type() == at::kBFloat16, op, ": stand_in must be bfloat16 (the "
              "weight's [out, in] shape), got ", stand_in.scalar_type());
  const int64_t N = stand_in.size(0), K = stand_in.size(1);
  check_shape(op, N, K);
  TORCH_CHECK(spmd_cpu::is_bf16_panels(panels) && panels.is_contiguous() &&
                  spmd_cpu::bf16_panels_fit(panels, N, K),
              op, ": panels must be the contiguous int32 [", N / kPanel, ", ", K * kPanel / 2,
              "] that bf16_panels_pack makes of a [", N, ", ", K, "] weight, got ",
              panels.scalar_type(), " ", panels.sizes());
  TORCH_CHECK(x.size(1) == K, op, ": x has ", x.size(1), " features, the weight takes ", K);
}

#if defined(__AVX512BF16__)
// From kBlockedFrom rows on, each thread takes the rows kRowBlock at a time (21 register tiles),
// all its panels against one block before the next, so that the block of x stays in its core's
// L2 (252 x 1,536 bf16 = 756 KiB) while its panels stream past. Taken whole, a prompt step's x
// (4,096 x 576 to 4,096 x 1,536 bf16, 4.5-12 MiB) is read from L3 or memory once a panel. On 2
// Zen 5 cores, SmolLM2's four projections at 4,096 rows ran at 830-920 GFLOP/s whole, 930-980 in
// blocks; at 1,024 rows the step took 0.98x the time; at 512 rows blocks took 1.01x the time,
// so a 512-token prompt runs whole. Blocks change no sum: each output is the same one
// float32 sum in the same order.
constexpr int64_t kRowBlock = 21 * spmd_cpu::kGemmRows, kBlockedFrom = 768;

// Every row of x against every panel, the panels split between the threads: done(row, panel,
// low sums, high sums).
template <class Done>
void each_panel(const at::Tensor& x, const at::Tensor& panels, Done&& done) {
  const int64_t M = x.size(0), K = x.size(1), words = K * kPanel / 2;
  const int64_t block = M >= kBlockedFrom ? kRowBlock : M;
  const auto* xp = static_cast<const bf16_bits*>(x.const_data_ptr());
  const auto* w = reinterpret_cast<const uint32_t*>(panels.const_data_ptr<int32_t>());
  at::parallel_for(0, panels.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < M; r0 += block) {
      const int64_t rows = std::min(block, M - r0);
      for (int64_t p = begin; p < end; ++p)
        spmd_cpu::gemm_panel_rows(
            xp + r0 * K, rows, K, w + p * words,
            [&](int64_t r, __m512 low, __m512 high) { done(r0 + r, p, low, high); });
    }
  });
}

inline void store_half(bf16_bits* dst, __m512 sums) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(sums));
}
#endif

// weight [N, K] bf16 -> its panels, int32 [N / 32, K * 16].
at::Tensor pack(const at::Tensor& weight) {
  constexpr const char* op = "bf16_panels_pack";
  spmd_cpu::check_tensor(op, "weight", weight, 2);
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, op, ": weight must be bfloat16, got ",
              weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1);
  check_shape(op, N, K);
  const at::Tensor w = weight.contiguous();
  at::Tensor panels = at::empty({N / kPanel, K * kPanel / 2}, w.options().dtype(at::kInt));
#if defined(__AVX512BF16__)
  const auto* src = static_cast<const bf16_bits*>(w.const_data_ptr());
  auto* dst = reinterpret_cast<uint32_t*>(panels.data_ptr<int32_t>());
  at::parallel_for(0, N / kPanel, 1, [&](int64_t begin, int64_t end) {
    std::vector<bf16_bits> rows(kPanel * K);
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < kPanel; ++j)
        std::copy_n(src + spmd_cpu::gated_panel_feature(p, j, N / 2) * K, K,
                    rows.data() + j * K);
      spmd_cpu::pack_gemm_panel(rows.data(), K, dst + p * panels.size(1));
    }
  });
#endif
  return panels;
}

}  // namespace

namespace spmd_cpu {

bool bf16_panels_supported(int64_t in_features, int64_t out_features) {
#if defined(__AVX512BF16__)
  return in_features > 0 && out_features > 0 && in_features % kPanel == 0 &&
         out_features % kPanel == 0;
#else
  (void)in_features;
  (void)out_features;
  return false;
#endif
}

at::Tensor bf16_panels_linear(const at::Tensor& x, const at::Tensor& panels,
                              const at::Tensor& stand_in) {
  check_product("bf16_panels_linear", x, panels, stand_in);
  const int64_t N = stand_in.size(0);
  at::Tensor out = at::empty({x.size(0), N}, x.options());
#if defined(__AVX512BF16__)
  auto* o = static_cast<bf16_bits*>(out.mutable_data_ptr());
  each_panel(x, panels, [&](int64_t r, int64_t p, __m512 low, __m512 high) {
    store_half(o + r * N + 16 * p, low);
    store_half(o + r * N + N / 2 + 16 * p, high);
  });
#endif
  return out;
}

at::Tensor bf16_panels_residual_linear(const at::Tensor& x, const at::Tensor& panels,
                                       const at::Tensor& stand_in, const at::Tensor& residual) {
  constexpr const char* op = "bf16_panels_residual_linear";
  check_product(op, x, panels, stand_in);
  const int64_t M = x.size(0), N = stand_in.size(0);
  spmd_cpu::check_tensor(op, "residual", residual, 2);
  TORCH_CHECK(residual.scalar_type() == at::kBFloat16 && residual.is_contiguous() &&
                  residual.size(0) == M && residual.size(1) == N,
              op, ": residual must be a contiguous bfloat16 [", M, ", ", N, "] tensor, got ",
              residual.scalar_type(), " ", residual.sizes());
  at::Tensor out = at::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
  auto* o = static_cast<bf16_bits*>(out.mutable_data_ptr());
  const auto* add = static_cast<const bf16_bits*>(residual.const_data_ptr());
  each_panel(x, panels, [&](int64_t r, int64_t p, __m512 low, __m512 high) {
    const int64_t at = r * N + 16 * p;
    store_half(o + at, spmd_cpu::plus_rounded(low, add + at));
    store_half(o + at + N / 2, spmd_cpu::plus_rounded(high, add + at + N / 2));
  });
#endif
  return out;
}

at::Tensor bf16_panels_silu_linear(const at::Tensor& x, const at::Tensor& panels,
                                   const at::Tensor& stand_in) {
  check_product("bf16_panels_silu_linear", x, panels, stand_in);
  const int64_t half = stand_in.size(0) / 2;
  at::Tensor out = at::empty({x.size(0), half}, x.options());
#if defined(__AVX512BF16__)
  auto* o = static_cast<bf16_bits*>(out.mutable_data_ptr());
  each_panel(x, panels, [&](int64_t r, int64_t p, __m512 gate, __m512 up) {
    spmd_cpu::vstore_bf16(o + r * half + 16 * p, spmd_cpu::silu_mul_rounded(gate, up));
  });
#endif
  return out;
}

}  // namespace spmd_cpu

TORCH_LIBRARY_FRAGMENT(spmd_cpu, m) {
  m.def("bf16_panels_pack(Tensor weight) -> Tensor");
  m.def("bf16_panels_linear(Tensor x, Tensor panels, Tensor stand_in) -> Tensor");
  m.def("bf16_panels_residual_linear(Tensor x, Tensor panels, Tensor stand_in, "
        "Tensor residual) -> Tensor");
  m.def("bf16_panels_silu_linear(Tensor x, Tensor panels, Tensor stand_in) -> Tensor");
  m.def("bf16_panels_supported(int in_features, int out_features) -> bool",
        &spmd_cpu::bf16_panels_supported);
}

TORCH_LIBRARY_IMPL(spmd_cpu, CPU, m) {
  m.impl("bf16_panels_pack", &pack);
  m.impl("bf16_panels_linear", &spmd_cpu::bf16_panels_linear);
  m.impl("bf16_panels_residual_linear", &spmd_cpu::bf16_panels_residual_linear);
  m.impl("bf16_panels_silu_linear", &spmd_cpu::bf16_panels_silu_linear);
}
