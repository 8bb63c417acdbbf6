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
#include <ATen/ops/empty.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_bf16_linear.h"
#include "cpu_math.h"

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
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&)>
      plain_linear = op<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&)>(
          "aten::linear");
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
                                  const Tensor&, int64_t, double, const std::optional<Tensor>&)>
      attention = op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&, int64_t, double, const std::optional<Tensor>&)>(
          "spmd_cpu::paged_decode_attention");
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_mul =
      op<Tensor(const Tensor&)>("spmd_cpu::silu_mul");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, bool)>
      gguf_bf16_linear = op<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, bool)>(
          "spmd_cpu::gguf_bf16_linear");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, int64_t)>
      gguf_linear = op<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, int64_t)>(
          "spmd_cpu::gguf_linear");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, int64_t)> gguf_int8_linear =
      op<Tensor(const Tensor&, const Tensor&, int64_t, int64_t)>("spmd_cpu::gguf_int8_linear");
};

const Ops& ops() {
  static const Ops handles;
  return handles;
}

// oneDNN's linear on a weight it prepacked (mkldnn::_reorder_linear_weight) or a plain one, as
// runtime/layers/linear.py calls it; looked up at its first use only (a torch without oneDNN
// has no such operator, and then no prepacked weights either).
using PointwiseLinear = Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&,
                               c10::string_view, c10::List<std::optional<c10::Scalar>>,
                               std::optional<c10::string_view>);

Tensor onednn_linear(const Tensor& input, const Tensor& weight) {
  static const auto handle = op<PointwiseLinear>("mkldnn::_linear_pointwise");
  return handle.call(input, weight, std::nullopt, "none", c10::List<std::optional<c10::Scalar>>(),
                     std::optional<c10::string_view>(""));
}

// Whether this torch has oneDNN's linear, which linear.py prefers for a plain bf16 weight.
bool onednn_linear_available() {
  static const bool found =
      c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""}).has_value();
  return found;
}

// Every weight slot named in messages, so a refusal says which tensor of which layer is wrong.
std::string slot_name(size_t index) {
  static const char* const kSlots[kPerLayer] = {
      "input norm", "QKV packed", "QKV stand-in", "output packed", "output stand-in",
      "post-attention norm", "gate/up packed", "gate/up stand-in", "down packed", "down stand-in"};
  return c10::str("weights[", index, "] (layer ", index / kPerLayer, " ",
                  kSlots[index % kPerLayer], ")");
}

void check_counts(at::TensorList weights, at::TensorList k_caches, at::TensorList v_caches) {
  TORCH_CHECK(k_caches.size() == v_caches.size(), "decode_layers: ", k_caches.size(),
              " k_caches and ", v_caches.size(), " v_caches (one of each per layer expected)");
  TORCH_CHECK(weights.size() % kPerLayer == 0, "decode_layers: weights has ", weights.size(),
              " tensors, not a multiple of ", kPerLayer, " (", kPerLayer, " per layer expected)");
  TORCH_CHECK(weights.size() == kPerLayer * k_caches.size(), "decode_layers: weights holds ",
              weights.size() / kPerLayer, " layers and k_caches ", k_caches.size(),
              " (the same number of layers expected)");
}

void check_scalars(int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  const std::pair<const char*, int64_t> positive[] = {
      {"block_size", block_size}, {"num_heads", num_heads}, {"num_kv_heads", num_kv_heads},
      {"head_dim", head_dim}};
  for (const auto& [name, value] : positive)
    TORCH_CHECK(value > 0, "decode_layers: ", name, " is ", value, ", a positive number expected");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "decode_layers: num_heads ", num_heads,
              " is not a multiple of num_kv_heads ", num_kv_heads, " (query heads share KV heads)");
  TORCH_CHECK(head_dim % 2 == 0, "decode_layers: head_dim is ", head_dim,
              ", an even number expected (rotary rotates its two halves)");
}

// A sliding window's starts, read against the lengths before any cache is written (the
// attention would only find a bad one after layer 0's KV write).
void check_window(const Tensor& lengths, const std::optional<Tensor>& starts) {
  if (!starts.has_value()) return;
  spmd_cpu::check_starts("decode_layers", *starts, lengths);
  TORCH_CHECK(lengths.scalar_type() == at::kInt && lengths.is_contiguous(),
              "decode_layers: lengths must be contiguous int32, got ", lengths.scalar_type());
  const int32_t* start = starts->const_data_ptr<int32_t>();
  const int32_t* length = lengths.const_data_ptr<int32_t>();
  for (int64_t s = 0; s < lengths.size(0); ++s)
    spmd_cpu::check_start("decode_layers", s, start[s], length[s]);
}

// The per-token inputs: one row per row of x.
void check_tokens(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& slots,
                  const Tensor& block_tables, const Tensor& lengths) {
  spmd_cpu::check_cpu_tensor(x, "decode_layers", "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode_layers: x has shape ", x.sizes(),
              " and strides ", x.strides(), ", a contiguous [tokens, hidden] tensor expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "decode_layers: x is ", x.scalar_type(), ", float32 or bfloat16 expected");
  const std::tuple<const char*, const Tensor&, int64_t> per_token[] = {
      {"cos", cos, 2}, {"sin", sin, 2}, {"slots", slots, 1}, {"block_tables", block_tables, 2},
      {"lengths", lengths, 1}};
  for (const auto& [name, t, dims] : per_token) {
    TORCH_CHECK(t.dim() == dims, "decode_layers: ", name, " has ", t.dim(), " dimensions, ",
                dims, " expected");
    TORCH_CHECK(t.size(0) == x.size(0), "decode_layers: ", name, " has ", t.size(0),
                " rows and x ", x.size(0), " (one per token expected)");
  }
}

// What a layer's tensors must be for x's width and the head counts: norms [hidden] and
// projections [out, in], all in x's dtype. A float32 projection is MKL- or oneDNN-packed, its
// shape read from the stand-in; a bf16 one is oneDNN-packed (its shape read from the stand-in
// too) or the plain weight itself (the stand-in slot is then ignored).
struct LayerShapes {
  int64_t hidden, qkv_out, q_size;
  at::ScalarType dtype;
};

void check_norm(at::TensorList weights, size_t index, const LayerShapes& s) {
  const Tensor& w = weights[index];
  spmd_cpu::check_cpu_tensor(w, "decode_layers", slot_name(index).c_str());
  TORCH_CHECK(w.dim() == 1 && w.size(0) == s.hidden && w.scalar_type() == s.dtype,
              "decode_layers: ", slot_name(index), " is ", w.scalar_type(), " ", w.sizes(),
              ", [", s.hidden, "] in x's dtype ", s.dtype, " expected");
}

// A projection may also be a GGUF file's blocks (uint8 [out, bytes a row], group_quant.py) with
// an int64 [GGML type, in_features] stand-in, multiplied by spmd_cpu::gguf_bf16_linear (bf16) or
// by spmd_cpu::gguf_linear's float32 panels (float32: group_quant.py hands the blocks over only
// at row counts past its integer products); [GGML type, in_features, 1] for 8-bit activations
// (spmd_cpu::gguf_int8_linear, `--quantization int8`), in either dtype.
bool gguf_blocks(const Tensor& weight) { return weight.scalar_type() == at::kByte; }

// A GGUF projection's [out, in] from its blocks and stand-in.
std::pair<int64_t, int64_t> gguf_shape(at::TensorList weights, size_t index) {
  const Tensor& blocks = weights[index];
  const Tensor& info = weights[index + 1];
  TORCH_CHECK(blocks.dim() == 2 && info.scalar_type() == at::kLong && info.dim() == 1 &&
                  (info.numel() == 2 || info.numel() == 3) && info.device().is_cpu(),
              "decode_layers: ", slot_name(index + 1), " is a ", info.scalar_type(), " ",
              info.sizes(), " tensor beside the GGUF blocks ", blocks.sizes(), " of ",
              slot_name(index), ", an int64 [GGML type, in_features(, int8 activations)] "
              "expected");
  return {blocks.size(0), info.const_data_ptr<int64_t>()[1]};
}

// The slot holding a projection's [out, in] shape: a packed weight's stand-in (packed weights
// are opaque), a plain bf16 weight itself.
size_t shape_slot(at::TensorList weights, size_t index, at::ScalarType dtype) {
  return dtype == at::kFloat || weights[index].is_mkldnn() ? index + 1 : index;
}

// A projection's rows (output features); 0 where its shape is not one.
int64_t projection_rows(at::TensorList weights, size_t index, at::ScalarType dtype) {
  if (gguf_blocks(weights[index])) return gguf_shape(weights, index).first;
  const Tensor& shaped = weights[shape_slot(weights, index, dtype)];
  return shaped.dim() == 2 ? shaped.size(0) : 0;
}

void check_projection(at::TensorList weights, size_t index, const LayerShapes& s, int64_t out,
                      int64_t in) {
  if (gguf_blocks(weights[index])) {
    // The blocks' bytes and type are the operator's to check, at its call.
    spmd_cpu::check_cpu_tensor(weights[index], "decode_layers", slot_name(index).c_str());
    const auto [rows, columns] = gguf_shape(weights, index);
    TORCH_CHECK(rows == out && columns == in, "decode_layers: ", slot_name(index), " holds GGUF "
                "blocks of a [", rows, ", ", columns, "] weight, [", out, ", ", in, "] expected");
    return;
  }
  const size_t shape_index = shape_slot(weights, index, s.dtype);
  const Tensor& shaped = weights[shape_index];
  const std::string name = slot_name(shape_index);
  spmd_cpu::check_cpu_tensor(shaped, "decode_layers", name.c_str());
  TORCH_CHECK(shaped.scalar_type() == s.dtype && shaped.dim() == 2 && shaped.size(0) == out &&
                  shaped.size(1) == in,
              "decode_layers: ", name, " is a ", shaped.scalar_type(), " ", shaped.sizes(),
              " tensor, a [", out, ", ", in, "] weight in x's dtype ", s.dtype, " expected");
  const Tensor& packed = weights[index];
  TORCH_CHECK(s.dtype != at::kFloat || (packed.is_mkldnn() && packed.scalar_type() == at::kFloat &&
                                        packed.numel() >= shaped.numel()),
              "decode_layers: ", slot_name(index), " is not a float32 weight packed by ",
              "mkl::_mkl_reorder_linear_weight or mkldnn::_reorder_linear_weight for its [", out,
              ", ", in, "] stand-in");
  TORCH_CHECK(s.dtype == at::kFloat || !packed.is_mkldnn() ||
                  (packed.scalar_type() == s.dtype && packed.numel() == shaped.numel()),
              "decode_layers: ", slot_name(index), " is not a ", s.dtype, " weight packed by ",
              "mkldnn::_reorder_linear_weight for its [", out, ", ", in, "] stand-in");
}

void check_layer(at::TensorList weights, size_t layer, const LayerShapes& s) {
  const size_t base = layer * kPerLayer;
  check_norm(weights, base, s);
  check_norm(weights, base + 5, s);
  check_projection(weights, base + 1, s, s.qkv_out, s.hidden);
  check_projection(weights, base + 3, s, s.hidden, s.q_size);
  // The intermediate size is the gate/up weight's: its rows are the gate's, then the up's.
  const int64_t gate_up_rows = projection_rows(weights, base + 6, s.dtype);
  TORCH_CHECK(gate_up_rows > 0 && gate_up_rows % 2 == 0, "decode_layers: ",
              slot_name(shape_slot(weights, base + 6, s.dtype)), " has ", gate_up_rows,
              " rows, [2 * intermediate, hidden] expected");
  check_projection(weights, base + 6, s, gate_up_rows, s.hidden);
  check_projection(weights, base + 8, s, s.hidden, gate_up_rows / 2);
}

void check_caches(at::TensorList caches, const char* name, int64_t kv_heads, int64_t head_dim) {
  for (size_t l = 0; l < caches.size(); ++l)
    TORCH_CHECK(caches[l].dim() == 3 && caches[l].size(1) == kv_heads &&
                    caches[l].size(2) == head_dim,
                "decode_layers: ", name, "[", l, "] has shape ", caches[l].sizes(),
                ", [slots, ", kv_heads, ", ", head_dim, "] (num_kv_heads, head_dim) expected");
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
  check_counts(weights, k_caches, v_caches);
  check_scalars(block_size, num_heads, num_kv_heads, head_dim);
  check_tokens(x_in, cos, sin, slots, block_tables, lengths);
  check_window(lengths, starts);
  check_caches(k_caches, "k_caches", num_kv_heads, head_dim);
  check_caches(v_caches, "v_caches", num_kv_heads, head_dim);
  const int64_t n = x_in.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const LayerShapes shapes{x_in.size(1), q_size + 2 * kv_size, q_size, x_in.scalar_type()};
  for (size_t l = 0; l < k_caches.size(); ++l) check_layer(weights, l, shapes);
  const Ops& f = ops();
  const bool plain = x_in.scalar_type() != at::kFloat;
  const std::optional<Tensor> no_bias;
  // GGUF blocks in either dtype; float32 weights otherwise MKL-packed (an opaque buffer) or
  // oneDNN-packed (shaped as the weight); bf16 ones oneDNN-packed or plain [out, in] tensors,
  // which the layer loop (linear.py) gives the bf16 tiles at decode row counts and oneDNN's
  // linear otherwise.
  const auto project = [&](const Tensor& input, const Tensor* w) {
    if (gguf_blocks(w[0])) {
      const int64_t* info = w[1].const_data_ptr<int64_t>();
      if (w[1].numel() == 3 && info[2] == 1)
        return f.gguf_int8_linear.call(input.contiguous(), w[0], info[0], info[1]);
      return plain ? f.gguf_bf16_linear.call(input.contiguous(), w[0], info[0], info[1], false)
                   : f.gguf_linear.call(input.contiguous(), w[0], info[0], info[1], 0);
    }
    if (!plain && w[0].sizes() != w[1].sizes())
      return f.linear.call(input, w[0], w[1], no_bias, n);
    if (w[0].is_mkldnn()) return onednn_linear(input, w[0]);
    if (spmd_cpu::bf16_linear_takes(n, w[0].size(1), w[0].size(0)))
      return spmd_cpu::bf16_linear(input.contiguous(), w[0]);
    return onednn_linear_available() ? onednn_linear(input, w[0])
                                     : f.plain_linear.call(input, w[0], no_bias);
  };
  Tensor x = x_in;
  for (size_t l = 0; l < k_caches.size(); ++l) {
    const Tensor* w = weights.data() + l * kPerLayer;
    Tensor qkv = project(f.rms_norm.call(x, w[0], eps), w + 1);
    f.rotary.call(qkv, num_heads + num_kv_heads, head_dim, cos, sin);
    const Tensor q = qkv.narrow(1, 0, q_size).view({n, num_heads, head_dim});
    const Tensor k = qkv.narrow(1, q_size, kv_size).view({n, num_kv_heads, head_dim});
    const Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads, head_dim});
    Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    f.write_kv.call(k, v, k_cache, v_cache, slots);
    const Tensor attended = f.attention.call(q, k_cache, v_cache, block_tables, lengths,
                                             block_size, scale, starts);
    const Tensor attention_output = project(attended.view({n, q_size}), w + 3);
    auto [residual, normed] = f.add_rms_norm.call(x, attention_output, w[5], eps);
    const Tensor activation = f.silu_mul.call(project(normed, w + 6));
    x = residual.add_(project(activation, w + 8));
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
