// AVX512-VNNI forms of cpu_group_quant.cpp's dot_blocks and dot_supers, for its few-row products
// (included there, inside its namespace, after the AVX2 forms whose helpers it uses).
//
// x's codes are 16-bit fixed point as for AVX2 (quantize_rows), with one scale per block of 32
// for the blocks of 32 and per super-block of 256 for the K-quants. A block's 32 weight codes
// are widened into one 512-bit register and multiplied with x's by VPDPWSSD: 32 products an
// instruction, where AVX2's madd took two and an add. Blocks of 32: each block's 16 lanes of
// sums are scaled in float (the block's a times x's block scale). K-quants: the integer
// sub-block scales are multiplied into the codes once per block, shared by the rows (16-bit
// products: at most 31 x 63 for Q5_K, 32 x 128 for Q6_K, whose zero point 32 is subtracted from
// the codes first), so with x's one scale per super-block a row's sums stay integers across
// the super-block (a lane adds 16 products: |sum| <= 16 x 4096 x 32767 < 2^31) and are scaled
// once: d times x's scale. Lanes stay apart until the end: one horizontal sum per row and
// output feature.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SPMD_GGUF_VNNI 1

// Independent accumulators a row keeps, so that at one or two rows the dot products (or FMAs)
// of consecutive blocks do not each wait on the one before.
template <int R>
constexpr int kChains = R >= 4 ? 1 : 4 / R;

template <int R>
inline void zero_chains(__m512 acc[R][kChains<R>]) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kChains<R>; ++c) acc[r][c] = _mm512_setzero_ps();
}

template <int R>
inline __m512 chains_sum(const __m512 chains[kChains<R>]) {
  __m512 sum = chains[0];
  for (int c = 1; c < kChains<R>; ++c) sum = _mm512_add_ps(sum, chains[c]);
  return sum;
}

// Blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): each block's codes times x's, scaled by the
// block's a and x's block scale; the zero points' and minimums' terms from x's scaled sums.
template <int64_t KIND, int R>
void dot_blocks_vnni(const uint8_t* row, int64_t K, const Quantized& xq, int64_t r0, float* out,
                     int64_t N) {
  constexpr int64_t kBytes = block_format(KIND).bytes;
  const int64_t blocks = K / kBlock;
  __m512 acc[R][kChains<R>];
  float extra[R];
  zero_chains<R>(acc);
  for (int r = 0; r < R; ++r) extra[r] = 0.f;
  for (int64_t i = 0; i < blocks; ++i) {
    Affine f;
    if (i % 2 == 0) prefetch<2 * kBytes>(row + i * kBytes);
    const __m256i bytes = unpack_block<KIND>(row + i * kBytes, f);
    const __m512i codes = KIND == kQ8_0 ? _mm512_cvtepi8_epi16(bytes) : _mm512_cvtepu8_epi16(bytes);
    const float shift = f.c - f.a * static_cast<float>(f.zero);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * blocks + i;
      const __m512i dots = _mm512_dpwssd_epi32(_mm512_setzero_si512(), codes,
                                               _mm512_loadu_si512(xq.q_at + at * kBlock));
      __m512& chain = acc[r][i % kChains<R>];
      chain = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_set1_ps(f.a * xq.scale_at[at]), chain);
      if (KIND != kQ8_0) extra[r] += shift * xq.sum32_at[at];
    }
  }
  for (int r = 0; r < R; ++r) out[r * N] = _mm512_reduce_add_ps(chains_sum<R>(acc[r])) + extra[r];
}

inline __m512i widen_bytes(const uint8_t* p) {
  return _mm512_cvtepu8_epi16(load32(p));
}

// A block's 32 codes times its integer sub-block scales against rows r0..r0+R-1 of x's codes for
// block `at` (its index in row 0): 16 lanes of integer sums into chain c of each row's.
template <int R>
inline void rows_dot_int(__m512i codes, const Quantized& xq, int64_t at, int64_t row_stride, int c,
                         __m512i sums[R][kChains<R>]) {
  for (int r = 0; r < R; ++r)
    sums[r][c] = _mm512_dpwssd_epi32(sums[r][c], codes,
                                     _mm512_loadu_si512(xq.q_at + (at + r * row_stride) * kBlock));
}

// A K-quant super-block's (Q4_K, Q5_K, Q6_K) blocks as 32 codes times their integer sub-block
// scales each (Q6_K: less its zero point 32 first): use(b, codes) for b = 0..7. Its d; for
// Q4_K and Q5_K, -dmin x its 8 minimums (the minimums' term: x's scaled sums of each block).
struct SuperScales {
  float d;
  __m256 low_min;
};

template <int64_t KIND, class Use>
inline SuperScales super_codes(const uint8_t* s, Use&& use) {
  const __m512i nibble = _mm512_set1_epi16(0x0F);
  if constexpr (KIND == kQ6_K) {
    // Sub-block scales as 16 words; block b's register: words 2b (codes 0-15), 2b+1 (16-31).
    const __m512i sub = _mm512_castsi256_si512(
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 192))));
    const __m512i halves = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1);
    const __m512i zero_point = _mm512_set1_epi16(32);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i ql0 = widen_bytes(s + 64 * h), ql1 = widen_bytes(s + 64 * h + 32);
      const __m512i qh = widen_bytes(s + 128 + 32 * h);
      const __m512i codes[4] = {
          _mm512_or_si512(_mm512_and_si512(ql0, nibble),
                          _mm512_slli_epi16(_mm512_and_si512(qh, _mm512_set1_epi16(0x03)), 4)),
          _mm512_or_si512(_mm512_and_si512(ql1, nibble),
                          _mm512_slli_epi16(_mm512_and_si512(qh, _mm512_set1_epi16(0x0C)), 2)),
          _mm512_or_si512(_mm512_srli_epi16(ql0, 4), _mm512_and_si512(qh, _mm512_set1_epi16(0x30))),
          _mm512_or_si512(_mm512_srli_epi16(ql1, 4),
                          _mm512_srli_epi16(_mm512_and_si512(qh, _mm512_set1_epi16(0xC0)), 2))};
#pragma GCC unroll 4
      for (int part = 0; part < 4; ++part) {
        const int b = 4 * h + part;
        const __m512i scale = _mm512_permutexvar_epi16(
            _mm512_add_epi16(halves, _mm512_set1_epi16(static_cast<int16_t>(2 * b))), sub);
        use(b, _mm512_mullo_epi16(_mm512_sub_epi16(codes[part], zero_point), scale));
      }
    }
    return {half_at(s + 208), _mm256_setzero_ps()};
  } else {
    const SixBit six = six_bit_scales(s);
    const __m512i sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(six.scales));
    __m512i fifth_bits = _mm512_setzero_si512();
    if constexpr (KIND == kQ5_K) fifth_bits = widen_bytes(s + 16);
#pragma GCC unroll 4
    for (int pair = 0; pair < 4; ++pair) {
      const __m512i packed = widen_bytes(s + (KIND == kQ4_K ? 16 : 48) + 32 * pair);
      __m512i codes[2] = {_mm512_and_si512(packed, nibble), _mm512_srli_epi16(packed, 4)};
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        const int b = 2 * pair + half;
        if constexpr (KIND == kQ5_K)
          codes[half] = _mm512_or_si512(codes[half], _mm512_slli_epi16(_mm512_and_si512(
              _mm512_srli_epi16(fifth_bits, b), _mm512_set1_epi16(1)), 4));
        use(b, _mm512_mullo_epi16(codes[half],
                                  _mm512_permutexvar_epi16(_mm512_set1_epi16(static_cast<int16_t>(b)), sc)));
      }
    }
    return {half_at(s), _mm256_mul_ps(_mm256_set1_ps(-half_at(s + 2)),
                                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(six.mins)))};
  }
}

// K-quant super-blocks (Q4_K, Q5_K, Q6_K), R rows at a time; x quantized per super-block.
template <int64_t KIND, int R>
void dot_supers_vnni(const uint8_t* row, int64_t K, const Quantized& xq, int64_t r0, float* out,
                     int64_t N) {
  constexpr int64_t kBytes = block_format(KIND).bytes;
  const int64_t supers = K / 256, blocks = K / kBlock;
  __m512 total[R];
  __m256 extra[R];
  for (int r = 0; r < R; ++r) {
    total[r] = _mm512_setzero_ps();
    extra[r] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < supers; ++i) {
    const uint8_t* s = row + i * kBytes;
    prefetch<kBytes>(s);
    const int64_t at = r0 * blocks + i * 8;   // row r0's block 0 of this super-block
    __m512i sums[R][kChains<R>];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kChains<R>; ++c) sums[r][c] = _mm512_setzero_si512();
    const SuperScales f = super_codes<KIND>(s, [&](int b, __m512i codes) {
      rows_dot_int<R>(codes, xq, at + b, blocks, b % kChains<R>, sums);
    });
    for (int r = 0; r < R; ++r) {
      __m512i sum = sums[r][0];
      for (int c = 1; c < kChains<R>; ++c) sum = _mm512_add_epi32(sum, sums[r][c]);
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                                 _mm512_set1_ps(f.d * xq.scale_at[at + r * blocks]), total[r]);
      if constexpr (KIND != kQ6_K)
        extra[r] = _mm256_fmadd_ps(f.low_min, _mm256_loadu_ps(xq.sum32_at + at + r * blocks), extra[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * N] = _mm512_reduce_add_ps(total[r]) + hsum(extra[r]);
}

#endif

#if defined(SPMD_GGUF_VNNI)
// Many rows (a decode batch) against K-quant super-blocks, F output features at a time: each
// super-block of the F features is unpacked once (scaled codes into an L1 buffer, 512 bytes a
// feature) and then met by every row, two rows at a time, so that each load of x's codes feeds
// F products and each buffered block 2 (2 x F independent integer sums in flight). A row's
// float sums per feature live in `acc` (16 lanes each) across the super-blocks.
template <int64_t KIND, int F>
void tile_supers_vnni(const uint8_t* rows, int64_t row_bytes, int64_t K, const Quantized& xq,
                      int64_t M, float* acc, float* out, int64_t N) {
  constexpr int64_t kBytes = block_format(KIND).bytes;
  const int64_t supers = K / 256, blocks = K / kBlock;
  alignas(64) int16_t codes[F][256];
  for (int64_t j = 0; j < M * F * 16; ++j) acc[j] = 0.f;
  for (int64_t i = 0; i < supers; ++i) {
    SuperScales scales[F];
    for (int f = 0; f < F; ++f) {
      const uint8_t* s = rows + f * row_bytes + i * kBytes;
      // The next tile's same super-block (a thread's tiles are consecutive): prefetch's fixed
      // distance ahead in this row would fetch what this tile reads anyway where rows are short.
      for (int64_t line = 0; line < kBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(s + F * row_bytes + line), _MM_HINT_T0);
      scales[f] = super_codes<KIND>(s, [&](int b, __m512i w) {
        _mm512_store_si512(codes[f] + 32 * b, w);
      });
    }
    auto finish = [&](int64_t r, const __m512i* sums) {
      const int64_t at = r * blocks + i * 8;
      const __m512 sum32 = _mm512_maskz_loadu_ps(0x00FF, xq.sum32_at + at);
      for (int f = 0; f < F; ++f) {
        float* a = acc + (r * F + f) * 16;
        __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[f]),
                                   _mm512_set1_ps(scales[f].d * xq.scale_at[at]), _mm512_load_ps(a));
        if constexpr (KIND != kQ6_K) v = _mm512_fmadd_ps(_mm512_zextps256_ps512(scales[f].low_min), sum32, v);
        _mm512_store_ps(a, v);
      }
    };
    int64_t r = 0;
    for (; r + 2 <= M; r += 2) {
      __m512i sums[2][F];
      for (int f = 0; f < F; ++f) sums[0][f] = sums[1][f] = _mm512_setzero_si512();
      const int16_t* x0 = xq.q_at + (r * blocks + i * 8) * kBlock;
      const int16_t* x1 = x0 + blocks * kBlock;
#pragma GCC unroll 8
      for (int b = 0; b < 8; ++b) {
        const __m512i a0 = _mm512_loadu_si512(x0 + 32 * b), a1 = _mm512_loadu_si512(x1 + 32 * b);
        for (int f = 0; f < F; ++f) {
          const __m512i w = _mm512_load_si512(codes[f] + 32 * b);
          sums[0][f] = _mm512_dpwssd_epi32(sums[0][f], w, a0);
          sums[1][f] = _mm512_dpwssd_epi32(sums[1][f], w, a1);
        }
      }
      finish(r, sums[0]);
      finish(r + 1, sums[1]);
    }
    if (r < M) {
      __m512i sums[F];
      for (int f = 0; f < F; ++f) sums[f] = _mm512_setzero_si512();
      const int16_t* x0 = xq.q_at + (r * blocks + i * 8) * kBlock;
#pragma GCC unroll 8
      for (int b = 0; b < 8; ++b) {
        const __m512i a0 = _mm512_loadu_si512(x0 + 32 * b);
        for (int f = 0; f < F; ++f)
          sums[f] = _mm512_dpwssd_epi32(sums[f], _mm512_load_si512(codes[f] + 32 * b), a0);
      }
      finish(r, sums);
    }
  }
  for (int64_t r = 0; r < M; ++r)
    for (int f = 0; f < F; ++f) out[r * N + f] = _mm512_reduce_add_ps(_mm512_load_ps(acc + (r * F + f) * 16));
}

// Every row against every output feature's super-blocks, features split among the threads.
template <int64_t KIND>
void tiled_supers(const Quantized& xq, int64_t M, const uint8_t* blocks, int64_t row_bytes,
                  int64_t K, int64_t N, float* out) {
  constexpr int F = 4;
  at::parallel_for(0, (N + F - 1) / F, 4, [&](int64_t begin, int64_t end) {
    float* acc = static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>(M * F * 16) * sizeof(float)));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * F;
      if (n + F <= N) {
        tile_supers_vnni<KIND, F>(blocks + n * row_bytes, row_bytes, K, xq, M, acc, out + n, N);
      } else {
        for (int64_t m = n; m < N; ++m)
          tile_supers_vnni<KIND, 1>(blocks + m * row_bytes, row_bytes, K, xq, M, acc, out + m, N);
      }
    }
    std::free(acc);
  });
}
#endif
