// 8-bit activations times a GGUF projection's blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), for
// `--quantization int8` over a GGUF file (included in cpu_group_quant.cpp, inside its namespace,
// after unpack_block). The weights stay the file's: no rounding of them, no copy at load.
//
// Each row of x is quantized per block of 32 inputs, as llama.cpp's Q8 activations are: its
// step d = max |x| / 127 and codes q = round(x * 127 / max |x|) in int8, with d * sum(q) kept
// for the blocks' offsets. A block's weights w = a (u - zero) + c, u its unsigned codes (Q8_0's signed
// codes shifted by 128), so the block's share of a row's sum is
//     a d sum(u q) + (c - a zero) d sum(q),
// sum(u q) from VPDPBUSD (unsigned x signed bytes, four products a lane a step: 64 a
// instruction, twice VDPBF16PS's 32, at the same rate on Zen 5). Each task unpacks a panel of
// 32 output features into [block][four inputs][feature] code words once per call, and every
// row's tile of 6 rows x 32 features multiplies it: eight VPDPBUSD a block a register of
// sums, then one conversion, one multiply and two FMAs fold it into float32 (1.48x the bf16
// tile's multiply-adds a second, measured alone). With the next panel fetched while this one
// unpacks, the panels beat a first transposed form with the rows in the vector lanes at 16-32
// rows (SmolLM2's four products from memory at 16 rows 152-154 against 225-230 us a layer,
// equal at 32). The lane tiles below (q4_1_lane_product) fetch each tile's weights a block
// ahead and take two registers of rows a broadcast: 17-32 rows against Q4_1 blocks take them
// (SmolLM2's 120 decode products at 32 rows 7.1 against 8.0-8.6 ms; at 16, 48 and 64 rows the
// panels were as fast or faster). A product may also add a residual or finish a gate/up
// projection's SiLU x up (Int8Out), from the tiles' sums parked per task (finish_rows).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SPMD_GGUF_INT8 1

constexpr int64_t kInt8Panel = 32;   // output features a panel holds (two registers)
constexpr int kInt8TileRows = 6;     // rows of a tile: 12 integer and 12 float accumulators

// x's rows as 8-bit codes per block of 32: codes [M, K], step [M, K / 32], and step * the
// block's code sum [M, K / 32].
struct Int8Rows {
  std::vector<int8_t> codes;
  std::vector<float> step, sum;
};

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const spmd_cpu::bf16_bits* p) { return spmd_cpu::vload_bf16(p); }

// The codes of x [M, K] (float32 or bf16), a block of 32 at a time: q = round(x * (127 / max))
// (nearest, ties to even), the step max / 127; an all-zero block has step 0 and codes 0.
template <class E>
void quantize_rows_int8(const E* x, int64_t M, int64_t K, Int8Rows& out) {
  const int64_t B = K / kBlock;
  out.codes.resize(M * K);
  out.step.resize(M * B);
  out.sum.resize(M * B);
  // Decode batches quantize on the calling thread: a fork and join costs more than their rows.
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < B; ++b) {
        const E* src = x + r * K + b * kBlock;
        const __m512 low = load16(src), high = load16(src + 16);
        const float most =
            _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
        const __m512 inverse = _mm512_set1_ps(most > 0.f ? 127.f / most : 0.f);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse));
        int8_t* dst = out.codes.data() + r * K + b * kBlock;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(q1));
        const float step = most / 127.f;
        out.step[r * B + b] = step;
        const int total = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        out.sum[r * B + b] = step * static_cast<float>(total);
      }
  });
}

// x's rows with 16 rows in the lanes of a register (the lane tiles: Q4_1 products here, the
// Q8_0 greedy head in cpu_int8_head.h): word p of a block's codes of rows 16 g .. 16 g + 15,
// and per block the rows' steps, step x code sums, and -128 x code sums (the Q8_0 tiles' shift
// of the weights' codes to unsigned bytes). Padding rows have zero codes and steps.
struct LaneRows {
  int64_t groups;                 // register rows of 16 (the last padded with zero codes)
  std::vector<__m512i> codes;     // [group][block][word p]: lane r = row 16 g + r's codes 4p..4p+3
  std::vector<__m512i> shift;     // [group][block]: lane r = -128 x the sum of that block's codes
  std::vector<__m512> step;       // [group][block]: lane r = that block's step (0: padding)
  std::vector<__m512> sum;        // [group][block]: lane r = its step x its codes' sum
};

inline void lane_rows(const Int8Rows& x, int64_t M, int64_t K, LaneRows& out) {
  const int64_t B = K / kBlock;
  out.groups = (M + 15) / 16;
  out.codes.assign(out.groups * B * 8, _mm512_setzero_si512());
  out.shift.assign(out.groups * B, _mm512_setzero_si512());
  out.step.assign(out.groups * B, _mm512_setzero_ps());
  out.sum.assign(out.groups * B, _mm512_setzero_ps());
  for (int64_t r = 0; r < M; ++r) {
    const int64_t g = r / 16, lane = r % 16;
    for (int64_t b = 0; b < B; ++b) {
      const int8_t* q = x.codes.data() + r * K + b * kBlock;
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
      // sum(q + 128) by SAD against zero, less 32 x 128.
      const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(bytes, _mm256_set1_epi8(-128)),
                                          _mm256_setzero_si256());
      const int64_t total = _mm256_extract_epi64(sad, 0) + _mm256_extract_epi64(sad, 1) +
                            _mm256_extract_epi64(sad, 2) + _mm256_extract_epi64(sad, 3) - 4096;
      int32_t* words = reinterpret_cast<int32_t*>(out.codes.data() + (g * B + b) * 8);
      for (int p = 0; p < 8; ++p) std::memcpy(words + p * 16 + lane, q + 4 * p, 4);
      reinterpret_cast<int32_t*>(out.shift.data() + g * B + b)[lane] =
          static_cast<int32_t>(-128 * total);
      reinterpret_cast<float*>(out.step.data() + g * B + b)[lane] = x.step[r * B + b];
      reinterpret_cast<float*>(out.sum.data() + g * B + b)[lane] = x.sum[r * B + b];
    }
  }
}

// Block `s`'s 32 codes as unsigned bytes (Q8_0's signed ones shifted by 128), with its scale a
// and its offset c - a zero: w = a u + offset.
template <int64_t KIND>
inline __m256i unsigned_block(const uint8_t* s, float& scale, float& offset) {
  Affine affine;
  __m256i codes = unpack_block<KIND>(s, affine);
  if constexpr (KIND == kQ8_0) codes = _mm256_xor_si256(codes, _mm256_set1_epi8(-128));
  scale = affine.a;
  offset = KIND == kQ8_0 ? -128.f * affine.a : affine.c - affine.a * static_cast<float>(affine.zero);
  return codes;
}

// One block's integer sums folded into float32 sums: acc + (sums step) scale + offset sum.
inline __m512 fold_block(__m512 acc, __m512i sums, __m512 step, __m512 scale, __m512 offset,
                         __m512 sum) {
  acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), step), scale, acc);
  return _mm512_fmadd_ps(offset, sum, acc);
}

// A panel's weights for int8_tile: codes[(b * 8 + p) * 32 + f] (32-bit words) holds feature
// f's unsigned codes of inputs 32b + 4p .. 32b + 4p + 3; scale[b * 32 + f] its block b's a,
// offset[b * 32 + f] its c - a zero. Features past the weight's last are zero. `rows`: the
// codes feature by feature on the way (8 words a block, an even count of blocks).
struct Int8Panel {
  std::vector<uint32_t> codes, rows;
  std::vector<float> scale, offset;
};

// unpack_int8_panel for Q4_0, Q4_1 and Q8_0, 16 features at a time. Dword p of a block's code
// bytes from byte 16 h on holds (Q4) words p (low nibbles) and 4 + p (high nibbles) of the
// panel's layout, or (Q8_0, h = 0 and 1) word 4 h + p: four features' 16 bytes are loaded to a
// register (one a 128-bit lane), four registers transposed to dword p of all 16 features (a
// 4 x 4 dword transpose in each lane, then one permutation), and the nibbles split (Q8_0's
// signed codes shifted by 128 instead); the blocks' scales (and Q4_1's minimums) are gathered
// 16 at a time. Features past `count` repeat the last one (their outputs are never stored).
// ~5x fewer operations than unpacking each block and transposing the words (at 64 SmolLM2 rows
// the unpacking was ~20% of the product; the Q8_0 LM head's product at 64 rows took 3.7 ms with
// that, 2.9-3.0 with this).
template <int64_t KIND>
void unpack_transposed_panel(const uint8_t* blocks, int64_t row_bytes, int64_t K, int64_t f0,
                             int64_t count, Int8Panel& panel) {
  static_assert(KIND == kQ4_0 || KIND == kQ4_1 || KIND == kQ8_0);
  constexpr int64_t kBytes = block_format(KIND).bytes, kCodesAt = KIND == kQ4_1 ? 4 : 2;
  const int64_t B = K / kBlock;
  panel.codes.resize((B + 1) / 2 * 2 * 8 * kInt8Panel);
  panel.scale.resize(B * kInt8Panel);
  panel.offset.resize(B * kInt8Panel);
  const __m512i nibble = _mm512_set1_epi8(0x0F), sign = _mm512_set1_epi8(-128);
  // Transposed, lane l of y[p] holds dword p of features l, 4 + l, 8 + l, 12 + l: back in order.
  const __m512i in_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const auto bytes16 = [](const uint8_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  };
  // The next panel's bytes (one run, just past this one's) fetched to L2 while this one's are
  // unpacked: its rows interleave 16 streams, which the hardware prefetcher missed.
  const char* ahead = reinterpret_cast<const char*>(blocks + (f0 + kInt8Panel) * row_bytes);
  const char* const ahead_end = ahead + (count == kInt8Panel ? kInt8Panel * row_bytes : 0);
  constexpr int kAheadLines = (kBytes + 3) / 4;   // 2 B iterations cover 32 rows of B kBytes
  for (int64_t half = 0; half < kInt8Panel; half += 16) {
    const uint8_t* rows[16];
    alignas(64) int32_t apart[16];
    for (int f = 0; f < 16; ++f) {
      rows[f] = blocks + (f0 + std::min<int64_t>(half + f, count - 1)) * row_bytes;
      apart[f] = static_cast<int32_t>(rows[f] - rows[0]);
    }
    // Dword p (0-3) of the 16 bytes from `at` of each of the 16 features' rows, in order.
    const auto dwords = [&](int64_t at, __m512i out[4]) {
      __m512i x[4];
      for (int k = 0; k < 4; ++k) {
        x[k] = _mm512_castsi128_si512(bytes16(rows[4 * k] + at));
        x[k] = _mm512_inserti32x4(x[k], bytes16(rows[4 * k + 1] + at), 1);
        x[k] = _mm512_inserti32x4(x[k], bytes16(rows[4 * k + 2] + at), 2);
        x[k] = _mm512_inserti32x4(x[k], bytes16(rows[4 * k + 3] + at), 3);
      }
      const __m512i t0 = _mm512_unpacklo_epi32(x[0], x[1]), t1 = _mm512_unpackhi_epi32(x[0], x[1]);
      const __m512i t2 = _mm512_unpacklo_epi32(x[2], x[3]), t3 = _mm512_unpackhi_epi32(x[2], x[3]);
      const __m512i y[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                            _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
      for (int p = 0; p < 4; ++p) out[p] = _mm512_permutexvar_epi32(in_order, y[p]);
    };
    const __m512i gather_at = _mm512_load_si512(apart);
    for (int64_t b = 0; b < B; ++b) {
      for (int l = 0; l < kAheadLines && ahead < ahead_end; ++l, ahead += 64)
        _mm_prefetch(ahead, _MM_HINT_T1);
      const int64_t at = b * kBytes + kCodesAt;
      uint32_t* words = panel.codes.data() + b * 8 * kInt8Panel + half;
      __m512i dword[4];
      dwords(at, dword);
      for (int p = 0; p < 4; ++p) {
        if constexpr (KIND == kQ8_0) {
          _mm512_storeu_si512(words + p * kInt8Panel, _mm512_xor_si512(dword[p], sign));
        } else {
          _mm512_storeu_si512(words + p * kInt8Panel, _mm512_and_si512(dword[p], nibble));
          _mm512_storeu_si512(words + (p + 4) * kInt8Panel,
                              _mm512_and_si512(_mm512_srli_epi16(dword[p], 4), nibble));
        }
      }
      if constexpr (KIND == kQ8_0) {
        dwords(at + 16, dword);
        for (int p = 0; p < 4; ++p)
          _mm512_storeu_si512(words + (p + 4) * kInt8Panel, _mm512_xor_si512(dword[p], sign));
      }
      // d (and Q4_1's minimum m above it) of the 16 blocks: w = d u + m, d (u - 8) or
      // d (u - 128).
      const __m512i head = _mm512_i32gather_epi32(gather_at, rows[0] + b * kBytes, 1);
      const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
      const __m512 offset = KIND == kQ4_1
          ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)))
          : _mm512_mul_ps(d, _mm512_set1_ps(KIND == kQ8_0 ? -128.f : -8.f));
      _mm512_storeu_ps(panel.scale.data() + b * kInt8Panel + half, d);
      _mm512_storeu_ps(panel.offset.data() + b * kInt8Panel + half, offset);
    }
  }
}

// Output features f0 .. f0 + count - 1 (count <= 32) of `blocks` (rows of row_bytes) unpacked
// into `panel`: each feature's blocks in the order they lie in memory (the panel's rows are
// one run of bytes), then two blocks of 16 features at a time (16 code words each) turned by
// one register transpose (cpu_avx512.h).
template <int64_t KIND>
void unpack_int8_panel(const uint8_t* blocks, int64_t row_bytes, int64_t K, int64_t f0,
                       int64_t count, Int8Panel& panel) {
  if constexpr (KIND == kQ4_0 || KIND == kQ4_1 || KIND == kQ8_0)
    return unpack_transposed_panel<KIND>(blocks, row_bytes, K, f0, count, panel);
  constexpr int64_t kBytes = block_format(KIND).bytes;
  const int64_t B = K / kBlock, even = (B + 1) / 2 * 2;
  panel.codes.resize(even * 8 * kInt8Panel);
  panel.rows.resize(kInt8Panel * even * 8);
  panel.scale.resize(B * kInt8Panel);
  panel.offset.resize(B * kInt8Panel);
  for (int64_t f = 0; f < kInt8Panel; ++f) {
    uint32_t* row = panel.rows.data() + f * even * 8;
    for (int64_t b = 0; b < even; ++b) {
      __m256i codes = _mm256_setzero_si256();
      float a = 0.f, offset = 0.f;
      if (f < count && b < B)
        codes = unsigned_block<KIND>(blocks + (f0 + f) * row_bytes + b * kBytes, a, offset);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 8 * b), codes);
      if (b < B) {
        panel.scale[b * kInt8Panel + f] = a;
        panel.offset[b * kInt8Panel + f] = offset;
      }
    }
  }
  for (int64_t b = 0; b < even; b += 2)
    for (int64_t half = 0; half < kInt8Panel; half += 16) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j)
        r[j] = _mm512_loadu_si512(panel.rows.data() + (half + j) * even * 8 + 8 * b);
      spmd_cpu::transpose_words(r);   // r[w]: word w (block b + w / 8, inputs 4 (w % 8) ..)
      for (int w = 0; w < 16; ++w)
        _mm512_storeu_si512(panel.codes.data() + (b * 8 + w) * kInt8Panel + half, r[w]);
    }
}

// Rows r0 .. r0 + R - 1 of x's codes against an unpacked panel: done(r, low, high) receives
// row r's float32 sums of features 0-15 and 16-31. (done stores them, or parks them for
// finish_rows: an epilogue inlined here took registers the accumulators need.)
template <int R, class Done>
inline void int8_tile(const Int8Rows& x, int64_t r0, int64_t K, const Int8Panel& panel,
                      Done&& done) {
  const int64_t B = K / kBlock;
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int8_t* q = x.codes.data() + r0 * K;
  for (int64_t b = 0; b < B; ++b) {
    __m512i sums[R][2];
    for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm512_setzero_si512();
    const uint32_t* w = panel.codes.data() + b * 8 * kInt8Panel;
    for (int p = 0; p < 8; ++p) {
      const __m512i w0 = _mm512_loadu_si512(w + p * kInt8Panel);
      const __m512i w1 = _mm512_loadu_si512(w + p * kInt8Panel + 16);
      for (int r = 0; r < R; ++r) {
        int32_t word;
        std::memcpy(&word, q + r * K + b * kBlock + 4 * p, sizeof word);
        const __m512i xr = _mm512_set1_epi32(word);
        sums[r][0] = _mm512_dpbusd_epi32(sums[r][0], w0, xr);
        sums[r][1] = _mm512_dpbusd_epi32(sums[r][1], w1, xr);
      }
    }
    const float* a = panel.scale.data() + b * kInt8Panel;
    const float* c = panel.offset.data() + b * kInt8Panel;
    const __m512 a0 = _mm512_loadu_ps(a), a1 = _mm512_loadu_ps(a + 16);
    const __m512 c0 = _mm512_loadu_ps(c), c1 = _mm512_loadu_ps(c + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 step = _mm512_set1_ps(x.step[(r0 + r) * B + b]);
      const __m512 sum = _mm512_set1_ps(x.sum[(r0 + r) * B + b]);
      acc[r][0] = fold_block(acc[r][0], sums[r][0], step, a0, c0, sum);
      acc[r][1] = fold_block(acc[r][1], sums[r][1], step, a1, c1, sum);
    }
  }
  for (int r = 0; r < R; ++r) done(r0 + r, acc[r][0], acc[r][1]);
}

// Every row of x against a panel, kInt8TileRows at a time.
template <class Done>
inline void int8_panel_rows(const Int8Rows& x, int64_t M, int64_t K, const Int8Panel& panel,
                            Done&& done) {
  int64_t r = 0;
  for (; r + kInt8TileRows <= M; r += kInt8TileRows)
    int8_tile<kInt8TileRows>(x, r, K, panel, done);
  spmd_cpu::with_row_count<1, kInt8TileRows - 1>(M - r, [&](auto rows) {
    int8_tile<decltype(rows)::value>(x, r, K, panel, done);
  });
}

// The lanes of `row` that `lanes` selects, stored from dst on (float32, or rounded to bf16).
inline void store_first(float* dst, __m512 row, __mmask16 lanes) {
  _mm512_mask_storeu_ps(dst, lanes, row);
}
inline void store_first(spmd_cpu::bf16_bits* dst, __m512 row, __mmask16 lanes) {
#if defined(__AVX512BF16__)
  _mm256_mask_storeu_epi16(dst, lanes, (__m256i)_mm512_cvtneps_pbh(row));
#else
  alignas(64) spmd_cpu::bf16_bits part[16];
  spmd_cpu::vstore_bf16(part, row);
  for (int i = 0; i < 16; ++i)
    if (lanes >> i & 1) dst[i] = part[i];
#endif
}

// Where a product's float32 sums go (E: float32, or bf16 rounded once): out, rows ldo apart,
// each sum rounded to E; with a residual (E, rows ldo apart) the rounded sum is added to it as
// torch adds two E tensors; with `up` > 0 the weight is a fused gate/up projection whose up
// features start `up` rows past the gate's, and output feature f is silu_mul's step for E
// (cpu_layers.cpp silu_mul_row, at a multiple of 16 features) on the sums of gate feature f and
// up feature f, each rounded to E: the bits of silu_mul(product), the [M, 2 up] product never
// written.
template <class E>
struct Int8Out {
  E* out;
  int64_t ldo;
  const E* residual = nullptr;
  int64_t up = 0;
};

// v rounded to the element type E of the (unread) pointer's.
inline __m512 round_to(const float*, __m512 v) { return v; }
inline __m512 round_to(const spmd_cpu::bf16_bits*, __m512 v) {
#if defined(__AVX512BF16__)
  return spmd_cpu::round_bf16(v);
#else
  alignas(64) spmd_cpu::bf16_bits rounded[16];
  spmd_cpu::vstore_bf16(rounded, v);
  return spmd_cpu::vload_bf16(rounded);
#endif
}

// The lanes of p's that `lanes` selects, widened to float32 (the others zero).
inline __m512 load_first(const float* p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }
inline __m512 load_first(const spmd_cpu::bf16_bits* p, __mmask16 lanes) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, p)), 16));
}

// silu_mul's step on rows of E (both already rounded to E).
inline __m512 silu_step(const float*, __m512 gate, __m512 up) {
  return spmd_cpu::vsilu_mul(gate, up);
}
inline __m512 silu_step(const spmd_cpu::bf16_bits*, __m512 gate, __m512 up) {
  return spmd_cpu::silu_mul_lanes(gate, up);
}

// Rows 0 .. M - 1 of a panel's parked sums (float32, rows kInt8Panel apart: its features from
// f0, `count` of them real) stored into o with the residual added, or with `gates` (the gate
// features' sums, parked alike) as SiLU(gate) * up. (The plain product stores from its tiles:
// parked, its [1,024, 3,072] product took 18% longer.)
template <class E>
void finish_rows(const Int8Out<E>& o, int64_t M, int64_t f0, int64_t count, const float* sums,
                 const float* gates) {
  for (int64_t h = 0; h < count; h += 16) {
    const __mmask16 lanes = static_cast<__mmask16>(
        count - h >= 16 ? 0xFFFF : (1u << (count - h)) - 1);
    for (int64_t r = 0; r < M; ++r) {
      E* dst = o.out + r * o.ldo + f0 + h;
      const __m512 sum = _mm512_loadu_ps(sums + r * kInt8Panel + h);
      if (gates != nullptr) {
        const __m512 gate = round_to(dst, _mm512_loadu_ps(gates + r * kInt8Panel + h));
        store_first(dst, silu_step(dst, gate, round_to(dst, sum)), lanes);
      } else {
        const __m512 residual = load_first(o.residual + r * o.ldo + f0 + h, lanes);
        store_first(dst, _mm512_add_ps(round_to(dst, sum), residual), lanes);
      }
    }
  }
}

// Decode batches (kLaneProductFrom to kLaneProductTo rows) against Q4_1 blocks, 16 rows in a
// register's lanes: each feature's code bytes are broadcast straight from the file's blocks,
// their low and high nibbles (inputs 4j.. and 16 + 4j..) masked into two unsigned words, each
// against RV registers of rows' words of x's codes, so no panel is unpacked. A block folds as
// fold_block does, operation for operation, so every sum is the panels' bit for bit. Four
// tiles of F = 4 features make 16, whose sums (16 features x 16 rows a register of rows) are
// turned by one register transpose and stored a row at a time, with the residual added where
// Int8Out has one.
constexpr int kLaneTileFeatures = 4;
constexpr int64_t kLaneProductFrom = 17, kLaneProductTo = 32;   // rows that take the lanes

// A lane tile's next tile: the rows of features f0 .. f0 + F - 1, from byte `at` of each, asked
// for a block ahead of where they are read (F interleaved streams, which the hardware
// prefetcher does not follow: without it the tiles ran ~20% slower than the panels).
template <int F>
inline void prefetch_tile_rows(const uint8_t* blocks, int64_t row_bytes, int64_t f0, int64_t at) {
  for (int f = 0; f < F; ++f)
    _mm_prefetch(reinterpret_cast<const char*>(blocks + (f0 + f) * row_bytes + at), _MM_HINT_T0);
}

// Sums of F features from f0 (Q4_1 rows of row_bytes) for register rows g0 .. g0 + RV - 1.
template <int RV>
inline void q4_1_lane_tile(const uint8_t* blocks, int64_t row_bytes, int64_t f0, int64_t B,
                           const LaneRows& x, int64_t g0, __m512 out[kLaneTileFeatures][RV]) {
  constexpr int64_t kBytes = 20;   // Q4_1: d and m (fp16), then 16 bytes of two nibbles
  constexpr int F = kLaneTileFeatures;
  __m512 acc[F][RV];
  for (int f = 0; f < F; ++f)
    for (int v = 0; v < RV; ++v) acc[f][v] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < B; ++b) {
    prefetch_tile_rows<F>(blocks, row_bytes, f0 + F, b * kBytes);
    __m512i sums[F][RV];
    for (int f = 0; f < F; ++f)
      for (int v = 0; v < RV; ++v) sums[f][v] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m512i low_rows[RV], high_rows[RV];
      for (int v = 0; v < RV; ++v) {
        low_rows[v] = x.codes[((g0 + v) * B + b) * 8 + j];
        high_rows[v] = x.codes[((g0 + v) * B + b) * 8 + 4 + j];
      }
      for (int f = 0; f < F; ++f) {
        int32_t word;
        std::memcpy(&word, blocks + (f0 + f) * row_bytes + b * kBytes + 4 + 4 * j, 4);
        const __m512i w = _mm512_set1_epi32(word);
        const __m512i low = _mm512_and_si512(w, nibble);
        const __m512i high = _mm512_and_si512(_mm512_srli_epi32(w, 4), nibble);
        for (int v = 0; v < RV; ++v) {
          sums[f][v] = _mm512_dpbusd_epi32(sums[f][v], low, low_rows[v]);
          sums[f][v] = _mm512_dpbusd_epi32(sums[f][v], high, high_rows[v]);
        }
      }
    }
    for (int f = 0; f < F; ++f) {
      const uint8_t* s = blocks + (f0 + f) * row_bytes + b * kBytes;
      const __m512 d = _mm512_set1_ps(half_at(s)), m = _mm512_set1_ps(half_at(s + 2));
      for (int v = 0; v < RV; ++v)
        acc[f][v] = fold_block(acc[f][v], sums[f][v], x.step[(g0 + v) * B + b], d, m,
                               x.sum[(g0 + v) * B + b]);
    }
  }
  for (int f = 0; f < F; ++f)
    for (int v = 0; v < RV; ++v) out[f][v] = acc[f][v];
}

// Register rows g0 .. g0 + RV - 1 against 16 features from f0, stored as Int8Out says.
template <int RV, class E>
inline void q4_1_lane_rows(const uint8_t* blocks, int64_t row_bytes, int64_t f0, int64_t B,
                           const LaneRows& x, int64_t g0, int64_t M, const Int8Out<E>& o) {
  __m512 sums[16][RV];
  for (int t = 0; t < 16 / kLaneTileFeatures; ++t)
    q4_1_lane_tile<RV>(blocks, row_bytes, f0 + t * kLaneTileFeatures, B, x, g0,
                       sums + t * kLaneTileFeatures);
  for (int v = 0; v < RV; ++v) {
    __m512i rows[16];   // rows[f]: feature f0 + f's sums of 16 rows; turned: rows[r], 16 features
    for (int f = 0; f < 16; ++f) rows[f] = _mm512_castps_si512(sums[f][v]);
    spmd_cpu::transpose_words(rows);
    const int64_t r0 = (g0 + v) * 16;
    for (int64_t r = 0; r < std::min<int64_t>(16, M - r0); ++r) {
      E* dst = o.out + (r0 + r) * o.ldo + f0;
      __m512 sum = _mm512_castsi512_ps(rows[r]);
      if (o.residual != nullptr)
        sum = _mm512_add_ps(round_to(dst, sum),
                            load_first(o.residual + (r0 + r) * o.ldo + f0, 0xFFFF));
      store_first(dst, sum, 0xFFFF);
    }
  }
}

// int8_blocks_product over Q4_1 blocks with the rows in the lanes (N a multiple of 16).
template <class E>
void q4_1_lane_product(const Int8Rows& x, int64_t M, int64_t K, const uint8_t* blocks,
                       int64_t row_bytes, int64_t N, const Int8Out<E>& o) {
  LaneRows lanes;
  lane_rows(x, M, K, lanes);
  const int64_t B = K / kBlock;
  at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      int64_t g0 = 0;
      for (; g0 + 2 <= lanes.groups; g0 += 2)
        q4_1_lane_rows<2>(blocks, row_bytes, panel * 16, B, lanes, g0, M, o);
      if (g0 < lanes.groups) q4_1_lane_rows<1>(blocks, row_bytes, panel * 16, B, lanes, g0, M, o);
    }
  });
}

// A thread's panels [begin, end) of int8_blocks_product: the plain product stores from its
// tiles, the fused ones park the tiles' sums and finish them (finish_rows). Each form a function
// of its own: in one, the compiler's inlining left the plain tiles 15-40% slower.
template <int64_t KIND, class E>
__attribute__((noinline)) void plain_panels(const Int8Rows& x, int64_t M, int64_t K,
                                            const uint8_t* blocks, int64_t row_bytes, int64_t N,
                                            const Int8Out<E>& o, int64_t begin, int64_t end) {
  Int8Panel panel;
  for (int64_t p = begin; p < end; ++p) {
    const int64_t f0 = p * kInt8Panel, count = std::min(kInt8Panel, N - f0);
    const __mmask16 low = static_cast<__mmask16>(count >= 16 ? 0xFFFF : (1u << count) - 1);
    const __mmask16 high = static_cast<__mmask16>(
        count >= 32 ? 0xFFFF : count > 16 ? (1u << (count - 16)) - 1 : 0);
    unpack_int8_panel<KIND>(blocks, row_bytes, K, f0, count, panel);
    int8_panel_rows(x, M, K, panel, [&](int64_t r, __m512 v0, __m512 v1) {
      store_first(o.out + r * o.ldo + f0, v0, low);
      store_first(o.out + r * o.ldo + f0 + 16, v1, high);
    });
  }
}

template <int64_t KIND, class E>
__attribute__((noinline)) void fused_panels(const Int8Rows& x, int64_t M, int64_t K,
                                            const uint8_t* blocks, int64_t row_bytes, int64_t N,
                                            const Int8Out<E>& o, int64_t begin, int64_t end) {
  Int8Panel panel;
  std::vector<float> sums(M * kInt8Panel), gates(o.up > 0 ? M * kInt8Panel : 0);
  const auto park = [](float* into) {
    return [into](int64_t r, __m512 v0, __m512 v1) {
      _mm512_storeu_ps(into + r * kInt8Panel, v0);
      _mm512_storeu_ps(into + r * kInt8Panel + 16, v1);
    };
  };
  for (int64_t p = begin; p < end; ++p) {
    const int64_t f0 = p * kInt8Panel, count = std::min(kInt8Panel, N - f0);
    if (o.up > 0) {
      unpack_int8_panel<KIND>(blocks, row_bytes, K, f0, count, panel);
      int8_panel_rows(x, M, K, panel, park(gates.data()));
    }
    unpack_int8_panel<KIND>(blocks, row_bytes, K, o.up + f0, count, panel);
    int8_panel_rows(x, M, K, panel, park(sums.data()));
    finish_rows(o, M, f0, count, sums.data(), o.up > 0 ? gates.data() : nullptr);
  }
}

// o = x's codes @ the blocks' weights^T for N output features, kInt8Panel a task (a gate/up
// projection's: N gate features, and then their up features).
template <int64_t KIND, class E>
void int8_blocks_product(const Int8Rows& x, int64_t M, int64_t K, const uint8_t* blocks,
                         int64_t row_bytes, int64_t N, const Int8Out<E>& o) {
  if (KIND == kQ4_1 && o.up == 0 && M >= kLaneProductFrom && M <= kLaneProductTo && N % 16 == 0)
    return q4_1_lane_product(x, M, K, blocks, row_bytes, N, o);
  const bool plain = o.residual == nullptr && o.up == 0;
  at::parallel_for(0, (N + kInt8Panel - 1) / kInt8Panel, 1, [&](int64_t begin, int64_t end) {
    if (plain) plain_panels<KIND>(x, M, K, blocks, row_bytes, N, o, begin, end);
    else fused_panels<KIND>(x, M, K, blocks, row_bytes, N, o, begin, end);
  });
}

#endif  // AVX-512 BW and VNNI
