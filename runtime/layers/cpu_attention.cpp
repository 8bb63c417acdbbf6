// Decode attention on the CPU that reads the paged KV cache in place (runtime/layers/cpu_attention.py).
//
// One task per (sequence, KV head): the query heads of that KV head's group score every context
// token straight from its cache slot (slot = block_table[t / block_size] * block_size +
// t % block_size), take the softmax, and sum the values from their slots. Nothing is gathered
// or copied; each context token's K and V rows of that head are read once per step.
//
// Sliding windows: with `starts`, sequence i attends its tokens starts[i] .. lengths[i] - 1
// only. The walk begins at the block holding starts[i]: earlier tokens are never read, and the
// table entries of earlier blocks never looked at (the scheduler may have freed those blocks),
// so a window costs its own tokens whatever the context length. For the
// usual head sizes (64, 128) and group sizes (1-8) the group's queries and value sums are
// fixed-size arrays the compiler keeps in vector registers; other shapes take a generic loop.
//
// Queries and caches are all float32 or all bfloat16 (the kernel is templated on that storage
// type): bfloat16 rows are widened as they are read, scores, softmax and value sums are float32
// either way, and the output is rounded to the queries' dtype (nearest even).
//
// Every entry point checks what it will dereference (shapes, dtypes, each block-table entry a
// length reaches, each slot) before reading anything, and names the bad argument: a wrong
// table or slot would otherwise read or write outside the cache.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_bf16.h"
#include "cpu_avx512.h"
#include "cpu_bf16_dot.h"
#include "cpu_prompt_tiles.h"
#include "cpu_math.h"

namespace {

using spmd_cpu::bf16_bits;
using spmd_cpu::check_dtype;
using spmd_cpu::check_tensor;
using spmd_cpu::load_as_float;
using spmd_cpu::store_from_float;

struct Layout {
  int64_t kv_heads, group, head_dim, block_size;
  int64_t slot_stride;              // elements between consecutive cache slots
  int64_t q_seq_stride, q_head_stride, table_stride;
  float scale;
};

// Softmax weights of `length` scores in place; returns 1 / their sum.
inline float softmax_weights(float* s, int64_t length) {
  return 1.f / spmd_cpu::exp_row(s, length, spmd_cpu::row_max(s, length));
}

// A cache row of n elements as float32: float32 rows are read in place; a bfloat16 row is
// widened into `buffer` once, so the G query heads that share it do not each widen it.
inline const float* float_row(const float* row, float*, int64_t) { return row; }
inline const float* float_row(const bf16_bits* row, float* buffer, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) buffer[d] = spmd_cpu::bf16_to_float(row[d]);
  return buffer;
}

// The G query rows of a group as float32, side by side in `dst`.
template <typename scalar_t>
inline void widen_queries(const Layout& L, const scalar_t* q, int64_t G, int64_t D, float* dst) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) dst[g * D + d] = load_as_float(q + g * L.q_head_stride + d);
}

// Asks for one KV head's row of `n` slots (head_dim elements each) to be brought into cache, a
// 64-byte line at a time.
template <typename scalar_t>
inline void prefetch_rows(const Layout& L, const scalar_t* first, int64_t n) {
  constexpr int64_t kLine = 64 / sizeof(scalar_t);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < L.head_dim; d += kLine) __builtin_prefetch(first + i * L.slot_stride + d);
}

// The context tokens a task attends: first .. length - 1 of its sequence.
struct Span {
  int64_t first, length;
  int64_t count() const { return length - first; }
};

// Calls visit(i, row) for the i-th token of a span with its cache row for one KV head, walking
// the block table from the block holding span.first. Blocks lie anywhere in the cache, which
// the hardware prefetcher cannot follow: the rows of the block kBlocksAhead on (and, with
// `also`, this block's rows of a second cache, read in the next pass) are prefetched while this
// block is visited (a block's 16 rows take about a DRAM latency: two ahead, 163 -> ~140 us a
// layer for SmolLM2's bf16 decode at 32 sequences x 176 tokens, cold cache; three ahead, with
// the next task's first kNextTaskBlocks blocks fetched as a task starts, 127-139 -> 109-125 us
// there and 139-145 -> 115-136 at 64 x 100; four ahead measured no better than two).
constexpr int64_t kBlocksAhead = 3;
constexpr int64_t kNextTaskBlocks = 3;

template <typename index_t, typename scalar_t, typename Visit>
inline void for_each_row(const Layout& L, const scalar_t* cache, const index_t* table, Span span,
                         Visit visit, const scalar_t* also = nullptr) {
  const int64_t block_elems = L.block_size * L.slot_stride, length = span.length;
  const int64_t first_block = span.first / L.block_size;
  for (int64_t b = first_block, t0 = b * L.block_size; t0 < length; t0 += L.block_size, ++b) {
    const int64_t offset = static_cast<int64_t>(table[b]) * block_elems;
    const scalar_t* block = cache + offset;
    const int64_t n = std::min(L.block_size, length - t0);
    const int64_t lo = std::max<int64_t>(span.first - t0, 0);   // > 0 in the first block only
    for (int64_t ahead = 1; ahead <= kBlocksAhead; ++ahead) {
      const int64_t next = t0 + ahead * L.block_size;
      if (next >= length) break;
      if (ahead == kBlocksAhead || b == first_block)   // nearer ones: asked for already
        prefetch_rows(L, cache + static_cast<int64_t>(table[b + ahead]) * block_elems,
                      std::min(L.block_size, length - next));
    }
    if (also != nullptr) prefetch_rows(L, also + offset + lo * L.slot_stride, n - lo);
    for (int64_t i = lo; i < n; ++i) visit(t0 + i - span.first, block + i * L.slot_stride);
  }
}

// Calls score(rows, count, base) for each run of up to 16 consecutive rows of a span's keys
// (rows[i]: the cache row of token base + i; a short last run's spare entries repeat its first
// row, so that a kernel may read 16), prefetching the value rows as for_each_row does.
template <typename index_t, typename scalar_t, typename Score>
inline void for_each_sixteen(const Layout& L, const scalar_t* k_cache, const scalar_t* v_cache,
                             const index_t* table, Span span, Score score) {
  const scalar_t* rows[16];
  int64_t filled = 0, base = 0;
  const auto flush = [&]() {
    for (int64_t i = filled; i < 16; ++i) rows[i] = rows[0];
    score(rows, filled, base);
    base += filled;
    filled = 0;
  };
  for_each_row(L, k_cache, table, span, [&](int64_t, const scalar_t* k_row) {
    rows[filled++] = k_row;
    if (filled == 16) flush();
  }, v_cache);
  if (filled > 0) flush();
}

// One KV head of one sequence with G query heads of D dimensions, sizes known at compile time.
template <int G, int D, typename index_t, typename scalar_t>
void attend_head_fixed(const Layout& L, const scalar_t* q, const scalar_t* k_cache,
                       const scalar_t* v_cache, const index_t* table, Span span,
                       scalar_t* out, float* scores) {
  const int64_t length = span.count();
  float query[G][D], row[D];
  widen_queries(L, q, G, D, &query[0][0]);
  for_each_row(L, k_cache, table, span, [&](int64_t t, const scalar_t* k_row) {
    const float* k = float_row(k_row, row, D);
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
  for_each_row(L, v_cache, table, span, [&](int64_t t, const scalar_t* v_row) {
    const float* v = float_row(v_row, row, D);
    for (int g = 0; g < G; ++g) {
      const float w = scores[g * length + t];
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[g][d] += w * v[d];
    }
  });
  for (int g = 0; g < G; ++g) {
#pragma omp simd
    for (int d = 0; d < D; ++d) store_from_float(out + g * D + d, acc[g][d] * inv_sum[g]);
  }
}

// A thread's buffers for attend_head_generic, reused across its tasks.
struct GenericScratch {
  std::vector<float> query, acc, row, inv_sum;
};

// The same for any group and head size (queries and sums in scratch buffers).
template <typename index_t, typename scalar_t>
void attend_head_generic(const Layout& L, const scalar_t* q, const scalar_t* k_cache,
                         const scalar_t* v_cache, const index_t* table, Span span,
                         scalar_t* out, float* scores, GenericScratch& s) {
  const int64_t G = L.group, D = L.head_dim, length = span.count();
  s.query.resize(G * D);
  s.row.resize(D);
  widen_queries(L, q, G, D, s.query.data());
  for_each_row(L, k_cache, table, span, [&](int64_t t, const scalar_t* k_row) {
    const float* k = float_row(k_row, s.row.data(), D);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = s.query.data() + g * D;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < D; ++d) sum += qg[d] * k[d];
      scores[g * length + t] = sum * L.scale;
    }
  }, v_cache);
  s.inv_sum.resize(G);
  for (int64_t g = 0; g < G; ++g) s.inv_sum[g] = softmax_weights(scores + g * length, length);
  s.acc.assign(G * D, 0.f);
  for_each_row(L, v_cache, table, span, [&](int64_t t, const scalar_t* v_row) {
    const float* v = float_row(v_row, s.row.data(), D);
    for (int64_t g = 0; g < G; ++g) {
      const float w = scores[g * length + t];
      float* a = s.acc.data() + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
    }
  });
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d)
      store_from_float(out + g * D + d, s.acc[g * D + d] * s.inv_sum[g]);
}

template <typename index_t, typename scalar_t>
using HeadFn = void (*)(const Layout&, const scalar_t*, const scalar_t*, const scalar_t*,
                        const index_t*, Span, scalar_t*, float*);

template <int D, typename index_t, typename scalar_t>
HeadFn<index_t, scalar_t> fixed_for_group(int64_t group) {
  HeadFn<index_t, scalar_t> fn = nullptr;
  spmd_cpu::with_row_count<1, 8>(group, [&](auto g) {
    fn = attend_head_fixed<decltype(g)::value, D, index_t, scalar_t>;
  });
  return fn;
}

#if defined(__AVX512BF16__)
// Registers of 32 dimensions a value-sum pass covers: all NZ where G x 2 x NZ accumulators fit
// in 24 registers, else the largest halving of NZ that does.
constexpr int value_slice(int G, int NZ) {
  int zs = NZ;
  while (zs > 1 && G * 2 * zs > 24) zs /= 2;
  return zs;
}

// One KV head of one sequence on AVX512-BF16 dot products, bfloat16 caches: G query heads, NZ
// registers of 32 dimensions a row (cpu_bf16_dot.h). Scores are summed 16 tokens at a time;
// the value sums take the tokens in pairs, their softmax weights rounded to bfloat16 (their
// float32 sum divides the result).
template <int G, int NZ, typename index_t>
void attend_head_dot(const Layout& L, const bf16_bits* q, const bf16_bits* k_cache,
                     const bf16_bits* v_cache, const index_t* table, Span span, bf16_bits* out,
                     float* scores) {
  const int64_t length = span.count();
  __m512bh query[G][NZ];
  for (int g = 0; g < G; ++g)
    for (int z = 0; z < NZ; ++z)
      query[g][z] = (__m512bh)_mm512_loadu_si512(q + g * L.q_head_stride + 32 * z);
  for_each_sixteen(L, k_cache, v_cache, table, span,
                   [&](const bf16_bits* const* rows, int64_t count, int64_t base) {
    for (int g = 0; g < G; ++g) {
      __m512 dots[16];
      for (int i = 0; i < 16; ++i) {
        dots[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), query[g][0],
                                   (__m512bh)_mm512_loadu_si512(rows[i]));
        for (int z = 1; z < NZ; ++z)
          dots[i] = _mm512_dpbf16_ps(dots[i], query[g][z],
                                     (__m512bh)_mm512_loadu_si512(rows[i] + 32 * z));
      }
      const __m512 sums = _mm512_mul_ps(spmd_cpu::lane_sums(dots), _mm512_set1_ps(L.scale));
      _mm512_mask_storeu_ps(scores + g * length + base, (__mmask16)((1u << count) - 1), sums);
    }
  });
  // Each head's weights rounded to bfloat16 in place over the front of its float32 scores (a
  // bf16 row is half as long, so each 16 floats are read before their bytes are written), with
  // a zero after the last for an odd length's lone token.
  float inv_sum[G];
  const bf16_bits* weights[G];
  for (int g = 0; g < G; ++g) {
    float* row = scores + g * length;
    bf16_bits* w = reinterpret_cast<bf16_bits*>(row);
    inv_sum[g] = spmd_cpu::softmax_row(row, length, w);
    w[length] = 0;
    weights[g] = w;
  }
  // Value sums in slices of ZS registers of dimensions, each a pass over the value rows,
  // so that G x 2 x ZS accumulators fit the registers (one pass for small groups).
  constexpr int ZS = value_slice(G, NZ);
  for (int z0 = 0; z0 < NZ; z0 += ZS) {
    __m512 acc[G][2 * ZS];
    for (int g = 0; g < G; ++g)
      for (int z = 0; z < 2 * ZS; ++z) acc[g][z] = _mm512_setzero_ps();
    const auto add_pair = [&](int64_t t, const bf16_bits* a, const bf16_bits* b) {
      for (int z = 0; z < ZS; ++z) {
        __m512bh low, high;
        spmd_cpu::pair_rows(a, b, 32 * (z0 + z), low, high);
        for (int g = 0; g < G; ++g) {
          const __m512bh pair = (__m512bh)_mm512_set1_epi32(
              static_cast<int>(spmd_cpu::load_pair(weights[g] + t)));
          acc[g][2 * z] = _mm512_dpbf16_ps(acc[g][2 * z], pair, low);
          acc[g][2 * z + 1] = _mm512_dpbf16_ps(acc[g][2 * z + 1], pair, high);
        }
      }
    };
    const bf16_bits* held = nullptr;
    for_each_row(L, v_cache, table, span, [&](int64_t t, const bf16_bits* v_row) {
      if (held == nullptr) {
        held = v_row;
      } else {
        add_pair(t - 1, held, v_row);
        held = nullptr;
      }
    });
    if (held != nullptr) add_pair(length - 1, held, held);  // the lone last token: pair (w, 0)
    for (int g = 0; g < G; ++g)
      for (int z = 0; z < ZS; ++z)
        spmd_cpu::store_paired(acc[g][2 * z], acc[g][2 * z + 1], inv_sum[g],
                               out + g * L.head_dim + 32 * (z0 + z));
  }
}

// The dot-product kernel for groups of 1-8 query heads.
template <int NZ, typename index_t>
HeadFn<index_t, bf16_bits> dot_for_group(int64_t group) {
  HeadFn<index_t, bf16_bits> fn = nullptr;
  spmd_cpu::with_row_count<1, 8>(group, [&](auto g) {
    fn = attend_head_dot<decltype(g)::value, NZ, index_t>;
  });
  return fn;
}
#endif  // __AVX512BF16__

#if defined(__AVX512F__)
// One KV head of one sequence on AVX-512 FMAs, float32 caches: G query heads, NZ registers of
// 16 dimensions a row. Scores are summed 16 tokens at a time (lane_sums) rather than one
// token's lanes at a time; the value sums broadcast each token's weight against its row.
template <int G, int NZ, typename index_t>
void attend_head_f32(const Layout& L, const float* q, const float* k_cache, const float* v_cache,
                     const index_t* table, Span span, float* out, float* scores) {
  const int64_t length = span.count();
  __m512 query[G][NZ];
  for (int g = 0; g < G; ++g)
    for (int z = 0; z < NZ; ++z) query[g][z] = _mm512_loadu_ps(q + g * L.q_head_stride + 16 * z);
  for_each_sixteen(L, k_cache, v_cache, table, span,
                   [&](const float* const* rows, int64_t count, int64_t base) {
    for (int g = 0; g < G; ++g) {
      __m512 dots[16];
      for (int i = 0; i < 16; ++i) {
        dots[i] = _mm512_mul_ps(query[g][0], _mm512_loadu_ps(rows[i]));
        for (int z = 1; z < NZ; ++z)
          dots[i] = _mm512_fmadd_ps(query[g][z], _mm512_loadu_ps(rows[i] + 16 * z), dots[i]);
      }
      const __m512 sums = _mm512_mul_ps(spmd_cpu::lane_sums(dots), _mm512_set1_ps(L.scale));
      _mm512_mask_storeu_ps(scores + g * length + base, (__mmask16)((1u << count) - 1), sums);
    }
  });
  float inv_sum[G];
  for (int g = 0; g < G; ++g) inv_sum[g] = softmax_weights(scores + g * length, length);
  __m512 acc[G][NZ];
  for (int g = 0; g < G; ++g)
    for (int z = 0; z < NZ; ++z) acc[g][z] = _mm512_setzero_ps();
  for_each_row(L, v_cache, table, span, [&](int64_t t, const float* v_row) {
    __m512 weight[G];
    for (int g = 0; g < G; ++g) weight[g] = _mm512_set1_ps(scores[g * length + t]);
    for (int z = 0; z < NZ; ++z) {
      const __m512 v = _mm512_loadu_ps(v_row + 16 * z);
      for (int g = 0; g < G; ++g) acc[g][z] = _mm512_fmadd_ps(weight[g], v, acc[g][z]);
    }
  });
  for (int g = 0; g < G; ++g)
    for (int z = 0; z < NZ; ++z)
      _mm512_storeu_ps(out + g * L.head_dim + 16 * z,
                       _mm512_mul_ps(acc[g][z], _mm512_set1_ps(inv_sum[g])));
}

// The float32 FMA kernel for groups of 1-8 query heads.
template <int NZ, typename index_t>
HeadFn<index_t, float> f32_for_group(int64_t group) {
  HeadFn<index_t, float> fn = nullptr;
  spmd_cpu::with_row_count<1, 8>(group, [&](auto g) {
    fn = attend_head_f32<decltype(g)::value, NZ, index_t>;
  });
  return fn;
}
#endif  // __AVX512F__

template <typename index_t, typename scalar_t>
HeadFn<index_t, scalar_t> fixed_head_fn(const Layout& L) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, bf16_bits>) {
    HeadFn<index_t, scalar_t> dot = nullptr;
    if (L.head_dim == 64) dot = dot_for_group<2, index_t>(L.group);
    if (L.head_dim == 128) dot = dot_for_group<4, index_t>(L.group);
    if (dot != nullptr) return dot;
  }
#endif
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    HeadFn<index_t, scalar_t> fma = nullptr;
    if (L.head_dim == 64) fma = f32_for_group<4, index_t>(L.group);
    if (L.head_dim == 128) fma = f32_for_group<8, index_t>(L.group);
    if (fma != nullptr) return fma;
  }
#endif
  if (L.head_dim == 64) return fixed_for_group<64, index_t, scalar_t>(L.group);
  if (L.head_dim == 128) return fixed_for_group<128, index_t, scalar_t>(L.group);
  return nullptr;
}

template <typename scalar_t>
const scalar_t* data_of(const at::Tensor& t) {
  return static_cast<const scalar_t*>(t.const_data_ptr());
}

// A task's cost beside its keys, in keys (its query rows, output and scratch).
constexpr int64_t kTaskCost = 16;

// Task indices [0, tasks) cut into at most `parts` runs of about equal total cost(task):
// bounds[i] .. bounds[i + 1] is run i.
template <class Cost>
std::vector<int64_t> balanced_runs(int64_t tasks, int64_t parts, Cost&& cost) {
  parts = std::max<int64_t>(1, std::min(parts, tasks));
  std::vector<int64_t> prefix(tasks + 1, 0);
  for (int64_t t = 0; t < tasks; ++t) prefix[t + 1] = prefix[t] + cost(t);
  std::vector<int64_t> bounds{0};
  for (int64_t i = 1; i < parts; ++i) {
    const int64_t target = prefix[tasks] * i / parts;
    const int64_t at = std::lower_bound(prefix.begin(), prefix.end(), target) - prefix.begin();
    bounds.push_back(std::clamp<int64_t>(at, bounds.back(), tasks));
  }
  bounds.push_back(tasks);
  return bounds;
}

template <typename index_t, typename scalar_t>
void attend(const Layout& L, const at::Tensor& q, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& lengths,
            const int32_t* starts, at::Tensor& out) {
  const scalar_t* q_ptr = data_of<scalar_t>(q);
  const scalar_t* k_ptr = data_of<scalar_t>(k_cache);
  const scalar_t* v_ptr = data_of<scalar_t>(v_cache);
  const index_t* table_ptr = data_of<index_t>(tables);
  const int32_t* length_ptr = data_of<int32_t>(lengths);
  scalar_t* out_ptr = static_cast<scalar_t*>(out.mutable_data_ptr());
  const int64_t D = L.head_dim, G = L.group, heads = L.kv_heads * G;
  const HeadFn<index_t, scalar_t> fixed = fixed_head_fn<index_t, scalar_t>(L);
  const auto span_of = [&](int64_t seq) {
    return Span{starts != nullptr ? starts[seq] : 0, length_ptr[seq]};
  };
  const auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    GenericScratch scratch;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / L.kv_heads, kv = task % L.kv_heads;
      const Span span = span_of(seq);
      scores.resize(G * span.count());
      const scalar_t* q_group = q_ptr + seq * L.q_seq_stride + kv * G * L.q_head_stride;
      const index_t* table = table_ptr + seq * L.table_stride;
      scalar_t* o = out_ptr + (seq * heads + kv * G) * D;
      if (task + 1 < end) {     // the next task's first blocks, while this one runs
        const int64_t next_seq = (task + 1) / L.kv_heads, next_kv = (task + 1) % L.kv_heads;
        const Span next = span_of(next_seq);
        const int64_t block = next.first / L.block_size, within = next.first % L.block_size;
        for (int64_t j = 0; j < kNextTaskBlocks; ++j) {
          const int64_t t0 = (block + j) * L.block_size, from = j == 0 ? within : 0;
          if (t0 >= next.length) break;
          const int64_t entry = table_ptr[next_seq * L.table_stride + block + j];
          prefetch_rows(L, k_ptr + next_kv * D + (entry * L.block_size + from) * L.slot_stride,
                        std::min(L.block_size, next.length - t0) - from);
        }
      }
      if (fixed != nullptr) {
        fixed(L, q_group, k_ptr + kv * D, v_ptr + kv * D, table, span, o, scores.data());
      } else {
        attend_head_generic<index_t, scalar_t>(L, q_group, k_ptr + kv * D, v_ptr + kv * D,
                                               table, span, o, scores.data(), scratch);
      }
    }
  };
  // The sequences' contexts differ in length: each thread takes a run of tasks of about the
  // same total length (plus a task's fixed cost), not the same count of tasks.
  const int64_t tasks = q.size(0) * L.kv_heads;
  const auto bounds = balanced_runs(tasks, at::get_num_threads(), [&](int64_t task) {
    return span_of(task / L.kv_heads).count() + kTaskCost;
  });
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part) run(bounds[part], bounds[part + 1]);
  });
}

constexpr const char* kDecode = "paged_decode_attention";

// Ranks, devices, dtypes and the memory layout the kernel assumes.
void check_decode_tensors(const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& tables,
                          const at::Tensor& lengths) {
  check_tensor(kDecode, "q", q, 3);
  check_tensor(kDecode, "k_cache", k_cache, 3);
  check_tensor(kDecode, "v_cache", v_cache, 3);
  check_tensor(kDecode, "block_tables", tables, 2);
  check_tensor(kDecode, "lengths", lengths, 1);
  check_dtype(kDecode, "k_cache", k_cache, "q", q);
  check_dtype(kDecode, "v_cache", v_cache, "q", q);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), kDecode,
              ": k_cache and v_cache must be contiguous");
  TORCH_CHECK(q.stride(2) == 1, kDecode, ": q's head_dim must be contiguous, got strides ",
              q.strides());
  TORCH_CHECK(tables.scalar_type() == at::kInt || tables.scalar_type() == at::kLong, kDecode,
              ": block_tables must be int32 or int64, got ", tables.scalar_type());
  TORCH_CHECK(tables.stride(1) == 1, kDecode, ": block_tables' rows must be contiguous, got "
              "strides ", tables.strides());
  TORCH_CHECK(lengths.scalar_type() == at::kInt && lengths.is_contiguous(), kDecode,
              ": lengths must be contiguous int32, got ", lengths.scalar_type());
}

// The shapes agree: one row per sequence everywhere, q's heads over the caches' KV heads.
void check_decode_shapes(const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& tables,
                         const at::Tensor& lengths, int64_t block_size) {
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), kDecode, ": v_cache ", v_cache.sizes(),
              " and k_cache ", k_cache.sizes(), " must have the same shape");
  TORCH_CHECK(tables.size(0) == q.size(0), kDecode, ": block_tables has ", tables.size(0),
              " rows but q has ", q.size(0), " (one per sequence)");
  TORCH_CHECK(lengths.size(0) == q.size(0), kDecode, ": lengths has ", lengths.size(0),
              " entries but q has ", q.size(0), " rows (one per sequence)");
  TORCH_CHECK(q.size(2) == k_cache.size(2), kDecode, ": q's head_dim ", q.size(2),
              " differs from k_cache's ", k_cache.size(2));
  TORCH_CHECK(k_cache.size(1) >= 1 && q.size(1) % k_cache.size(1) == 0, kDecode, ": q's ",
              q.size(1), " heads are not a multiple of k_cache's ", k_cache.size(1), " KV heads");
  TORCH_CHECK(block_size >= 1 && k_cache.size(0) % block_size == 0, kDecode, ": block_size ",
              block_size, " must be >= 1 and divide k_cache's ", k_cache.size(0), " slots");
}

// Every length within [1, table width * block_size], every start (if any) within [0, length),
// and every table entry the span from start to length reaches within the cache. Entries past a
// sequence's length are padding, and those of blocks wholly before its start may hold freed
// blocks: the kernel never reads either, so they may hold anything. One pass over the lengths
// and the entries in use.
template <typename index_t>
void check_tables(const at::Tensor& tables, const at::Tensor& lengths, const int32_t* starts,
                  int64_t block_size, int64_t num_blocks) {
  const index_t* table = data_of<index_t>(tables);
  const int32_t* length = data_of<int32_t>(lengths);
  const int64_t width = tables.size(1), stride = tables.stride(0);
  for (int64_t s = 0; s < lengths.size(0); ++s) {
    TORCH_CHECK(length[s] >= 1, kDecode, ": lengths[", s, "] = ", length[s], " must be >= 1");
    TORCH_CHECK(length[s] <= width * block_size, kDecode, ": lengths[", s, "] = ", length[s],
                " is past block_tables' ", width, " blocks of ", block_size, " tokens");
    if (starts != nullptr) spmd_cpu::check_start(kDecode, s, starts[s], length[s]);
    const int64_t first_block = starts != nullptr ? starts[s] / block_size : 0;
    for (int64_t b = first_block; b < (length[s] + block_size - 1) / block_size; ++b) {
      const int64_t entry = table[s * stride + b];
      TORCH_CHECK(entry >= 0 && entry < num_blocks, kDecode, ": block_tables[", s, "][", b,
                  "] = ", entry, " is outside the cache's ", num_blocks, " blocks");
    }
  }
}

template <typename index_t, typename scalar_t>
void check_and_attend(const Layout& L, const at::Tensor& q, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& tables,
                      const at::Tensor& lengths, const int32_t* starts, at::Tensor& out) {
  check_tables<index_t>(tables, lengths, starts, L.block_size, k_cache.size(0) / L.block_size);
  attend<index_t, scalar_t>(L, q, k_cache, v_cache, tables, lengths, starts, out);
}

template <typename scalar_t>
void attend_any_index(const Layout& L, const at::Tensor& q, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& tables,
                      const at::Tensor& lengths, const int32_t* starts, at::Tensor& out) {
  if (tables.scalar_type() == at::kInt)
    check_and_attend<int32_t, scalar_t>(L, q, k_cache, v_cache, tables, lengths, starts, out);
  else
    check_and_attend<int64_t, scalar_t>(L, q, k_cache, v_cache, tables, lengths, starts, out);
}

// starts: none, or each sequence's first attended context token (a sliding window's start).
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& lengths, int64_t block_size, double scale,
                                  const std::optional<at::Tensor>& starts) {
  check_decode_tensors(q, k_cache, v_cache, block_tables, lengths);
  check_decode_shapes(q, k_cache, v_cache, block_tables, lengths, block_size);
  if (starts.has_value()) spmd_cpu::check_starts(kDecode, *starts, lengths);
  const int32_t* start_ptr = starts.has_value() ? data_of<int32_t>(*starts) : nullptr;
  const int64_t heads = q.size(1), kv_heads = k_cache.size(1);
  Layout layout{kv_heads,       heads / kv_heads,    q.size(2),
                block_size,     kv_heads * q.size(2), q.stride(0),
                q.stride(1),    block_tables.stride(0), static_cast<float>(scale)};
  at::Tensor out = at::empty({q.size(0), heads, q.size(2)}, q.options());
  if (q.scalar_type() == at::kBFloat16)
    attend_any_index<bf16_bits>(layout, q, k_cache, v_cache, block_tables, lengths, start_ptr,
                                out);
  else
    attend_any_index<float>(layout, q, k_cache, v_cache, block_tables, lengths, start_ptr, out);
  return out;
}

constexpr const char* kWrite = "write_kv";

void check_write_args(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& slots) {
  check_tensor(kWrite, "k", k, 3);
  check_tensor(kWrite, "v", v, 3);
  check_tensor(kWrite, "k_cache", k_cache, 3);
  check_tensor(kWrite, "v_cache", v_cache, 3);
  check_tensor(kWrite, "slots", slots, 1);
  check_dtype(kWrite, "v", v, "k", k);
  check_dtype(kWrite, "k_cache", k_cache, "k", k);
  check_dtype(kWrite, "v_cache", v_cache, "k", k);
  TORCH_CHECK(v.sizes() == k.sizes(), kWrite, ": v ", v.sizes(), " and k ", k.sizes(),
              " must have the same shape");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), kWrite, ": v_cache ", v_cache.sizes(),
              " and k_cache ", k_cache.sizes(), " must have the same shape");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), kWrite,
              ": k_cache and v_cache must be contiguous");
  TORCH_CHECK(k_cache.size(1) * k_cache.size(2) == k.size(1) * k.size(2), kWrite, ": k's rows of ",
              k.size(1), " x ", k.size(2), " elements differ from k_cache's rows of ",
              k_cache.size(1), " x ", k_cache.size(2));
  TORCH_CHECK(slots.scalar_type() == at::kLong, kWrite, ": slots must be int64, got ",
              slots.scalar_type());
  TORCH_CHECK(slots.size(0) == k.size(0), kWrite, ": slots has ", slots.size(0),
              " entries but k has ", k.size(0), " tokens (one slot per token)");
}

// Rows of a [tokens, kv_heads, dim] tensor as one contiguous run each (copied if they are not).
at::Tensor packed_rows(const at::Tensor& x) {
  return x.stride(2) == 1 && x.stride(1) == x.size(2) ? x : x.contiguous();
}

// The step's new keys and values into their cache slots, both caches in one pass: k and v
// [tokens, kv_heads, head_dim] (rows may be strided, as views of the fused QKV output), slots
// [tokens] int64. The same copies as index_copy_ on each cache, byte for byte, so float32 and
// bfloat16 rows alike (the caches' dtype, which k and v must share).
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slots) {
  check_write_args(k, v, k_cache, v_cache, slots);
  const at::Tensor kr = packed_rows(k), vr = packed_rows(v), sl = slots.contiguous();
  const int64_t num_slots = k_cache.size(0), item = k.element_size();
  const int64_t* slot = data_of<int64_t>(sl);
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, kWrite, ": slots[", t, "] = ", slot[t],
                " is out of range for the caches' ", num_slots, " slots");
  const int64_t row_bytes = k.size(1) * k.size(2) * item;
  const int64_t k_step = kr.stride(0) * item, v_step = vr.stride(0) * item;
  const char *ks = data_of<char>(kr), *vs = data_of<char>(vr);
  char* kd = static_cast<char*>(k_cache.mutable_data_ptr());
  char* vd = static_cast<char*>(v_cache.mutable_data_ptr());
  at::parallel_for(0, k.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kd + slot[t] * row_bytes, ks + t * k_step, row_bytes);
      std::memcpy(vd + slot[t] * row_bytes, vs + t * v_step, row_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY(spmd_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor lengths, int block_size, float scale, Tensor? starts=None) -> Tensor");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(spmd_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("write_kv", &write_kv);
}
