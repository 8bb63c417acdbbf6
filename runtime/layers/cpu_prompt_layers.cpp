// All but the last decoder layer of a lone prompt in one call (runtime/models/llama.py
// LlamaForCausalLM.forward, the fused prompt path): the operators the Python layer loop runs for
// a step whose rows are one prompt chunk (its norms, rotary and KV write; the prompt attention,
// fresh or over the chunk's cached context; the projections as linear.py multiplies that many
// rows, with SiLU x up and the residual in the GGUF bf16 products' epilogues where the loop puts
// them there), in the same order on the same tensors, so the hidden states are identical to the
// bit. The last layer stays in the loop: it projects and runs its MLP for the sampled rows only.
// What goes is the host time between the operators: ~2 ms of Python a step on a 2-core VM,
// 1.5% of a 512-token SmolLM2 prompt.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_layer_stack.h"
#include "cpu_math.h"

namespace {

using namespace spmd_cpu::layer_stack;

constexpr const char* kOp = "prompt_layers";

// x [n, hidden] (the chunk's embedded tokens, at positions position .. position + n - 1)
// through every layer given; returns their output. cos, sin and slots as decode_layers';
// context_blocks: none for a fresh prompt (position 0, its keys all in this chunk), or the
// chunk's block table (key first_key + j in block context_blocks[j / block_size]) when earlier
// tokens are cached. window: 0, or the sliding window every layer attends within.
// silu_in_product and residual_in_product: whether every layer's gate/up and down projections
// take the GGUF bf16 kernels' epilogues (both slots then GGUF blocks). Counts, scalars, rows,
// every layer's weights and the block table are checked before the first layer runs, so no
// cache is half written for a malformed argument.
Tensor prompt_layers(const Tensor& x_in, at::TensorList weights, at::TensorList k_caches,
                     at::TensorList v_caches, const Tensor& cos, const Tensor& sin,
                     const Tensor& slots, const std::optional<Tensor>& context_blocks,
                     int64_t first_key, int64_t position, int64_t block_size, double scale,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                     int64_t window, bool silu_in_product, bool residual_in_product) {
  check_counts(kOp, weights, k_caches, v_caches);
  check_scalars(kOp, block_size, num_heads, num_kv_heads, head_dim);
  check_tokens(kOp, x_in, {{"cos", cos, 2}, {"sin", sin, 2}, {"slots", slots, 1}});
  check_caches(kOp, k_caches, "k_caches", num_kv_heads, head_dim);
  check_caches(kOp, v_caches, "v_caches", num_kv_heads, head_dim);
  TORCH_CHECK(window >= 0, kOp, ": window ", window, " must be >= 0 (0: no window)");
  const Heads heads{num_heads, num_kv_heads, head_dim};
  const LayerShapes shapes{x_in.size(1), heads.q_size() + 2 * heads.kv_size(), heads.q_size(),
                           x_in.scalar_type()};
  for (size_t l = 0; l < k_caches.size(); ++l) {
    check_layer(kOp, weights, l, shapes);
    if (silu_in_product) epilogue_blocks(kOp, weights, l * kPerLayer + 6);
    if (residual_in_product) epilogue_blocks(kOp, weights, l * kPerLayer + 8);
  }
  if (context_blocks.has_value()) {
    for (const Tensor& cache : k_caches)
      spmd_cpu::check_prompt_table(kOp, cache, *context_blocks, block_size, first_key, position,
                                   x_in.size(0), window);
  } else {
    TORCH_CHECK(position == 0 && first_key == 0, kOp, ": a fresh prompt (no context_blocks) "
                "starts at position 0 and first_key 0, got ", position, " and ", first_key);
  }
  const Ops& f = ops();
  const TokenTables tables{cos, sin, slots};
  const Epilogues epilogues{silu_in_product, residual_in_product};
  Tensor x = x_in;
  for (size_t l = 0; l < k_caches.size(); ++l) {
    Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    const Attending a =
        attention_inputs(x, weights.data() + l * kPerLayer, eps, heads, tables, k_cache, v_cache);
    const Tensor attended =
        context_blocks.has_value()
            ? f.prefill_paged.call(a.q, k_cache, v_cache, *context_blocks, block_size, first_key,
                                   position, scale, window)
            : f.prefill.call(a.q, a.k, a.v, scale, window);
    x = finish_layer(kOp, x, attended, weights, l, eps, heads, epilogues);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spmd_cpu, m) {
  m.def("prompt_layers(Tensor x, Tensor[] weights, Tensor[] k_caches, Tensor[] v_caches, "
        "Tensor cos, Tensor sin, Tensor slots, Tensor? context_blocks, int first_key, "
        "int position, int block_size, float scale, int num_heads, int num_kv_heads, "
        "int head_dim, float eps, int window, bool silu_in_product, "
        "bool residual_in_product) -> Tensor");
}

TORCH_LIBRARY_IMPL(spmd_cpu, CPU, m) { m.impl("prompt_layers", &prompt_layers); }
// MKL's packed weights are tensors of the MkldnnCPU backend, which picks the kernel.
TORCH_LIBRARY_IMPL(spmd_cpu, MkldnnCPU, m) { m.impl("prompt_layers", &prompt_layers); }
