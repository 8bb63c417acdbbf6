// Decode attention on the CPU that reads the paged KV cache in place (runtime/layers/cpu_attention.py).
//
// One task per (sequence, KV head): the query heads of that KV head's group score every context
// token straight from its cache slot (slot = block_table[t / block_size] * block_size +
// t % block_size), take the softmax, and sum the values from their slots. Nothing is gathered
// or copied; each context token's K and V rows of that head are read once per step. For the
// usual head sizes (64, 128) and group sizes (1-8) the group's queries and value sums are
// fixed-size arrays the compiler keeps in vector registers; other shapes take a generic loop.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_math.h"

namespace {

struct Layout {
  int64_t kv_heads, group, head_dim, block_size;
  int64_t slot_stride;              // elements between consecutive cache slots
  int64_t q_seq_stride, q_head_stride, table_stride;
  float scale;
};

// Softmax weights of `length` scores in place; returns 1 / their sum.
inline float softmax_weights(float* s, int64_t length) {
  float peak = s[0];
#pragma omp simd reduction(max : peak)
  for (int64_t t = 0; t < length; ++t) peak = std::max(peak, s[t]);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < length; ++t) {
    s[t] = spmd_cpu::exp_vectorisable(s[t] - peak);
    total += s[t];
  }
  return 1.f / total;
}

// Asks for one KV head's row of `n` slots (head_dim floats each) to be brought into cache.
inline void prefetch_rows(const Layout& L, const float* first, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < L.head_dim; d += 16) __builtin_prefetch(first + i * L.slot_stride + d);
}

// Calls visit(t, row) for each context token t of a sequence with its cache row for one KV head,
// walking the block table block by block. Blocks lie anywhere in the cache, which the hardware
// prefetcher cannot follow: the next block's rows (and, with `also`, this block's rows of a
// second cache, read in the next pass) are prefetched while this block is visited.
template <typename index_t, typename Visit>
inline void for_each_row(const Layout& L, const float* cache, const index_t* table, int64_t length,
                         Visit visit, const float* also = nullptr) {
  const int64_t block_elems = L.block_size * L.slot_stride;
  for (int64_t t0 = 0, b = 0; t0 < length; t0 += L.block_size, ++b) {
    const int64_t offset = static_cast<int64_t>(table[b]) * block_elems;
    const float* block = cache + offset;
    const int64_t n = std::min(L.block_size, length - t0);
    if (t0 + L.block_size < length)
      prefetch_rows(L, cache + static_cast<int64_t>(table[b + 1]) * block_elems,
                    std::min(L.block_size, length - t0 - L.block_size));
    if (also != nullptr) prefetch_rows(L, also + offset, n);
    for (int64_t i = 0; i < n; ++i) visit(t0 + i, block + i * L.slot_stride);
  }
}

// One KV head of one sequence with G query heads of D dimensions, sizes known at compile time.
template <int G, int D, typename index_t>
void attend_head_fixed(const Layout& L, const float* q, const float* k_cache, const float* v_cache,
                       const index_t* table, int64_t length, float* out, float* scores) {
  float query[G][D];
  for (int g = 0; g < G; ++g) std::memcpy(query[g], q + g * L.q_head_stride, sizeof(float) * D);
  for_each_row(L, k_cache, table, length, [&](int64_t t, const float* k) {
    for (int g = 0; g < G; ++g) {
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int d = 0; d < D; ++d) sum += query[g][d] * k[d];
      scores[g * length + t] = sum * L.scale;
    }
  }, v_cache);
  float inv_sum[G];
  for (int g = 0; g < G; ++g) inv_sum[g] = softmax_weights(scores + g * length, length);
  float acc[G][D] = {};
  for_each_row(L, v_cache, table, length, [&](int64_t t, const float* v) {
    for (int g = 0; g < G; ++g) {
      const float w = scores[g * length + t];
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[g][d] += w * v[d];
    }
  });
  for (int g = 0; g < G; ++g) {
#pragma omp simd
    for (int d = 0; d < D; ++d) out[g * D + d] = acc[g][d] * inv_sum[g];
  }
}

// The same for any group and head size (sums in a scratch buffer).
template <typename index_t>
void attend_head_generic(const Layout& L, const float* q, const float* k_cache,
                         const float* v_cache, const index_t* table, int64_t length, float* out,
                         float* scores, std::vector<float>& acc) {
  const int64_t G = L.group, D = L.head_dim;
  for_each_row(L, k_cache, table, length, [&](int64_t t, const float* k) {
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * L.q_head_stride;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < D; ++d) sum += qg[d] * k[d];
      scores[g * length + t] = sum * L.scale;
    }
  }, v_cache);
  std::vector<float> inv_sum(G);
  for (int64_t g = 0; g < G; ++g) inv_sum[g] = softmax_weights(scores + g * length, length);
  acc.assign(G * D, 0.f);
  for_each_row(L, v_cache, table, length, [&](int64_t t, const float* v) {
    for (int64_t g = 0; g < G; ++g) {
      const float w = scores[g * length + t];
      float* a = acc.data() + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
    }
  });
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] * inv_sum[g];
}

template <typename index_t>
using HeadFn = void (*)(const Layout&, const float*, const float*, const float*, const index_t*,
                        int64_t, float*, float*);

template <int D, typename index_t>
HeadFn<index_t> fixed_for_group(int64_t group) {
  switch (group) {
    case 1: return attend_head_fixed<1, D, index_t>;
    case 2: return attend_head_fixed<2, D, index_t>;
    case 3: return attend_head_fixed<3, D, index_t>;
    case 4: return attend_head_fixed<4, D, index_t>;
    case 5: return attend_head_fixed<5, D, index_t>;
    case 6: return attend_head_fixed<6, D, index_t>;
    case 7: return attend_head_fixed<7, D, index_t>;
    case 8: return attend_head_fixed<8, D, index_t>;
    default: return nullptr;
  }
}

template <typename index_t>
HeadFn<index_t> fixed_head_fn(const Layout& L) {
  if (L.head_dim == 64) return fixed_for_group<64, index_t>(L.group);
  if (L.head_dim == 128) return fixed_for_group<128, index_t>(L.group);
  return nullptr;
}

template <typename index_t>
void attend(const Layout& L, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& tables, const at::Tensor& lengths, at::Tensor& out) {
  const float* q_ptr = q.data_ptr<float>();
  const float* k_ptr = k_cache.data_ptr<float>();
  const float* v_ptr = v_cache.data_ptr<float>();
  const index_t* table_ptr = tables.data_ptr<index_t>();
  const int32_t* length_ptr = lengths.data_ptr<int32_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t D = L.head_dim, G = L.group, heads = L.kv_heads * G;
  const HeadFn<index_t> fixed = fixed_head_fn<index_t>(L);
  at::parallel_for(0, q.size(0) * L.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / L.kv_heads, kv = task % L.kv_heads;
      const int64_t length = length_ptr[seq];
      scores.resize(G * length);
      const float* q_group = q_ptr + seq * L.q_seq_stride + kv * G * L.q_head_stride;
      const index_t* table = table_ptr + seq * L.table_stride;
      float* o = out_ptr + (seq * heads + kv * G) * D;
      if (task + 1 < end) {     // the next task's first block, while this one runs
        const int64_t next_seq = (task + 1) / L.kv_heads, next_kv = (task + 1) % L.kv_heads;
        const index_t first = table_ptr[next_seq * L.table_stride];
        prefetch_rows(L, k_ptr + next_kv * D + static_cast<int64_t>(first) * L.block_size * L.slot_stride,
                      std::min<int64_t>(L.block_size, length_ptr[next_seq]));
      }
      if (fixed != nullptr) {
        fixed(L, q_group, k_ptr + kv * D, v_ptr + kv * D, table, length, o, scores.data());
      } else {
        attend_head_generic<index_t>(L, q_group, k_ptr + kv * D, v_ptr + kv * D, table, length, o,
                                     scores.data(), acc);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& lengths, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3,
              "q [n, heads, dim] and caches [slots, kv_heads, dim] expected");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "the CPU decode kernel takes float32 queries and caches");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && q.stride(2) == 1,
              "contiguous caches and queries expected");
  TORCH_CHECK(lengths.scalar_type() == at::kInt && lengths.is_contiguous(), "int32 lengths expected");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1, "block tables [n, blocks] expected");
  const int64_t heads = q.size(1), kv_heads = k_cache.size(1);
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  Layout layout{kv_heads,       heads / kv_heads,    q.size(2),
                block_size,     kv_heads * q.size(2), q.stride(0),
                q.stride(1),    block_tables.stride(0), static_cast<float>(scale)};
  at::Tensor out = at::empty({q.size(0), heads, q.size(2)}, q.options());
  if (block_tables.scalar_type() == at::kInt) {
    attend<int32_t>(layout, q, k_cache, v_cache, block_tables, lengths, out);
  } else {
    TORCH_CHECK(block_tables.scalar_type() == at::kLong, "int32 or int64 block tables expected");
    attend<int64_t>(layout, q, k_cache, v_cache, block_tables, lengths, out);
  }
  return out;
}

// The step's new keys and values into their cache slots, both caches in one pass: k and v
// [tokens, kv_heads, head_dim] (rows may be strided, as views of the fused QKV output), slots
// [tokens] int64. The same copies as index_copy_ on each cache.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "write_kv: float32 k, v [tokens, kv_heads, dim] expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.size(1) * k_cache.size(2) == k.size(1) * k.size(2),
              "write_kv: contiguous caches of the same row size expected");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == k.size(0),
              "write_kv: one int64 slot per token expected");
  const at::Tensor kr = k.stride(2) == 1 && k.stride(1) == k.size(2) ? k : k.contiguous();
  const at::Tensor vr = v.stride(2) == 1 && v.stride(1) == v.size(2) ? v : v.contiguous();
  const at::Tensor sl = slots.contiguous();
  const int64_t row = k.size(1) * k.size(2), num_slots = k_cache.size(0);
  const int64_t* slot = sl.data_ptr<int64_t>();
  const float *ks = kr.data_ptr<float>(), *vs = vr.data_ptr<float>();
  float *kd = k_cache.data_ptr<float>(), *vd = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "write_kv: slot ", slot[t], " out of range");
  at::parallel_for(0, k.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kd + slot[t] * row, ks + t * kr.stride(0), sizeof(float) * row);
      std::memcpy(vd + slot[t] * row, vs + t * vr.stride(0), sizeof(float) * row);
    }
  });
}

}  // namespace

TORCH_LIBRARY(spmd_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor lengths, int block_size, float scale) -> Tensor");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(spmd_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("write_kv", &write_kv);
}
