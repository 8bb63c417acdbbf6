// Causal attention of a fresh prompt (no cached context) on the CPU, float32 or bfloat16, with
// grouped query heads: softmax(q k^T * scale) v over each query's own and earlier positions.
//
// Work is split into tasks of (KV head, block of kBlock query positions). A task stacks the
// block's queries of every query head that shares the KV head into one matrix, so the scores
// are one GEMM of group * kBlock rows against the keys up to the block's end (torch's flash
// kernel runs each query head on its own); the exponentials replace the scores in place (later
// keys zeroed), each head's output is one more GEMM written straight into its columns, and its
// rows are divided by their sums. The products go through the MKL that torch links (its
// Fortran sgemm_), the exponentials through cpu_math.h's polynomial (within a few ulp of
// std::exp), so results differ from SDPA's at float32 rounding. 32-query blocks measured best
// (64 and 128 make fewer, larger GEMMs but waste more of the causal triangle): at 512 tokens
// (SmolLM2's 9 heads over 3) 1.43 against SDPA's 2.42 ms, at 2,048 19.9 against 21.5.
//
// A sliding window W (window > 0) limits query i to keys i - W < j <= i: a block's keys then
// start at its first query's band, so a task reads and multiplies at most kBlock + W - 1 keys
// and a long prompt costs O(tokens * W), not O(tokens^2); inside that span each row's keys
// before its own band are zeroed like the causal ones after it.
//
// bfloat16 q, k and v go through the same float32 GEMMs: each task widens the query, key and
// value rows it reads into float32 scratch, and its output rows are rounded to bfloat16 as they
// are divided by their sums. float32 inputs are read and written in place, as before.
//
// Where the build has AVX512-BF16 (head sizes 64 and 128), bfloat16 prompts skip the widening
// and MKL: each KV head's keys and values are packed once per call (cpu_prompt_tiles.h), and a
// task's scores and value sums are register tiles of VDPBF16PS dot products, float32 sums of
// bf16 products. The softmax weights are rounded to bf16 for the value sums (their float32 sum
// divides the result), as GPU flash kernels do; at 512 tokens this is 3.2x the widened path.
// float32 prompts take the same tiles with FMAs where the build has AVX-512 (head sizes 64 and
// 128): a 512-token SmolLM2 layer 2.0 -> 0.81 ms against the MKL blocks on 2 Zen 5 cores.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "cpu_bf16.h"
#include "cpu_avx512.h"
#include "cpu_prompt_tiles.h"
#include "cpu_math.h"

// MKL's column-major sgemm, exported by an MKL build of torch. Weak: the library still loads
// where torch has no MKL, and prefill_attention then refuses to run (callers check
// torch.backends.mkl.is_available() first).
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc) __attribute__((weak));

namespace spmd_cpu {

// A prompt chunk's block table against a paged cache [slots, kv_heads, dim] (what
// prefill_attention_paged checks of it, and what prompt_layers checks before its first layer):
// returns the blocks the chunk's keys reach as int64, each checked to lie in the cache.
at::Tensor check_prompt_table(const char* op, const at::Tensor& k_cache, const at::Tensor& blocks,
                              int64_t block_size, int64_t first_key, int64_t position,
                              int64_t tokens, int64_t window) {
  spmd_cpu::check_tensor(op, "blocks", blocks, 1);
  TORCH_CHECK(block_size >= 1 && k_cache.size(0) % block_size == 0, op, ": block_size ",
              block_size, " must be >= 1 and divide k_cache's ", k_cache.size(0), " slots");
  TORCH_CHECK(blocks.scalar_type() == at::kInt || blocks.scalar_type() == at::kLong, op,
              ": blocks must be int32 or int64, got ", blocks.scalar_type());
  TORCH_CHECK(blocks.is_contiguous(), op, ": blocks must be contiguous");
  TORCH_CHECK(first_key >= 0 && first_key % block_size == 0, op, ": first_key ", first_key,
              " must be >= 0 and a multiple of block_size ", block_size);
  TORCH_CHECK(position >= first_key, op, ": position ", position, " is before first_key ",
              first_key);
  TORCH_CHECK(window >= 0, op, ": window ", window, " must be >= 0");
  const int64_t keys = position + tokens - first_key;
  TORCH_CHECK(keys <= blocks.size(0) * block_size, op, ": the chunk's keys reach ", keys,
              " tokens past first_key but blocks holds ", blocks.size(0), " blocks of ",
              block_size);
  const int64_t used = (keys + block_size - 1) / block_size;
  const int64_t num_blocks = k_cache.size(0) / block_size;
  at::Tensor table = blocks.narrow(0, 0, used).to(at::kLong);
  const int64_t* entry = table.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < used; ++b)
    TORCH_CHECK(entry[b] >= 0 && entry[b] < num_blocks, op, ": blocks[", b, "] = ", entry[b],
                " is outside the cache's ", num_blocks, " blocks");
  return table;
}

}  // namespace spmd_cpu

namespace {

using spmd_cpu::bf16_bits;

// C (m x n) = alpha op(A) op(B), column-major, op: 'N' or 'T'.
void gemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc) {
  const int M = m, N = n, K = k, LDA = lda, LDB = ldb, LDC = ldc;
  const float zero = 0.f;
  sgemm_(&transa, &transb, &M, &N, &K, &alpha, a, &LDA, b, &LDB, &zero, c, &LDC);
}

constexpr int64_t kBlock = 32;

struct Shape {
  int64_t tokens, heads, kv_heads, group, dim;
  int64_t q_stride, k_stride, v_stride;     // elements between consecutive positions
  float scale;
  int64_t window;                           // keys a query sees (itself included); 0: all
  int64_t query0 = 0;                       // the key index of query 0 (its cached context)
};

template <typename scalar_t>
struct Operands {
  const scalar_t *q, *k, *v;
  scalar_t* out;
};

// A thread's buffers, reused across its tasks (keys, values, rows: bfloat16 inputs only).
struct Scratch {
  std::vector<float> queries, scores, inverse, keys, values, rows;
};

// n elements as float32 (a plain copy for float32).
inline void widen(const float* src, float* dst, int64_t n) { std::copy_n(src, n, dst); }
inline void widen(const bf16_bits* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = spmd_cpu::bf16_to_float(src[i]);
}

// A GEMM operand: float32 rows `ld` elements apart.
struct Rows {
  const float* data;
  int64_t ld;
};

// `n` rows of D elements, `stride` apart, for a GEMM: float32 ones where they lie, bfloat16
// ones widened into `buffer`.
inline Rows float_rows(const float* rows, int64_t stride, int64_t, int64_t, std::vector<float>&) {
  return {rows, stride};
}
inline Rows float_rows(const bf16_bits* rows, int64_t stride, int64_t n, int64_t D,
                       std::vector<float>& buffer) {
  buffer.resize(n * D);
  for (int64_t i = 0; i < n; ++i) widen(rows + i * stride, buffer.data() + i * D, D);
  return {buffer.data(), D};
}

// Divides `rows` output rows (D each, `ld_src` apart) by their weights' sums and stores them in
// the output's dtype: in place for float32, rounding the GEMM's float32 scratch for bfloat16.
template <typename scalar_t>
void scale_rows(const float* src, int64_t ld_src, scalar_t* dst, int64_t ld_dst,
                const float* inverse, int64_t rows, int64_t D) {
  for (int64_t i = 0; i < rows; ++i) {
    const float inv = inverse[i];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d)
      spmd_cpu::store_from_float(dst + i * ld_dst + d, src[i * ld_src + d] * inv);
  }
}

// The block's queries of the G heads of KV head `kv`, stacked: [G * rows, D] float32.
template <typename scalar_t>
void stack_queries(const Shape& S, const scalar_t* q, int64_t kv, int64_t first, int64_t rows,
                   std::vector<float>& queries) {
  const int64_t D = S.dim, G = S.group;
  queries.resize(G * rows * D);
  for (int64_t h = 0; h < G; ++h)
    for (int64_t i = 0; i < rows; ++i)
      widen(q + (first + i) * S.q_stride + (kv * G + h) * D, queries.data() + (h * rows + i) * D,
            D);
}

// Each score row's causal softmax in place over the block's keys key0 .. key0 + keys - 1 (keys
// past the row's position, and with a window those before its band, zeroed); keeps 1 / each
// row's sum in `inverse`.
void causal_softmax(const Shape& S, int64_t first, int64_t rows, int64_t key0, int64_t keys,
                    Scratch& s) {
  s.inverse.resize(S.group * rows);
  for (int64_t r = 0; r < S.group * rows; ++r) {
    float* row = s.scores.data() + r * keys;
    const int64_t position = first + r % rows, end = position + 1 - key0;
    const int64_t begin = S.window > 0 ? std::max<int64_t>(end - S.window, 0) : 0;
    const int64_t n = end - begin;
    s.inverse[r] = 1.f / spmd_cpu::exp_row(row + begin, n, spmd_cpu::row_max(row + begin, n));
    std::fill(row, row + begin, 0.f);
    std::fill(row + end, row + keys, 0.f);
  }
}

// One task: KV head `kv`, query positions [first, end), against keys [key0, end): all earlier
// positions, or with a window those inside the first query's band.
template <typename scalar_t>
void attend_block(const Shape& S, const Operands<scalar_t>& x, int64_t kv, int64_t first,
                  int64_t end, Scratch& s) {
  const int64_t key0 = S.window > 0 ? std::max<int64_t>(first - S.window + 1, 0) : 0;
  const int64_t rows = end - first, keys = end - key0, D = S.dim, G = S.group;
  const int64_t ld_out = S.heads * D;
  stack_queries(S, x.q, kv, first, rows, s.queries);
  const Rows K = float_rows(x.k + key0 * S.k_stride + kv * D, S.k_stride, keys, D, s.keys);
  const Rows V = float_rows(x.v + key0 * S.v_stride + kv * D, S.v_stride, keys, D, s.values);
  s.scores.resize(G * rows * keys);
  // scores^T (keys x G*rows, column-major) = K (keys x D) . queries^T, scaled.
  gemm('T', 'N', keys, G * rows, D, S.scale, K.data, K.ld, s.queries.data(), D, s.scores.data(),
       keys);
  causal_softmax(S, first, rows, key0, keys, s);
  // Each head: out rows (D x rows, column-major) = V^T . weights^T, then each row divided by
  // its weights' sum. float32 output takes the GEMM's result in place (ld heads * D).
  s.rows.resize(std::is_same_v<scalar_t, float> ? 0 : rows * D);
  for (int64_t h = 0; h < G; ++h) {
    scalar_t* o = x.out + first * ld_out + (kv * G + h) * D;
    float* product = s.rows.data();
    int64_t ld = D;
    if constexpr (std::is_same_v<scalar_t, float>) product = o, ld = ld_out;
    gemm('N', 'N', D, rows, keys, 1.f, V.data, V.ld, s.scores.data() + h * rows * keys, keys,
         product, ld);
    scale_rows(product, ld, o, ld_out, s.inverse.data() + h * rows, rows, D);
  }
}

constexpr const char* kPrefill = "prefill_attention";

// The GEMMs read a position's heads as one row of heads * dim elements.
void check_side_by_side(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), op, ": ", name,
              "'s heads of each position must lie side by side (strides [*, ", t.size(2),
              ", 1]), got strides ", t.strides());
}

void check_prefill_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  spmd_cpu::check_tensor(kPrefill, "q", q, 3);
  spmd_cpu::check_tensor(kPrefill, "k", k, 3);
  spmd_cpu::check_tensor(kPrefill, "v", v, 3);
  spmd_cpu::check_dtype(kPrefill, "k", k, "q", q);
  spmd_cpu::check_dtype(kPrefill, "v", v, "q", q);
  TORCH_CHECK(v.sizes() == k.sizes(), kPrefill, ": v ", v.sizes(), " and k ", k.sizes(),
              " must have the same shape");
  TORCH_CHECK(k.size(0) == q.size(0), kPrefill, ": k has ", k.size(0), " tokens but q has ",
              q.size(0));
  TORCH_CHECK(k.size(2) == q.size(2), kPrefill, ": k's head_dim ", k.size(2),
              " differs from q's ", q.size(2));
  TORCH_CHECK(k.size(1) >= 1 && q.size(1) % k.size(1) == 0, kPrefill, ": q's ", q.size(1),
              " heads are not a multiple of k's ", k.size(1), " KV heads");
  TORCH_CHECK(sgemm_ != nullptr, kPrefill, ": this torch has no MKL");
  check_side_by_side(kPrefill, "q", q);
  check_side_by_side(kPrefill, "k", k);
  check_side_by_side(kPrefill, "v", v);
}

// Tasks in pairs of a long and a short block (b, blocks - 1 - b), so the even split of the
// range between threads gives each about the same work.
std::vector<std::pair<int64_t, int64_t>> balanced_tasks(int64_t kv_heads, int64_t tokens) {
  const int64_t blocks = (tokens + kBlock - 1) / kBlock;
  std::vector<std::pair<int64_t, int64_t>> tasks;
  for (int64_t kv = 0; kv < kv_heads; ++kv)
    for (int64_t i = 0; i < blocks; ++i)
      tasks.emplace_back(kv, i % 2 == 0 ? i / 2 : blocks - 1 - i / 2);
  return tasks;
}

template <typename scalar_t>
void run_tasks(const Shape& S, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               at::Tensor& out) {
  const Operands<scalar_t> x{static_cast<const scalar_t*>(q.const_data_ptr()),
                             static_cast<const scalar_t*>(k.const_data_ptr()),
                             static_cast<const scalar_t*>(v.const_data_ptr()),
                             static_cast<scalar_t*>(out.mutable_data_ptr())};
  const auto tasks = balanced_tasks(S.kv_heads, S.tokens);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t task = begin; task < end; ++task) {
      const auto [kv, b] = tasks[task];
      attend_block(S, x, kv, b * kBlock, std::min(S.tokens, (b + 1) * kBlock), scratch);
    }
  });
}

#if defined(__AVX512F__)
// One KV head's keys and values packed for the tiles (cpu_prompt_tiles.h), padded to whole
// score tiles.
template <class E>
struct PackedHead {
  spmd_cpu::ScratchArray<uint32_t> keys;   // written whole by pack_keys
  spmd_cpu::ScratchArray<E> values;        // and pack_values
};

// A thread's buffers for the tiles, reused across its tasks and calls (each task writes what it
// reads of them).
template <class E>
struct TileScratch {
  spmd_cpu::ScratchArray<E> queries, weights;
  spmd_cpu::ScratchArray<float> scores, inverse;
};

constexpr int kTileRows = 6;   // query rows per score tile: 6 x 4 accumulators

// Scores of `rows` (<= kTileRows) query rows against `groups` (1-4) groups of 16 keys.
template <class E>
void score_tile(int64_t rows, int64_t groups, const E* q, int64_t D, const uint32_t* keys,
                float scale, float* s, int64_t lds) {
  spmd_cpu::with_row_count<1, kTileRows>(rows, [&](auto r) {
    spmd_cpu::with_row_count<1, 4>(groups, [&](auto t) {
      spmd_cpu::qk_tile<decltype(r)::value, decltype(t)::value>(q, D, keys, D, scale, s, lds);
    });
  });
}

// Value sums for `rows` weight rows (at most 24 / DV), DV * 16 dimensions.
template <int DV, class E>
void sum_tile(int64_t rows, const E* w, int64_t ldw, const E* values, int64_t words,
              const float* inverse, E* const* out) {
  spmd_cpu::with_row_count<1, 24 / DV>(rows, [&](auto r) {
    spmd_cpu::pv_tile<decltype(r)::value, DV>(w, ldw, values, words, inverse, out);
  });
}

// Each score row's softmax over its own keys (causal, and inside the window), as weights over
// the task's `width` keys from ks (zero elsewhere); 1 / each row's float32 sum kept.
template <class E>
void softmax_weights(const Shape& S, int64_t first, int64_t rows, int64_t ks, int64_t width,
                     TileScratch<E>& s) {
  const int64_t M = S.group * rows;
  s.weights.resize(M * width);
  s.inverse.resize(M);
  for (int64_t m = 0; m < M; ++m) {
    float* row = s.scores.data() + m * width;
    E* w = s.weights.data() + m * width;
    const int64_t own = S.query0 + first + m % rows;       // the query's own key
    const int64_t lo = S.window > 0 ? std::max<int64_t>(own - S.window + 1, 0) : 0;
    const int64_t begin = lo - ks, end = own + 1 - ks, n = end - begin;
    std::fill(w, w + begin, E{});
    s.inverse[m] = spmd_cpu::softmax_row(row + begin, n, w + begin);
    std::fill(w + end, w + width, E{});
  }
}

// One task on the tiles: KV head `kv`, queries [first, end) (keys from query0 + first back to
// the window's start, or to key 0).
template <int DV, class E>
void attend_block_tiles(const Shape& S, const E* q, E* out, const PackedHead<E>& head,
                        int64_t kv, int64_t first, int64_t end, TileScratch<E>& s) {
  using spmd_cpu::kKeyGroup;
  using spmd_cpu::kKeyTile;
  constexpr int64_t P = spmd_cpu::kPerWord<E>;
  const int64_t D = S.dim, G = S.group, rows = end - first, M = G * rows;
  const int64_t own0 = S.query0 + first, own_end = S.query0 + end;
  const int64_t key0 = S.window > 0 ? std::max<int64_t>(own0 - S.window + 1, 0) : 0;
  const int64_t ks = key0 / kKeyTile * kKeyTile;
  const int64_t width = (own_end + kKeyTile - 1) / kKeyTile * kKeyTile - ks;
  s.queries.resize(M * D);
  for (int64_t h = 0; h < G; ++h)
    for (int64_t i = 0; i < rows; ++i)
      std::copy_n(q + (first + i) * S.q_stride + (kv * G + h) * D, D,
                  s.queries.data() + (h * rows + i) * D);
  // Stacked rows m .. m + n - 1 (query (m + r) % rows of head (m + r) / rows) attend keys up
  // to their latest query's own: the keys from ks a tile of them reads (later scores are not
  // made, later weights are zero).
  const auto tile_keys = [&](int64_t m, int64_t n) {
    const int64_t latest = m / rows == (m + n - 1) / rows ? (m + n - 1) % rows : rows - 1;
    return own0 + latest + 1 - ks;
  };
  s.scores.resize(M * width);
  for (int64_t m = 0; m < M; m += kTileRows) {
    const int64_t n = std::min<int64_t>(kTileRows, M - m), keys = tile_keys(m, n);
    for (int64_t key = 0; key < keys; key += kKeyTile)
      score_tile(n, std::min<int64_t>(4, (keys - key + kKeyGroup - 1) / kKeyGroup),
                 s.queries.data() + m * D, D,
                 head.keys.data() + (ks + key) / kKeyGroup * (D / P) * kKeyGroup, S.scale,
                 s.scores.data() + m * width + key, width);
  }
  softmax_weights(S, first, rows, ks, width, s);
  constexpr int64_t kSumRows = 24 / DV;
  E* targets[kSumRows];
  for (int64_t m = 0; m < M; m += kSumRows) {
    const int64_t n = std::min<int64_t>(kSumRows, M - m);
    for (int64_t r = 0; r < n; ++r)
      targets[r] = out + (first + (m + r) % rows) * S.heads * D + (kv * G + (m + r) / rows) * D;
    sum_tile<DV>(n, s.weights.data() + m * width, width, head.values.data() + ks * D,
                 (tile_keys(m, n) + P - 1) / P, s.inverse.data() + m, targets);
  }
}

// Packs each KV head's keys 0 .. query0 + tokens - 1 (key_row(kv, key) and value_row: their
// rows), then runs the tasks.
template <int DV, class E, typename KeyRow, typename ValueRow>
void run_tasks_tiles(const Shape& S, const at::Tensor& q, at::Tensor& out, KeyRow key_row,
                     ValueRow value_row) {
  const auto* qp = static_cast<const E*>(q.const_data_ptr());
  auto* op = static_cast<E*>(out.mutable_data_ptr());
  const int64_t D = S.dim, keys = S.query0 + S.tokens;
  const int64_t n_pad = (keys + spmd_cpu::kKeyTile - 1) / spmd_cpu::kKeyTile * spmd_cpu::kKeyTile;
  std::vector<PackedHead<E>> heads(S.kv_heads);
  for (auto& head : heads) {
    head.keys.resize(n_pad * D / spmd_cpu::kPerWord<E>);
    head.values.resize(n_pad * D);
  }
  // Tasks of (KV head, score tile of keys), so that both threads pack whatever the head count.
  const int64_t chunks = n_pad / spmd_cpu::kKeyTile;
  at::parallel_for(0, S.kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv = task / chunks, k0 = task % chunks * spmd_cpu::kKeyTile;
      const int64_t k1 = k0 + spmd_cpu::kKeyTile;
      spmd_cpu::pack_keys<E>([&](int64_t key) { return key_row(kv, key); }, keys, k0, k1, D,
                             heads[kv].keys.data());
      spmd_cpu::pack_values<E>([&](int64_t key) { return value_row(kv, key); }, keys, k0, k1, D,
                               heads[kv].values.data());
    }
  });
  const auto tasks = balanced_tasks(S.kv_heads, S.tokens);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    static thread_local TileScratch<E> scratch;
    for (int64_t task = begin; task < end; ++task) {
      const auto [kv, b] = tasks[task];
      attend_block_tiles<DV>(S, qp, op, heads[kv], kv, b * kBlock,
                             std::min(S.tokens, (b + 1) * kBlock), scratch);
    }
  });
}

// run_tasks_tiles for this head size (64 or 128); false for others.
template <class E, typename KeyRow, typename ValueRow>
bool run_tiles(const Shape& S, const at::Tensor& q, at::Tensor& out, KeyRow key_row,
               ValueRow value_row) {
  switch (S.dim) {
    case 64: run_tasks_tiles<4, E>(S, q, out, key_row, value_row); return true;
    case 128: run_tasks_tiles<8, E>(S, q, out, key_row, value_row); return true;
    default: return false;
  }
}
#endif  // __AVX512F__

// Whether this build runs prompts of this element type on the tiles: float32 with AVX-512,
// bfloat16 with AVX512-BF16.
template <class E>
constexpr bool kTiles =
#if defined(__AVX512BF16__)
    true;
#elif defined(__AVX512F__)
    std::is_same_v<E, float>;
#else
    false;
#endif

// Runs a prompt on the tiles where the build and head size allow; false where it did not.
template <class E>
bool run_prompt_tiles([[maybe_unused]] const Shape& S, [[maybe_unused]] const at::Tensor& q,
                      [[maybe_unused]] const at::Tensor& k, [[maybe_unused]] const at::Tensor& v,
                      [[maybe_unused]] at::Tensor& out) {
#if defined(__AVX512F__)
  if constexpr (kTiles<E>) {
    const auto* kp = static_cast<const E*>(k.const_data_ptr());
    const auto* vp = static_cast<const E*>(v.const_data_ptr());
    return run_tiles<E>(
        S, q, out, [&](int64_t kv, int64_t key) { return kp + key * S.k_stride + kv * S.dim; },
        [&](int64_t kv, int64_t key) { return vp + key * S.v_stride + kv * S.dim; });
  }
#endif
  return false;
}

// q [tokens, heads, dim], k and v [tokens, kv_heads, dim] (rows may be strided, as views of the
// fused QKV output; each head's dim contiguous), all float32 or all bfloat16. window: 0 for
// plain causal attention, W > 0 for a sliding window of the last W positions (the query's own
// included). Returns [tokens, heads, dim] in their dtype.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             double scale, int64_t window) {
  check_prefill_args(q, k, v);
  TORCH_CHECK(window >= 0, kPrefill, ": window ", window,
              " must be >= 0 (0: no window, W: the last W positions)");
  const int64_t heads = q.size(1), kv_heads = k.size(1), dim = q.size(2);
  const Shape S{q.size(0),   heads,       kv_heads,    heads / kv_heads,         dim,
                q.stride(0), k.stride(0), v.stride(0), static_cast<float>(scale), window};
  at::Tensor out = at::empty({S.tokens, heads, dim}, q.options());
  if (q.scalar_type() != at::kBFloat16) {
    if (!run_prompt_tiles<float>(S, q, k, v, out)) run_tasks<float>(S, q, k, v, out);
  } else if (!run_prompt_tiles<bf16_bits>(S, q, k, v, out)) {
    run_tasks<bf16_bits>(S, q, k, v, out);
  }
  return out;
}

constexpr const char* kPaged = "prefill_attention_paged";

// Whether prefill_attention_paged runs for this head size: a build with AVX512-BF16 and head
// sizes 64 or 128 (bfloat16 caches only).
bool paged_prompt_supported(int64_t head_dim) {
#if defined(__AVX512BF16__)
  return head_dim == 64 || head_dim == 128;
#else
  return false;
#endif
}

// Checks every argument; returns the blocks the chunk's keys reach as int64, each checked to lie
// in the cache.
at::Tensor check_paged_args(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& blocks,
                            int64_t block_size, int64_t first_key, int64_t position,
                            int64_t window) {
  spmd_cpu::check_tensor(kPaged, "q", q, 3);
  spmd_cpu::check_tensor(kPaged, "k_cache", k_cache, 3);
  spmd_cpu::check_tensor(kPaged, "v_cache", v_cache, 3);
  spmd_cpu::check_dtype(kPaged, "k_cache", k_cache, "q", q);
  spmd_cpu::check_dtype(kPaged, "v_cache", v_cache, "q", q);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && paged_prompt_supported(q.size(2)), kPaged,
              ": runs bfloat16 with head_dim 64 or 128 on a build with AVX512-BF16 (ask "
              "paged_prompt_supported), got ", q.scalar_type(), " and head_dim ", q.size(2));
  check_side_by_side(kPaged, "q", q);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes(), kPaged,
              ": k_cache and v_cache must be contiguous and of the same shape, got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(k_cache.size(2) == q.size(2) && k_cache.size(1) >= 1 &&
              q.size(1) % k_cache.size(1) == 0, kPaged, ": q ", q.sizes(),
              " does not fit the caches' KV heads ", k_cache.sizes());
  return spmd_cpu::check_prompt_table(kPaged, k_cache, blocks, block_size, first_key, position,
                                      q.size(0), window);
}

// A prompt chunk whose earlier tokens are cached: q [tokens, heads, dim] at positions
// position .. position + tokens - 1, its own and earlier keys and values read from the paged
// caches [slots, kv_heads, dim] (the chunk's own already written), key first_key + j in slot
// blocks[j / block_size] * block_size + j % block_size. Causal, within the last `window`
// positions where window > 0. bfloat16 on the VDPBF16PS tiles only (paged_prompt_supported).
at::Tensor prefill_attention_paged(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& blocks,
                                   int64_t block_size, int64_t first_key, int64_t position,
                                   double scale, int64_t window) {
  const at::Tensor table =
      check_paged_args(q, k_cache, v_cache, blocks, block_size, first_key, position, window);
  const int64_t heads = q.size(1), kv_heads = k_cache.size(1), dim = q.size(2);
  const int64_t slot_stride = kv_heads * dim;
  Shape S{q.size(0),   heads,       kv_heads,    heads / kv_heads,         dim,
          q.stride(0), slot_stride, slot_stride, static_cast<float>(scale), window};
  S.query0 = position - first_key;
  at::Tensor out = at::empty({S.tokens, heads, dim}, q.options());
#if defined(__AVX512BF16__)
  const int64_t* entry = table.const_data_ptr<int64_t>();
  const auto* kp = static_cast<const bf16_bits*>(k_cache.const_data_ptr());
  const auto* vp = static_cast<const bf16_bits*>(v_cache.const_data_ptr());
  const auto slot = [&](int64_t key) {
    return (entry[key / block_size] * block_size + key % block_size) * slot_stride;
  };
  run_tiles<bf16_bits>(S, q, out,
                       [&](int64_t kv, int64_t key) { return kp + slot(key) + kv * dim; },
                       [&](int64_t kv, int64_t key) { return vp + slot(key) + kv * dim; });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spmd_cpu, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale, int window=0) -> Tensor");
  m.def("prefill_attention_paged(Tensor q, Tensor k_cache, Tensor v_cache, Tensor blocks, "
        "int block_size, int first_key, int position, float scale, int window=0) -> Tensor");
  m.def("paged_prompt_supported(int head_dim) -> bool", &paged_prompt_supported);
}

TORCH_LIBRARY_IMPL(spmd_cpu, CPU, m) {
  m.impl("prefill_attention", &prefill_attention);
  m.impl("prefill_attention_paged", &prefill_attention_paged);
}
