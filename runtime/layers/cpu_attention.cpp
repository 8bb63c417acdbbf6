// Decode attention on the CPU that reads the paged KV cache in place (runtime/layers/cpu_attention.py).
//
// One task per sequence: every query head scores every context token straight from its cache
// slot (slot = block_table[t / block_size] * block_size + t % block_size), takes the softmax,
// and sums the values from their slots. Nothing is gathered or copied; each context token's K
// and V rows are read once per step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void add_scaled(float* __restrict acc, const float* __restrict x, float w, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] += w * x[i];
}

struct Layout {
  int64_t kv_heads, group, head_dim, block_size;
  int64_t slot_stride;              // elements between consecutive cache slots
  int64_t q_seq_stride, q_head_stride, table_stride;
  float scale;
};

// Calls visit(t, row) for each context token t of a sequence with its cache row (all KV heads
// side by side), walking the block table block by block.
template <typename index_t, typename Visit>
inline void for_each_row(const Layout& L, const float* cache, const index_t* table, int64_t length,
                         Visit visit) {
  for (int64_t t0 = 0, b = 0; t0 < length; t0 += L.block_size, ++b) {
    const float* block = cache + static_cast<int64_t>(table[b]) * L.block_size * L.slot_stride;
    const int64_t n = std::min(L.block_size, length - t0);
    for (int64_t i = 0; i < n; ++i) visit(t0 + i, block + i * L.slot_stride);
  }
}

// One sequence, every head: its context is walked block by block and each token's K (then V)
// row, all KV heads side by side, is read once, front to back, which the hardware prefetcher
// follows (a task per KV head would read a third of each row, strided).
template <typename index_t>
void attend_sequence(const Layout& L, const float* q, const float* k_cache, const float* v_cache,
                     const index_t* table, int64_t length, float* out, std::vector<float>& scores,
                     std::vector<float>& acc) {
  const int64_t G = L.group, D = L.head_dim;
  const int64_t heads = L.kv_heads * G;
  scores.resize(heads * length);
  acc.assign(heads * D, 0.f);
  for_each_row(L, k_cache, table, length, [&](int64_t t, const float* k_row) {
    for (int64_t h = 0; h < heads; ++h)
      scores[h * length + t] = dot(q + h * L.q_head_stride, k_row + (h / G) * D, D) * L.scale;
  });
  std::vector<float> inv_sum(heads);
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores.data() + h * length;
    float peak = s[0];
    for (int64_t t = 1; t < length; ++t) peak = std::max(peak, s[t]);
    float total = 0.f;
    for (int64_t t = 0; t < length; ++t) {
      s[t] = std::exp(s[t] - peak);
      total += s[t];
    }
    inv_sum[h] = 1.f / total;
  }
  for_each_row(L, v_cache, table, length, [&](int64_t t, const float* v_row) {
    for (int64_t h = 0; h < heads; ++h)
      add_scaled(acc.data() + h * D, v_row + (h / G) * D, scores[h * length + t], D);
  });
  for (int64_t h = 0; h < heads; ++h) {
    float* o = out + h * D;
    for (int64_t d = 0; d < D; ++d) o[d] = acc[h * D + d] * inv_sum[h];
  }
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
  const int64_t row = L.kv_heads * L.group * L.head_dim;
  at::parallel_for(0, q.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc;
    for (int64_t seq = begin; seq < end; ++seq)
      attend_sequence<index_t>(L, q_ptr + seq * L.q_seq_stride, k_ptr, v_ptr,
                               table_ptr + seq * L.table_stride, length_ptr[seq], out_ptr + seq * row,
                               scores, acc);
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

}  // namespace

TORCH_LIBRARY(spmd_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor lengths, int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(spmd_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
