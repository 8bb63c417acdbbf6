// Every decoder layer of a float32 decode step in one call (runtime/models/llama.py
// LlamaForCausalLM.forward, the fused decode path): the same operators the Python layer loop
// runs (this library's norms, rotary, KV write, decode attention and SiLU x up; MKL's packed
// GEMM for the projections), in the same order on the same tensors, so the hidden states are
// identical to the bit. What goes is the host time between them: per layer about a dozen
// Python-level operator calls and twenty views (~7 ms of a 64-row step on a 2-core VM) become
// C++ calls through the dispatcher.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace {

using Tensor = at::Tensor;

// Tensors per layer in `weights`: input norm, QKV (packed, stand-in), output projection (packed,
// stand-in), post-attention norm, gate/up (packed, stand-in), down (packed, stand-in).
constexpr size_t kPerLayer = 10;

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

struct Ops {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&,
                                  const std::optional<Tensor>&, int64_t)>
      linear = op<Tensor(const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&,
                         int64_t)>("mkl::_mkl_linear");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rms_norm =
      op<Tensor(const Tensor&, const Tensor&, double)>("spmd_cpu::rms_norm");
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                      double)>
      add_rms_norm = op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                   double)>("spmd_cpu::add_rms_norm");
  c10::TypedOperatorHandle<void(Tensor&, int64_t, int64_t, const Tensor&, const Tensor&)> rotary =
      op<void(Tensor&, int64_t, int64_t, const Tensor&, const Tensor&)>("spmd_cpu::rotary_");
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&)>
      write_kv = op<void(const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&)>(
          "spmd_cpu::write_kv");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, int64_t, double)>
      attention = op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&, int64_t, double)>("spmd_cpu::paged_decode_attention");
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_mul =
      op<Tensor(const Tensor&)>("spmd_cpu::silu_mul");
};

const Ops& ops() {
  static const Ops handles;
  return handles;
}

// x [n, hidden] (the embedded tokens, one per sequence) through every layer; returns the
// hidden states before the final norm. cos and sin: [n, head_dim] rows of the tokens'
// positions; k_caches and v_caches: one [slots, kv_heads, head_dim] pair per layer.
Tensor decode_layers(const Tensor& x_in, at::TensorList weights, at::TensorList k_caches,
                     at::TensorList v_caches, const Tensor& cos, const Tensor& sin,
                     const Tensor& slots, const Tensor& block_tables, const Tensor& lengths,
                     int64_t block_size, double scale, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, double eps) {
  const size_t layers = k_caches.size();
  TORCH_CHECK(weights.size() == layers * kPerLayer && v_caches.size() == layers,
              "decode_layers: ", kPerLayer, " weights and a K and a V cache per layer expected");
  TORCH_CHECK(x_in.dim() == 2 && x_in.is_contiguous() && x_in.scalar_type() == at::kFloat,
              "decode_layers: x [tokens, hidden] float32 expected");
  const Ops& f = ops();
  const int64_t n = x_in.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const std::optional<Tensor> no_bias;
  Tensor x = x_in;
  for (size_t l = 0; l < layers; ++l) {
    const Tensor* w = weights.data() + l * kPerLayer;
    Tensor qkv = f.linear.call(f.rms_norm.call(x, w[0], eps), w[1], w[2], no_bias, n);
    f.rotary.call(qkv, num_heads + num_kv_heads, head_dim, cos, sin);
    const Tensor q = qkv.narrow(1, 0, q_size).view({n, num_heads, head_dim});
    const Tensor k = qkv.narrow(1, q_size, kv_size).view({n, num_kv_heads, head_dim});
    const Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads, head_dim});
    Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    f.write_kv.call(k, v, k_cache, v_cache, slots);
    const Tensor attended = f.attention.call(q, k_cache, v_cache, block_tables, lengths,
                                             block_size, scale);
    const Tensor attention_output = f.linear.call(attended.view({n, q_size}), w[3], w[4],
                                                  no_bias, n);
    auto [residual, normed] = f.add_rms_norm.call(x, attention_output, w[5], eps);
    const Tensor activation = f.silu_mul.call(f.linear.call(normed, w[6], w[7], no_bias, n));
    x = residual.add_(f.linear.call(activation, w[8], w[9], no_bias, n));
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spmd_cpu, m) {
  m.def("decode_layers(Tensor x, Tensor[] weights, Tensor[] k_caches, Tensor[] v_caches, "
        "Tensor cos, Tensor sin, Tensor slots, Tensor block_tables, Tensor lengths, "
        "int block_size, float scale, int num_heads, int num_kv_heads, int head_dim, "
        "float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(spmd_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }
// MKL's packed weights are tensors of the MkldnnCPU backend, which picks the kernel.
TORCH_LIBRARY_IMPL(spmd_cpu, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
