// Every decoder layer of a decode step in one call (runtime/models/llama.py
// LlamaForCausalLM.forward, the fused decode path): the same operators the Python layer loop
// runs (this library's norms, rotary, KV write, decode attention and SiLU x up; MKL's or
// oneDNN's packed GEMM for float32 projections, oneDNN's linear for bfloat16 ones, prepacked or
// plain, this library's bf16 tiles where the loop takes them, its GGUF bf16 products), in the
// same order on the same tensors, so the hidden states are identical to the bit.
// What goes is the host time between them: per layer about a dozen Python-level operator calls
// and twenty views (~7 ms of a 64-row step on a 2-core VM) become C++ calls through the
// dispatcher.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_layer_stack.h"
#include "cpu_math.h"

namespace {

using namespace spmd_cpu::layer_stack;

constexpr const char* kOp = "decode_layers";

// A sliding window's starts, read against the lengths before any cache is written (the
// attention would only find a bad one after layer 0's KV write).
void check_window(const Tensor& lengths, const std::optional<Tensor>& starts) {
  if (!starts.has_value()) return;
  spmd_cpu::check_starts(kOp, *starts, lengths);
  TORCH_CHECK(lengths.scalar_type() == at::kInt && lengths.is_contiguous(),
              kOp, ": lengths must be contiguous int32, got ", lengths.scalar_type());
  const int32_t* start = starts->const_data_ptr<int32_t>();
  const int32_t* length = lengths.const_data_ptr<int32_t>();
  for (int64_t s = 0; s < lengths.size(0); ++s)
    spmd_cpu::check_start(kOp, s, start[s], length[s]);
}

// x [n, hidden] (the embedded tokens, one per sequence) through every layer; returns the
// hidden states before the final norm. cos and sin: [n, head_dim] rows of the tokens'
// positions; k_caches and v_caches: one [slots, kv_heads, head_dim] pair per layer. What this
// operator interprets itself (counts, scalars, rows, every layer's weights) is checked before
// the first layer runs, so no cache is half written for a malformed layer list; the KV write and
// the attention check their own arguments. starts: none, or each sequence's first attended
// context token, the same for every layer (a model whose layers share one sliding window).
Tensor decode_layers(const Tensor& x_in, at::TensorList weights, at::TensorList k_caches,
                     at::TensorList v_caches, const Tensor& cos, const Tensor& sin,
                     const Tensor& slots, const Tensor& block_tables, const Tensor& lengths,
                     int64_t block_size, double scale, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, double eps, const std::optional<Tensor>& starts) {
  check_counts(kOp, weights, k_caches, v_caches);
  check_scalars(kOp, block_size, num_heads, num_kv_heads, head_dim);
  check_tokens(kOp, x_in, {{"cos", cos, 2}, {"sin", sin, 2}, {"slots", slots, 1},
                           {"block_tables", block_tables, 2}, {"lengths", lengths, 1}});
  check_window(lengths, starts);
  check_caches(kOp, k_caches, "k_caches", num_kv_heads, head_dim);
  check_caches(kOp, v_caches, "v_caches", num_kv_heads, head_dim);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const LayerShapes shapes{x_in.size(1), q_size + 2 * kv_size, q_size, x_in.scalar_type()};
  for (size_t l = 0; l < k_caches.size(); ++l) check_layer(kOp, weights, l, shapes);
  const Ops& f = ops();
  const Heads heads{num_heads, num_kv_heads, head_dim};
  const TokenTables tables{cos, sin, slots};
  Tensor x = x_in;
  for (size_t l = 0; l < k_caches.size(); ++l) {
    const Tensor* w = weights.data() + l * kPerLayer;
    Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    const Attending a = attention_inputs(x, w, eps, heads, tables, k_cache, v_cache);
    const Tensor attended = f.attention.call(a.q, k_cache, v_cache, block_tables, lengths,
                                             block_size, scale, starts);
    x = finish_layer(kOp, x, attended, weights, l, eps, heads, Epilogues{});
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spmd_cpu, m) {
  m.def("decode_layers(Tensor x, Tensor[] weights, Tensor[] k_caches, Tensor[] v_caches, "
        "Tensor cos, Tensor sin, Tensor slots, Tensor block_tables, Tensor lengths, "
        "int block_size, float scale, int num_heads, int num_kv_heads, int head_dim, "
        "float eps, Tensor? starts=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(spmd_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }
// MKL's packed weights are tensors of the MkldnnCPU backend, which picks the kernel.
TORCH_LIBRARY_IMPL(spmd_cpu, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
