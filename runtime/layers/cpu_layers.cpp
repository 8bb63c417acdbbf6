// The element-wise chains of a float32 decoder layer on the CPU (runtime/models/llama.py FUSED_CPU), each
// one pass over its rows instead of a chain of 6-12 torch operators: RMSNorm (with the residual
// add before it), rotary embedding in place on the fused QKV rows, and SiLU(gate) * up. They
// compute the same formulas as the torch chains in float32; sums of squares are added in
// another order and exp is a polynomial within a few ulp, differences at float32 rounding.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "cpu_math.h"

namespace {

// Rows per task: a few thousand floats each, so small decode batches stay on one thread.
constexpr int64_t kRowGrain = 8;

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              name, ": [rows, features] float32 with contiguous rows expected");
}

inline void normalize_row(const float* in, const float* weight, float* out, int64_t n, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += in[i] * in[i];
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (in[i] * inv);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  const int64_t rows = x.size(0), n = x.size(1);
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty({rows, n}, x.options());
  const float *src = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      normalize_row(src + r * x.stride(0), wp, dst + r * n, n, static_cast<float>(eps));
  });
  return out;
}

// (x + residual, rms_norm(x + residual)): the sum is a new tensor, both made in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm");
  check_rows(residual, "add_rms_norm");
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: x and residual differ in shape");
  const int64_t rows = x.size(0), n = x.size(1);
  const at::Tensor w = weight.contiguous();
  at::Tensor sum = at::empty({rows, n}, x.options());
  at::Tensor out = at::empty({rows, n}, x.options());
  const float *a = x.data_ptr<float>(), *b = residual.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *s = sum.data_ptr<float>(), *dst = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *ar = a + r * x.stride(0), *br = b + r * residual.stride(0);
      float* sr = s + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) sr[i] = ar[i] + br[i];
      normalize_row(sr, wp, dst + r * n, n, static_cast<float>(eps));
    }
  });
  return {sum, out};
}

// Rotary embedding (the rotate-half layout) in place on the first `rotated_heads` heads of each
// row of qkv [tokens, heads * head_dim] (the query heads, then the key heads), with cos and sin
// rows [tokens, head_dim] for the tokens' positions.
void rotary_(at::Tensor& qkv, int64_t rotated_heads, int64_t head_dim, const at::Tensor& cos,
             const at::Tensor& sin) {
  check_rows(qkv, "rotary_");
  check_rows(cos, "rotary_");
  check_rows(sin, "rotary_");
  TORCH_CHECK(cos.size(0) == qkv.size(0) && sin.size(0) == qkv.size(0) &&
                  cos.size(1) == head_dim && sin.size(1) == head_dim && head_dim % 2 == 0,
              "rotary_: cos and sin [tokens, head_dim] expected");
  TORCH_CHECK(rotated_heads * head_dim <= qkv.size(1), "rotary_: more heads than the rows hold");
  const int64_t half = head_dim / 2;
  float* base = qkv.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  at::parallel_for(0, qkv.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * cos.stride(0);
      const float* s = sp + t * sin.stride(0);
      for (int64_t h = 0; h < rotated_heads; ++h) {
        float* x = base + t * qkv.stride(0) + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float lo = x[i], hi = x[i + half];
          x[i] = lo * c[i] - hi * s[i];
          x[i + half] = hi * c[i + half] + lo * s[i + half];
        }
      }
    }
  });
}

// SiLU(gate) * up for gate_up [tokens, 2 * features] (gate columns first), with the vector exp
// of cpu_math.h (torch's SiLU and product: two passes and a temporary).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: an even number of columns expected");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = src + r * gate_up.stride(0);
      spmd_cpu::silu_mul_row(gate, gate + n, dst + r * n, n);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spmd_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_(Tensor(a!) qkv, int rotated_heads, int head_dim, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(spmd_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_", &rotary_);
  m.impl("silu_mul", &silu_mul);
}
