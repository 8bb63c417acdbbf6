// Math shared by the project's C++ CPU operators, and the argument checks they share.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>

namespace spmd_cpu {

// Scratch that grows and never zero-fills (std::vector's resize writes every new element): for
// buffers whose elements are written before they are read, such as packed operands and tiles'
// scores. resize keeps the storage where it is large enough; the elements are then stale.
template <class T>
class ScratchArray {
 public:
  void resize(int64_t n) {
    if (n > capacity_) {
      data_.reset(new T[n]);   // default-initialised: left as they are for arithmetic types
      capacity_ = n;
    }
  }
  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  T& operator[](int64_t i) { return data_[i]; }

 private:
  std::unique_ptr<T[]> data_;
  int64_t capacity_ = 0;
};

// exp(x) without a library call: Cephes' expf, range-reduced by
// powers of two, within 2 ulp of std::exp; arguments are clamped to [-87.3, 88.3], where it
// neither underflows to a denormal nor overflows.
inline float exp_vectorisable(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  x -= n * 0.693359375f;
  x -= n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.f;
  return y * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

// The same polynomial on a register of floats, for loops GCC does not vectorise by itself.
#if defined(__AVX512F__)
constexpr int kExpLanes = 16;
using vfloat = __m512;
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vfloat x) { _mm512_storeu_ps(p, x); }
inline vfloat vset(float x) { return _mm512_set1_ps(x); }
inline vfloat vmin(vfloat a, vfloat b) { return _mm512_min_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vdiv(vfloat a, vfloat b) { return _mm512_div_ps(a, b); }
inline vfloat vfloor(vfloat x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline vfloat vpow2(vfloat n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kExpLanes = 8;
using vfloat = __m256;
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vfloat x) { _mm256_storeu_ps(p, x); }
inline vfloat vset(float x) { return _mm256_set1_ps(x); }
inline vfloat vmin(vfloat a, vfloat b) { return _mm256_min_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat vdiv(vfloat a, vfloat b) { return _mm256_div_ps(a, b); }
inline vfloat vfloor(vfloat x) { return _mm256_floor_ps(x); }
inline vfloat vpow2(vfloat n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#else
constexpr int kExpLanes = 0;   // no vector path: callers loop over exp_vectorisable
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
inline vfloat vexp(vfloat x) {
  x = vmin(vmax(x, vset(-87.3f)), vset(88.3f));
  const vfloat n = vfloor(vfma(x, vset(1.44269504088896341f), vset(0.5f)));
  x = vfma(n, vset(-0.693359375f), x);
  x = vfma(n, vset(2.12194440e-4f), x);
  vfloat y = vset(1.9875691500e-4f);
  y = vfma(y, x, vset(1.3981999507e-3f));
  y = vfma(y, x, vset(8.3334519073e-3f));
  y = vfma(y, x, vset(4.1665795894e-2f));
  y = vfma(y, x, vset(1.6666665459e-1f));
  y = vfma(y, x, vset(5.0000001201e-1f));
  y = vadd(vfma(y, vmul(x, x), x), vset(1.f));
  return vmul(y, vpow2(n));
}
#endif

#if defined(__AVX512F__)
constexpr float kLog2e = 1.44269504088896341f;   // exp(x) = 2^(x kLog2e)

// 2^t where float32 within a few ulp is enough (softmax weights and SiLU rounded to bf16):
// 2^round(t) (VSCALEFPS, which underflows to zero by itself) times a degree-5 polynomial for
// 2^f on [-1/2, 1/2] (a Chebyshev fit, within 2.6e-7 relative in float32, as close as vexp's
// Cephes form): about half vexp's instructions, with no clamping.
inline __m512 vexp2(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3400432653725147e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.676037356257439e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550327152013779e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402210682630539e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471824645996e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192092896f));
  return _mm512_scalef_ps(p, n);
}
#endif

// The largest of n scores (attention rows).
inline float row_max(const float* s, int64_t n) {
  float peak = s[0];
  int64_t i = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (n >= kExpLanes) {
    vfloat lanes = vload(s);
    for (i = kExpLanes; i + kExpLanes <= n; i += kExpLanes)
      lanes = vmax(lanes, vload(s + i));
    alignas(64) float spill[kExpLanes];
    vstore(spill, lanes);
    for (float x : spill) peak = std::max(peak, x);
  }
#endif
  for (; i < n; ++i) peak = std::max(peak, s[i]);
  return peak;
}

// exp(s - peak) over a row of n scores in place; returns their sum.
inline float exp_row(float* s, int64_t n, float peak) {
  float total = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const vfloat shift = vset(-peak);
  vfloat sums = vset(0.f);
  for (; i + kExpLanes <= n; i += kExpLanes) {
    const vfloat e = vexp(vadd(vload(s + i), shift));
    vstore(s + i, e);
    sums = vadd(sums, e);
  }
  alignas(64) float spill[kExpLanes];
  vstore(spill, sums);
  for (float x : spill) total += x;
#endif
  for (; i < n; ++i) {
    s[i] = exp_vectorisable(s[i] - peak);
    total += s[i];
  }
  return total;
}

// SiLU(gate) * up of one float, and of one register of them: the step cpu_layers.cpp's row loop
// takes (rows of either storage type), so that both give the same bits for the same float32
// values.
inline float silu_mul_one(float gate, float up) {
  return gate / (1.f + exp_vectorisable(-gate)) * up;
}

#if defined(__AVX512F__)
// SiLU(gate) * up of 16 lanes for rows rounded to bf16: exp through vexp2 and 1 / x through a
// refined reciprocal (their float32 within ~1e-6 of silu_mul_one's), as cpu_layers.cpp's bf16
// rows and the fused gate/up products (cpu_group_quant.cpp) both compute it.
inline __m512 silu_mul_lanes(__m512 gate, __m512 up) {
  // exp(-gate) <= 2^126, so that its reciprocal stays a normal float (inf would make NaN).
  const __m512 sum = _mm512_add_ps(_mm512_set1_ps(1.f), vexp2(_mm512_min_ps(
      _mm512_mul_ps(gate, _mm512_set1_ps(-kLog2e)), _mm512_set1_ps(126.f))));
  __m512 inverse = _mm512_rcp14_ps(sum);   // one Newton step: within ~1e-8
  inverse = _mm512_mul_ps(inverse, _mm512_fnmadd_ps(sum, inverse, _mm512_set1_ps(2.f)));
  return _mm512_mul_ps(_mm512_mul_ps(gate, up), inverse);
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
inline vfloat vsilu_mul(vfloat gate, vfloat up) {
  const vfloat one = vset(1.f);
  const vfloat sig = vdiv(one, vadd(one, vexp(vfma(gate, vset(-1.f), vset(0.f)))));
  return vmul(vmul(gate, sig), up);
}
#endif

// A tensor the operator reads through its data pointer: it must be in CPU memory and strided
// (not a sparse, MKL-DNN or meta tensor). The message names the operator `op` and argument.
inline void check_cpu_tensor(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.layout() == at::kStrided, op, ": ", name, " is a ",
              t.layout(), " tensor on ", t.device(), ", a strided CPU tensor expected");
}

// A tensor of `dim` dimensions that the operator reads through its data pointer.
inline void check_tensor(const char* op, const char* name, const at::Tensor& t, int64_t dim) {
  check_cpu_tensor(t, op, name);
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must be ", dim, "-D, got shape ", t.sizes());
}

// `ref` must be float32 or bfloat16 (the storage types the kernels are built for), `t` the same.
inline void check_dtype(const char* op, const char* name, const at::Tensor& t,
                        const char* ref_name, const at::Tensor& ref) {
  TORCH_CHECK(ref.scalar_type() == at::kFloat || ref.scalar_type() == at::kBFloat16, op, ": ",
              ref_name, " must be float32 or bfloat16, got ", ref.scalar_type());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " is ", t.scalar_type(),
              " but ", ref_name, " is ", ref.scalar_type(),
              ": both must be float32 or both bfloat16");
}

// A windowed decode's first context token per sequence (sequence i attends its tokens
// starts[i] .. lengths[i] - 1): contiguous int32, one per entry of `lengths`.
inline void check_starts(const char* op, const at::Tensor& starts, const at::Tensor& lengths) {
  check_tensor(op, "starts", starts, 1);
  TORCH_CHECK(starts.scalar_type() == at::kInt && starts.is_contiguous(), op,
              ": starts must be contiguous int32, got ", starts.scalar_type());
  TORCH_CHECK(starts.size(0) == lengths.size(0), op, ": starts has ", starts.size(0),
              " entries but lengths has ", lengths.size(0), " (one per sequence)");
}

// Sequence s's start within its context (lengths[s] >= 1 checked before).
inline void check_start(const char* op, int64_t s, int64_t start, int64_t length) {
  TORCH_CHECK(start >= 0 && start < length, op, ": starts[", s, "] = ", start,
              " is outside [0, lengths[", s, "] = ", length, ")");
}

// A prompt chunk of `tokens` at positions position.. against a paged cache [slots, kv_heads,
// dim], key first_key + j in block blocks[j / block_size] (cpu_prefill_attention.cpp): returns
// the blocks its keys reach as int64, each checked to lie in the cache.
at::Tensor check_prompt_table(const char* op, const at::Tensor& k_cache, const at::Tensor& blocks,
                              int64_t block_size, int64_t first_key, int64_t position,
                              int64_t tokens, int64_t window);

}  // namespace spmd_cpu
