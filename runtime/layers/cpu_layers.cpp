// The element-wise chains of a decoder layer on the CPU (runtime/models/llama.py FUSED_CPU), each
// one pass over its rows instead of a chain of 6-12 torch operators: RMSNorm (with the residual
// add before it), rotary embedding in place on the fused QKV rows, and SiLU(gate) * up. They
// compute the same formulas as the torch chains in float32; sums of squares are added in
// another order and exp is a polynomial within a few ulp, differences at float32 rounding.
//
// Tensors are float32 or bfloat16. The arithmetic is float32 either way: bf16 inputs are widened
// as they are loaded (exactly) and each result is rounded to bf16 once, as it is stored (to
// nearest even, cpu_bf16.h), so a bf16 model gets float32's intermediate precision without a
// float32 copy of its activations. Each kernel is one template over the storage type, and the
// float32 instantiation is the arithmetic these operators always did, bit for bit.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_bf16.h"
#include "cpu_math.h"

namespace {

using spmd_cpu::bf16_bits;
using spmd_cpu::load_as_float;
using spmd_cpu::store_from_float;

// Rows per task: a few thousand floats each, so small decode batches stay on one thread.
constexpr int64_t kRowGrain = 8;

// ---- Argument checks. Each message names the operator, the argument and what was expected.

// A matrix the kernels walk row by row through its row stride, the features of a row adjacent.
void check_rows(const at::Tensor& t, const char* op, const char* name) {
  spmd_cpu::check_cpu_tensor(t, op, name);
  TORCH_CHECK(t.dim() == 2, op, ": ", name, " has ", t.dim(),
              " dimensions, [rows, features] expected");
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, op, ": ", name, " has column stride ",
              t.stride(1), ", rows of adjacent elements (column stride 1) expected");
}

void check_storage(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, op, ": ", name,
              " is ", t.scalar_type(), ", float32 or bfloat16 expected");
}

void check_same_dtype(const at::Tensor& t, const char* name, const at::Tensor& like,
                      const char* like_name, const char* op) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), op, ": ", name, " is ", t.scalar_type(),
              " and ", like_name, " is ", like.scalar_type(), " (one dtype expected)");
}

void check_norm_weight(const at::Tensor& weight, const at::Tensor& x, const char* op) {
  spmd_cpu::check_cpu_tensor(weight, op, "weight");
  check_same_dtype(weight, "weight", x, "x", op);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), op, ": weight has shape ",
              weight.sizes(), " and x ", x.size(1), " features ([features] expected)");
}

// Runs body(T{}) with T the storage type of dtype (checked to be float32 or bfloat16).
template <typename Body>
void with_storage(at::ScalarType dtype, Body&& body) {
  if (dtype == at::kBFloat16) {
    body(bf16_bits{});
  } else {
    body(float{});
  }
}

template <typename T>
T* data(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// ---- Kernels.

// weight * in / rms(in) for one row; `in` is the storage type, or float32 for a sum not yet
// rounded to it. The squares are summed in a register's lanes, then across them (GCC kept the
// plain loop's float sum serial, one FMA's latency an element: ~1 cycle an element at
// SmolLM2's width).
template <typename In, typename T>
inline void normalize_row(const In* in, const T* weight, T* out, int64_t n, float eps) {
  namespace s = spmd_cpu;
  float squares = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  s::vfloat lanes = s::vset(0.f);
  for (; i + s::kExpLanes <= n; i += s::kExpLanes) {
    const s::vfloat v = s::vload_any(in + i);
    lanes = s::vfma(v, v, lanes);
  }
  alignas(64) float spill[s::kExpLanes];
  s::vstore(spill, lanes);
  for (const float part : spill) squares += part;
#endif
  for (; i < n; ++i) {
    const float v = load_as_float(in + i);
    squares += v * v;
  }
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
  i = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const s::vfloat scale = s::vset(inv);
  for (; i + s::kExpLanes <= n; i += s::kExpLanes)
    s::vstore_any(out + i, s::vmul(s::vload_any(weight + i), s::vmul(s::vload_any(in + i), scale)));
#endif
  for (; i < n; ++i)
    store_from_float(out + i, load_as_float(weight + i) * (load_as_float(in + i) * inv));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm", "x");
  check_storage(x, "rms_norm", "x");
  check_norm_weight(weight, x, "rms_norm");
  const int64_t rows = x.size(0), n = x.size(1);
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty({rows, n}, x.options());
  with_storage(x.scalar_type(), [&]<typename T>(T) {
    const T *src = data<T>(x), *wp = data<T>(w);
    T* dst = data<T>(out);
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        normalize_row(src + r * x.stride(0), wp, dst + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

// Rows of x + residual (stored in `sum`) and their norms (in `out`). The sum is the new residual
// stream, so it is stored in the storage type. In bf16 the norm is computed from the float32 sum
// before that rounding, not from the rounded bf16 sum: the more exact value of the two, and the
// one the float32 op normalises (test_bf16_norms_are_float32_norms_rounded_once holds it to
// this). float32 rows normalise their stored sum, which is that value.
template <typename T>
void add_norm_rows(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                   at::Tensor& sum, at::Tensor& out, float eps) {
  const int64_t n = x.size(1);
  const T *a = data<T>(x), *b = data<T>(residual), *wp = data<T>(weight);
  T *s = data<T>(sum), *dst = data<T>(out);
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> unrounded(std::is_same_v<T, float> ? 0 : n);
    for (int64_t r = begin; r < end; ++r) {
      const T *ar = a + r * x.stride(0), *br = b + r * residual.stride(0);
      T* sr = s + r * n;
      float* exact = unrounded.data();
      if constexpr (std::is_same_v<T, float>) exact = sr;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) exact[i] = load_as_float(ar + i) + load_as_float(br + i);
      if constexpr (!std::is_same_v<T, float>) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) store_from_float(sr + i, exact[i]);
      }
      normalize_row(exact, wp, dst + r * n, n, eps);
    }
  });
}

// (x + residual, rms_norm(x + residual)): the sum is a new tensor, both made in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm", "x");
  check_storage(x, "add_rms_norm", "x");
  check_rows(residual, "add_rms_norm", "residual");
  check_same_dtype(residual, "residual", x, "x", "add_rms_norm");
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: x has shape ", x.sizes(),
              " and residual ", residual.sizes(), " (the same shape expected)");
  check_norm_weight(weight, x, "add_rms_norm");
  const at::Tensor w = weight.contiguous();
  at::Tensor sum = at::empty(x.sizes(), x.options());
  at::Tensor out = at::empty(x.sizes(), x.options());
  with_storage(x.scalar_type(), [&]<typename T>(T) {
    add_norm_rows<T>(x, residual, w, sum, out, static_cast<float>(eps));
  });
  return {sum, out};
}

void check_rotary_tables(const at::Tensor& qkv, int64_t head_dim, const at::Tensor& table,
                         const char* name) {
  check_rows(table, "rotary_", name);
  TORCH_CHECK(table.scalar_type() == at::kFloat || table.scalar_type() == qkv.scalar_type(),
              "rotary_: ", name, " is ", table.scalar_type(), " and qkv ", qkv.scalar_type(),
              " (tables in float32 or in qkv's dtype expected)");
  TORCH_CHECK(table.size(0) == qkv.size(0), "rotary_: ", name, " has ", table.size(0),
              " rows, qkv has ", qkv.size(0), " (one table row per token expected)");
  TORCH_CHECK(table.size(1) == head_dim, "rotary_: ", name, " has ", table.size(1),
              " columns and head_dim is ", head_dim, " (a full head_dim row per token expected)");
}

void check_rotary(const at::Tensor& qkv, int64_t rotated_heads, int64_t head_dim,
                  const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(qkv, "rotary_", "qkv");
  check_storage(qkv, "rotary_", "qkv");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "rotary_: head_dim is ", head_dim,
              ", a positive even number expected");
  TORCH_CHECK(rotated_heads >= 0 && rotated_heads <= qkv.size(1) / head_dim, "rotary_: ",
              rotated_heads, " rotated_heads of head_dim ", head_dim, " and qkv has ",
              qkv.size(1), " columns (rotated_heads * head_dim <= columns expected)");
  // Rows are rotated in place by several threads: rows sharing elements would race.
  TORCH_CHECK(qkv.size(0) <= 1 || qkv.stride(0) >= qkv.size(1), "rotary_: qkv rows overlap (row ",
              "stride ", qkv.stride(0), ", ", qkv.size(1), " columns; distinct rows expected)");
  check_rotary_tables(qkv, head_dim, cos, "cos");
  check_rotary_tables(qkv, head_dim, sin, "sin");
  check_same_dtype(sin, "sin", cos, "cos", "rotary_");
}

template <typename T, typename Table>
void rotate_rows(at::Tensor& qkv, int64_t rotated_heads, int64_t head_dim, const at::Tensor& cos,
                 const at::Tensor& sin) {
  const int64_t half = head_dim / 2;
  T* base = data<T>(qkv);
  const Table *cp = data<Table>(cos), *sp = data<Table>(sin);
  at::parallel_for(0, qkv.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const Table* c = cp + t * cos.stride(0);
      const Table* s = sp + t * sin.stride(0);
      for (int64_t h = 0; h < rotated_heads; ++h) {
        T* x = base + t * qkv.stride(0) + h * head_dim;
        int64_t i = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
        namespace v = spmd_cpu;
        for (; i + v::kExpLanes <= half; i += v::kExpLanes) {
          const v::vfloat lo = v::vload_any(x + i), hi = v::vload_any(x + i + half);
          v::vstore_any(x + i, v::vfma(lo, v::vload_any(c + i),
                                       v::vmul(hi, v::vmul(v::vload_any(s + i), v::vset(-1.f)))));
          v::vstore_any(x + i + half, v::vfma(hi, v::vload_any(c + i + half),
                                              v::vmul(lo, v::vload_any(s + i + half))));
        }
#endif
        for (; i < half; ++i) {
          const float lo = load_as_float(x + i), hi = load_as_float(x + i + half);
          store_from_float(x + i, lo * load_as_float(c + i) - hi * load_as_float(s + i));
          store_from_float(x + i + half,
                           hi * load_as_float(c + i + half) + lo * load_as_float(s + i + half));
        }
      }
    }
  });
}

// Rotary embedding (the rotate-half layout) in place on the first `rotated_heads` heads of each
// row of qkv [tokens, heads * head_dim] (the query heads, then the key heads), with cos and sin
// rows [tokens, head_dim] for the tokens' positions. The tables may stay float32 for a bf16 qkv.
void rotary_(at::Tensor& qkv, int64_t rotated_heads, int64_t head_dim, const at::Tensor& cos,
             const at::Tensor& sin) {
  check_rotary(qkv, rotated_heads, head_dim, cos, sin);
  with_storage(qkv.scalar_type(), [&]<typename T>(T) {
    with_storage(cos.scalar_type(), [&]<typename Table>(Table) {
      rotate_rows<T, Table>(qkv, rotated_heads, head_dim, cos, sin);
    });
  });
}

// SiLU(gate) * up over n values of either storage type, a register at a time where there are
// vector registers (the step itself is cpu_math.h's silu_mul_one / vsilu_mul; bf16 rows with
// AVX-512 take vexp2 and a reciprocal instead, 1.6x faster, their float32 within ~1e-6 of it).
template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, bf16_bits>) {   // rounded to bf16: the cheaper exp and 1 / x
    for (; i + 16 <= n; i += 16)
      spmd_cpu::vstore_bf16(out + i, spmd_cpu::silu_mul_lanes(spmd_cpu::vload_bf16(gate + i),
                                                              spmd_cpu::vload_bf16(up + i)));
  }
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  for (; i + spmd_cpu::kExpLanes <= n; i += spmd_cpu::kExpLanes)
    spmd_cpu::vstore_any(out + i, spmd_cpu::vsilu_mul(spmd_cpu::vload_any(gate + i),
                                                      spmd_cpu::vload_any(up + i)));
#endif
  for (; i < n; ++i)
    store_from_float(out + i, spmd_cpu::silu_mul_one(load_as_float(gate + i),
                                                     load_as_float(up + i)));
}

// SiLU(gate) * up for gate_up [tokens, 2 * features] (gate columns first), with the vector exp
// of cpu_math.h (torch's SiLU and product: two passes and a temporary).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul", "gate_up");
  check_storage(gate_up, "silu_mul", "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up has ", gate_up.size(1),
              " columns, an even number (gate columns, then as many up columns) expected");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  with_storage(gate_up.scalar_type(), [&]<typename T>(T) {
    const T* src = data<T>(gate_up);
    T* dst = data<T>(out);
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* gate = src + r * gate_up.stride(0);
        silu_mul_row(gate, gate + n, dst + r * n, n);
      }
    });
  });
  return out;
}

// ---- Greedy tokens: the first index of each row's largest logit, as torch's max reduction
// picks it (the first of equal maxima; the first NaN where a row has one; 0 for a row of -inf).
// torch's reduction takes ~0.4-0.8 ms for 32 x 49,152 logits on 2 cores; two passes over a row
// (its maximum and NaNs, then where they first occur) take a few microseconds.

template <typename scalar_t>
int64_t first_largest(const scalar_t* row, int64_t n) {
  float peak = -INFINITY;
  int64_t i = 0;
  bool nan = false;
#if defined(__AVX512F__)
  __m512 peaks = _mm512_set1_ps(-INFINITY);
  __mmask16 nans = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = spmd_cpu::vload_any(row + i);
    nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    peaks = _mm512_max_ps(peaks, v);
  }
  peak = _mm512_reduce_max_ps(peaks);
  nan = nans != 0;
#endif
  for (; i < n; ++i) {
    const float x = load_as_float(row + i);
    nan = nan || std::isnan(x);
    peak = std::max(peak, x);
  }
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(peak);
  for (; j + 16 <= n; j += 16) {
    const __m512 v = spmd_cpu::vload_any(row + j);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                              : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
    if (hit != 0) return j + __builtin_ctz(hit);
  }
#endif
  for (; j < n; ++j) {
    const float x = load_as_float(row + j);
    if (nan ? std::isnan(x) : x == peak) return j;
  }
  return 0;
}

at::Tensor greedy_tokens(const at::Tensor& logits) {
  constexpr const char* op = "greedy_tokens";
  check_rows(logits, op, "logits");
  check_storage(logits, op, "logits");
  TORCH_CHECK(logits.size(1) >= 1, op, ": logits has no columns");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* out = tokens.mutable_data_ptr<int64_t>();
  const auto run = [&](auto* data) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) out[r] = first_largest(data + r * stride, n);
    });
  };
  if (logits.scalar_type() == at::kBFloat16)
    run(static_cast<const bf16_bits*>(logits.const_data_ptr()));
  else
    run(static_cast<const float*>(logits.const_data_ptr()));
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spmd_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_(Tensor(a!) qkv, int rotated_heads, int head_dim, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("greedy_tokens(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(spmd_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_", &rotary_);
  m.impl("silu_mul", &silu_mul);
  m.impl("greedy_tokens", &greedy_tokens);
}
