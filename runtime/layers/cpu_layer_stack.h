// What the one-call layer stacks share (cpu_decode_layers.cpp: every layer of a decode step;
// cpu_prompt_layers.cpp: all but the last layer of a lone prompt): the operators they call
// through the dispatcher, a layer's ten weight slots and their checks, and the product of rows
// with a projection's slot pair as runtime/layers/linear.py multiplies them at that row count.
// `who` names the calling operator in every message.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "cpu_bf16_linear.h"
#include "cpu_bf16_panels.h"
#include "cpu_math.h"

namespace spmd_cpu::layer_stack {

using Tensor = at::Tensor;

// Tensors per layer in `weights`: input norm, QKV (packed, stand-in), output projection (packed,
// stand-in), post-attention norm, gate/up (packed, stand-in), down (packed, stand-in).
constexpr size_t kPerLayer = 10;

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using Linear = Tensor(const Tensor&, const Tensor&, int64_t, int64_t);

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
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, double, int64_t)>
      prefill = op<Tensor(const Tensor&, const Tensor&, const Tensor&, double, int64_t)>(
          "spmd_cpu::prefill_attention");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  int64_t, int64_t, int64_t, double, int64_t)>
      prefill_paged = op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                int64_t, int64_t, int64_t, double, int64_t)>(
          "spmd_cpu::prefill_attention_paged");
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_mul =
      op<Tensor(const Tensor&)>("spmd_cpu::silu_mul");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, bool)>
      gguf_bf16_linear = op<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, bool)>(
          "spmd_cpu::gguf_bf16_linear");
  c10::TypedOperatorHandle<Linear> gguf_bf16_silu_linear =
      op<Linear>("spmd_cpu::gguf_bf16_silu_linear");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, const Tensor&)>
      gguf_bf16_residual_linear =
          op<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, const Tensor&)>(
              "spmd_cpu::gguf_bf16_residual_linear");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, int64_t)>
      gguf_linear = op<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, int64_t)>(
          "spmd_cpu::gguf_linear");
  c10::TypedOperatorHandle<Linear> gguf_int8_linear = op<Linear>("spmd_cpu::gguf_int8_linear");
  c10::TypedOperatorHandle<Linear> gguf_int8_silu_linear =
      op<Linear>("spmd_cpu::gguf_int8_silu_linear");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, const Tensor&)>
      gguf_int8_residual_linear =
          op<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, const Tensor&)>(
              "spmd_cpu::gguf_int8_residual_linear");
};

inline const Ops& ops() {
  static const Ops handles;
  return handles;
}

// oneDNN's linear on a weight it prepacked (mkldnn::_reorder_linear_weight) or a plain one, as
// runtime/layers/linear.py calls it; looked up at its first use only (a torch without oneDNN
// has no such operator, and then no prepacked weights either).
using PointwiseLinear = Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&,
                               c10::string_view, c10::List<std::optional<c10::Scalar>>,
                               std::optional<c10::string_view>);

inline Tensor onednn_linear(const Tensor& input, const Tensor& weight) {
  static const auto handle = op<PointwiseLinear>("mkldnn::_linear_pointwise");
  return handle.call(input, weight, std::nullopt, "none", c10::List<std::optional<c10::Scalar>>(),
                     std::optional<c10::string_view>(""));
}

// Whether this torch has oneDNN's linear, which linear.py prefers for a plain bf16 weight.
inline bool onednn_linear_available() {
  static const bool found =
      c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""}).has_value();
  return found;
}

// Every weight slot named in messages, so a refusal says which tensor of which layer is wrong.
inline std::string slot_name(size_t index) {
  static const char* const kSlots[kPerLayer] = {
      "input norm", "QKV packed", "QKV stand-in", "output packed", "output stand-in",
      "post-attention norm", "gate/up packed", "gate/up stand-in", "down packed", "down stand-in"};
  return c10::str("weights[", index, "] (layer ", index / kPerLayer, " ",
                  kSlots[index % kPerLayer], ")");
}

inline void check_counts(const char* who, at::TensorList weights, at::TensorList k_caches,
                         at::TensorList v_caches) {
  TORCH_CHECK(k_caches.size() == v_caches.size(), who, ": ", k_caches.size(),
              " k_caches and ", v_caches.size(), " v_caches (one of each per layer expected)");
  TORCH_CHECK(weights.size() % kPerLayer == 0, who, ": weights has ", weights.size(),
              " tensors, not a multiple of ", kPerLayer, " (", kPerLayer, " per layer expected)");
  TORCH_CHECK(weights.size() == kPerLayer * k_caches.size(), who, ": weights holds ",
              weights.size() / kPerLayer, " layers and k_caches ", k_caches.size(),
              " (the same number of layers expected)");
}

inline void check_scalars(const char* who, int64_t block_size, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim) {
  const std::pair<const char*, int64_t> positive[] = {
      {"block_size", block_size}, {"num_heads", num_heads}, {"num_kv_heads", num_kv_heads},
      {"head_dim", head_dim}};
  for (const auto& [name, value] : positive)
    TORCH_CHECK(value > 0, who, ": ", name, " is ", value, ", a positive number expected");
  TORCH_CHECK(num_heads % num_kv_heads == 0, who, ": num_heads ", num_heads,
              " is not a multiple of num_kv_heads ", num_kv_heads, " (query heads share KV heads)");
  TORCH_CHECK(head_dim % 2 == 0, who, ": head_dim is ", head_dim,
              ", an even number expected (rotary rotates its two halves)");
}

// x: the embedded tokens, a contiguous [tokens, hidden] float32 or bfloat16 tensor; `per_token`
// ({name, tensor, dimensions}): tensors with one row per token.
inline void check_tokens(const char* who, const Tensor& x,
                         std::initializer_list<std::tuple<const char*, const Tensor&, int64_t>>
                             per_token) {
  check_cpu_tensor(x, who, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), who, ": x has shape ", x.sizes(),
              " and strides ", x.strides(), ", a contiguous [tokens, hidden] tensor expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, who, ": x is ",
              x.scalar_type(), ", float32 or bfloat16 expected");
  for (const auto& [name, t, dims] : per_token) {
    TORCH_CHECK(t.dim() == dims, who, ": ", name, " has ", t.dim(), " dimensions, ", dims,
                " expected");
    TORCH_CHECK(t.size(0) == x.size(0), who, ": ", name, " has ", t.size(0), " rows and x ",
                x.size(0), " (one per token expected)");
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

inline void check_norm(const char* who, at::TensorList weights, size_t index,
                       const LayerShapes& s) {
  const Tensor& w = weights[index];
  check_cpu_tensor(w, who, slot_name(index).c_str());
  TORCH_CHECK(w.dim() == 1 && w.size(0) == s.hidden && w.scalar_type() == s.dtype, who, ": ",
              slot_name(index), " is ", w.scalar_type(), " ", w.sizes(), ", [", s.hidden,
              "] in x's dtype ", s.dtype, " expected");
}

// A projection may also be a GGUF file's blocks (uint8 [out, bytes a row], group_quant.py) with
// an int64 [GGML type, in_features] stand-in, multiplied by spmd_cpu::gguf_bf16_linear (bf16) or
// by spmd_cpu::gguf_linear's float32 panels (float32: group_quant.py hands the blocks over only
// at row counts past its integer products); [GGML type, in_features, 1] for 8-bit activations
// (spmd_cpu::gguf_int8_linear, `--quantization int8`), in either dtype.
inline bool gguf_blocks(const Tensor& weight) { return weight.scalar_type() == at::kByte; }

// A GGUF projection's [out, in] from its blocks and stand-in.
inline std::pair<int64_t, int64_t> gguf_shape(const char* who, at::TensorList weights,
                                              size_t index) {
  const Tensor& blocks = weights[index];
  const Tensor& info = weights[index + 1];
  TORCH_CHECK(blocks.dim() == 2 && info.scalar_type() == at::kLong && info.dim() == 1 &&
                  (info.numel() == 2 || info.numel() == 3) && info.device().is_cpu(),
              who, ": ", slot_name(index + 1), " is a ", info.scalar_type(), " ", info.sizes(),
              " tensor beside the GGUF blocks ", blocks.sizes(), " of ", slot_name(index),
              ", an int64 [GGML type, in_features(, int8 activations)] expected");
  return {blocks.size(0), info.const_data_ptr<int64_t>()[1]};
}

// The slot holding a projection's [out, in] shape: a packed weight's stand-in (packed weights
// are opaque; so are bf16 panels, int32 words), a plain bf16 weight itself.
inline size_t shape_slot(at::TensorList weights, size_t index, at::ScalarType dtype) {
  return dtype == at::kFloat || weights[index].is_mkldnn() || is_bf16_panels(weights[index])
             ? index + 1
             : index;
}

// A projection's rows (output features); 0 where its shape is not one.
inline int64_t projection_rows(const char* who, at::TensorList weights, size_t index,
                               at::ScalarType dtype) {
  if (gguf_blocks(weights[index])) return gguf_shape(who, weights, index).first;
  const Tensor& shaped = weights[shape_slot(weights, index, dtype)];
  return shaped.dim() == 2 ? shaped.size(0) : 0;
}

inline void check_projection(const char* who, at::TensorList weights, size_t index,
                             const LayerShapes& s, int64_t out, int64_t in) {
  if (gguf_blocks(weights[index])) {
    // The blocks' bytes and type are the operator's to check, at its call.
    check_cpu_tensor(weights[index], who, slot_name(index).c_str());
    const auto [rows, columns] = gguf_shape(who, weights, index);
    TORCH_CHECK(rows == out && columns == in, who, ": ", slot_name(index), " holds GGUF "
                "blocks of a [", rows, ", ", columns, "] weight, [", out, ", ", in, "] expected");
    return;
  }
  const size_t shape_index = shape_slot(weights, index, s.dtype);
  const Tensor& shaped = weights[shape_index];
  const std::string name = slot_name(shape_index);
  check_cpu_tensor(shaped, who, name.c_str());
  TORCH_CHECK(shaped.scalar_type() == s.dtype && shaped.dim() == 2 && shaped.size(0) == out &&
                  shaped.size(1) == in,
              who, ": ", name, " is a ", shaped.scalar_type(), " ", shaped.sizes(),
              " tensor, a [", out, ", ", in, "] weight in x's dtype ", s.dtype, " expected");
  const Tensor& packed = weights[index];
  if (is_bf16_panels(packed)) {   // bf16_panels_pack's words for the stand-in's shape
    check_cpu_tensor(packed, who, slot_name(index).c_str());
    TORCH_CHECK(s.dtype == at::kBFloat16 && bf16_panels_fit(packed, out, in),
                who, ": ", slot_name(index), " is an int32 ", packed.sizes(), " tensor: the "
                "bf16 panels of a [", out, ", ", in, "] weight are [", out / 32, ", ", in * 16,
                "] and serve bfloat16 x only");
    return;
  }
  TORCH_CHECK(s.dtype != at::kFloat || (packed.is_mkldnn() && packed.scalar_type() == at::kFloat &&
                                        packed.numel() >= shaped.numel()),
              who, ": ", slot_name(index), " is not a float32 weight packed by ",
              "mkl::_mkl_reorder_linear_weight or mkldnn::_reorder_linear_weight for its [", out,
              ", ", in, "] stand-in");
  TORCH_CHECK(s.dtype == at::kFloat || !packed.is_mkldnn() ||
                  (packed.scalar_type() == s.dtype && packed.numel() == shaped.numel()),
              who, ": ", slot_name(index), " is not a ", s.dtype, " weight packed by ",
              "mkldnn::_reorder_linear_weight for its [", out, ", ", in, "] stand-in");
}

inline void check_layer(const char* who, at::TensorList weights, size_t layer,
                        const LayerShapes& s) {
  const size_t base = layer * kPerLayer;
  check_norm(who, weights, base, s);
  check_norm(who, weights, base + 5, s);
  check_projection(who, weights, base + 1, s, s.qkv_out, s.hidden);
  check_projection(who, weights, base + 3, s, s.hidden, s.q_size);
  // The intermediate size is the gate/up weight's: its rows are the gate's, then the up's.
  const int64_t gate_up_rows = projection_rows(who, weights, base + 6, s.dtype);
  TORCH_CHECK(gate_up_rows > 0 && gate_up_rows % 2 == 0, who, ": ",
              slot_name(shape_slot(weights, base + 6, s.dtype)), " has ", gate_up_rows,
              " rows, [2 * intermediate, hidden] expected");
  check_projection(who, weights, base + 6, s, gate_up_rows, s.hidden);
  check_projection(who, weights, base + 8, s, s.hidden, gate_up_rows / 2);
}

inline void check_caches(const char* who, at::TensorList caches, const char* name,
                         int64_t kv_heads, int64_t head_dim) {
  for (size_t l = 0; l < caches.size(); ++l)
    TORCH_CHECK(caches[l].dim() == 3 && caches[l].size(1) == kv_heads &&
                    caches[l].size(2) == head_dim,
                who, ": ", name, "[", l, "] has shape ", caches[l].sizes(), ", [slots, ",
                kv_heads, ", ", head_dim, "] (num_kv_heads, head_dim) expected");
}

// The [GGML type, in_features] of a projection's slot pair at w that multiplies 8-bit
// activations (GGUF blocks whose stand-in ends in 1); nullopt for any other.
inline std::optional<std::pair<int64_t, int64_t>> int8_blocks(const Tensor* w) {
  if (!gguf_blocks(w[0]) || w[1].numel() != 3) return std::nullopt;
  const int64_t* info = w[1].const_data_ptr<int64_t>();
  if (info[2] != 1) return std::nullopt;
  return std::make_pair(info[0], info[1]);
}

// input [n, in] @ a projection's weight (its slot pair at w) as linear.py multiplies n rows:
// GGUF blocks in either dtype; float32 weights otherwise MKL-packed (an opaque buffer) or
// oneDNN-packed (shaped as the weight); bf16 ones packed as panels (cpu_bf16_panels.h), else
// oneDNN-packed or plain [out, in] tensors, which linear.py gives the bf16 tiles at the row
// counts they take and oneDNN's linear otherwise.
inline Tensor project(const Tensor& input, const Tensor* w, int64_t n) {
  const Ops& f = ops();
  const bool plain = input.scalar_type() != at::kFloat;
  const std::optional<Tensor> no_bias;
  if (const auto int8 = int8_blocks(w))
    return f.gguf_int8_linear.call(input.contiguous(), w[0], int8->first, int8->second);
  if (gguf_blocks(w[0])) {
    const int64_t* info = w[1].const_data_ptr<int64_t>();
    return plain ? f.gguf_bf16_linear.call(input.contiguous(), w[0], info[0], info[1], false)
                 : f.gguf_linear.call(input.contiguous(), w[0], info[0], info[1], 0);
  }
  if (is_bf16_panels(w[0])) return bf16_panels_linear(input.contiguous(), w[0], w[1]);
  if (!plain && w[0].sizes() != w[1].sizes()) return f.linear.call(input, w[0], w[1], no_bias, n);
  if (w[0].is_mkldnn()) return onednn_linear(input, w[0]);
  if (bf16_linear_takes(n, w[0].size(1), w[0].size(0)))
    return bf16_linear(input.contiguous(), w[0]);
  return onednn_linear_available() ? onednn_linear(input, w[0])
                                   : f.plain_linear.call(input, w[0], no_bias);
}

// From this many rows a gate/up projection on 8-bit activations runs SiLU x up in its product
// (runtime/layers/int8_blocks.py INT8_GATED_FROM_ROWS: fewer rows, the plain product and
// silu_mul were as fast or faster).
constexpr int64_t kInt8GatedFromRows = 33;

// A layer's query, key and value heads (this rank's).
struct Heads {
  int64_t num_heads, num_kv_heads, head_dim;
  int64_t q_size() const { return num_heads * head_dim; }
  int64_t kv_size() const { return num_kv_heads * head_dim; }
};

// The per-token tables every layer reads: rotary cos and sin [n, head_dim] at the tokens'
// positions, and the cache slots their keys and values go to.
struct TokenTables {
  const Tensor &cos, &sin, &slots;
};

// A layer's attention inputs, as the layer loop's FUSED_CPU pieces make them (norm, QKV
// projection, rotary in place on the query and key columns), with the keys and values written
// to the layer's caches: q [n, heads, dim] and the k, v views [n, kv_heads, dim].
struct Attending {
  Tensor q, k, v;
};

inline Attending attention_inputs(const Tensor& x, const Tensor* w, double eps, const Heads& h,
                                  const TokenTables& t, Tensor& k_cache, Tensor& v_cache) {
  const Ops& f = ops();
  const int64_t n = x.size(0);
  Tensor qkv = project(f.rms_norm.call(x, w[0], eps), w + 1, n);
  f.rotary.call(qkv, h.num_heads + h.num_kv_heads, h.head_dim, t.cos, t.sin);
  Attending a{qkv.narrow(1, 0, h.q_size()).view({n, h.num_heads, h.head_dim}),
              qkv.narrow(1, h.q_size(), h.kv_size()).view({n, h.num_kv_heads, h.head_dim}),
              qkv.narrow(1, h.q_size() + h.kv_size(), h.kv_size())
                  .view({n, h.num_kv_heads, h.head_dim})};
  f.write_kv.call(a.k, a.v, k_cache, v_cache, t.slots);
  return a;
}

// Where a layer's MLP takes the GGUF bf16 kernels' epilogues, as the layer loop does for a
// prompt's rows (group_quant.silu_gated_product, parallel.residual_row_parallel_linear): SiLU x
// up in the gate/up product's tiles, the residual added in the down projection's. Products on
// 8-bit activations take theirs wherever the loop's do (kInt8GatedFromRows), without a flag.
struct Epilogues {
  bool silu_in_product = false, residual_in_product = false;
};

// weights[index] and its stand-in as GGUF blocks a bf16 epilogue kernel takes: their
// [GGML type, in_features]; refused naming the slot otherwise.
inline std::pair<int64_t, int64_t> epilogue_blocks(const char* who, at::TensorList weights,
                                                   size_t index) {
  TORCH_CHECK(gguf_blocks(weights[index]) && weights[index + 1].numel() == 2, who, ": ",
              slot_name(index), " must be GGUF blocks with a [GGML type, in_features] stand-in "
              "to take its product's epilogue");
  const int64_t* info = weights[index + 1].const_data_ptr<int64_t>();
  return {info[0], info[1]};
}

// The rest of layer `layer` once its attention is `attended` [n, heads, dim]: output
// projection, residual and norm, gate/up and SiLU x up, down projection and residual; the
// layer's output.
inline Tensor finish_layer(const char* who, const Tensor& x, const Tensor& attended,
                           at::TensorList weights, size_t layer, double eps, const Heads& h,
                           const Epilogues& e) {
  const Ops& f = ops();
  const int64_t n = x.size(0);
  const size_t base = layer * kPerLayer;
  const Tensor* w = weights.data() + base;
  const Tensor attention_output = project(attended.view({n, h.q_size()}), w + 3, n);
  auto [residual, normed] = f.add_rms_norm.call(x, attention_output, w[5], eps);
  Tensor activation;
  const auto gate_up_int8 = int8_blocks(w + 6);
  if (gate_up_int8 && n >= kInt8GatedFromRows && w[6].size(0) % 32 == 0) {
    activation = f.gguf_int8_silu_linear.call(normed.contiguous(), w[6], gate_up_int8->first,
                                              gate_up_int8->second);
  } else if (is_bf16_panels(w[6])) {   // SiLU x up in the panels' epilogue, at any row count
    activation = bf16_panels_silu_linear(normed.contiguous(), w[6], w[7]);
  } else if (e.silu_in_product) {
    const auto [kind, in] = epilogue_blocks(who, weights, base + 6);
    activation = f.gguf_bf16_silu_linear.call(normed.contiguous(), w[6], kind, in);
  } else {
    activation = f.silu_mul.call(project(normed, w + 6, n));
  }
  if (const auto down_int8 = int8_blocks(w + 8))
    return f.gguf_int8_residual_linear.call(activation.contiguous(), w[8], down_int8->first,
                                            down_int8->second, residual.contiguous());
  if (is_bf16_panels(w[8]))
    return bf16_panels_residual_linear(activation.contiguous(), w[8], w[9], residual.contiguous());
  if (!e.residual_in_product) return residual.add_(project(activation, w + 8, n));
  const auto [kind, in] = epilogue_blocks(who, weights, base + 8);
  return f.gguf_bf16_residual_linear.call(activation.contiguous(), w[8], kind, in,
                                          residual.contiguous());
}

}  // namespace spmd_cpu::layer_stack
