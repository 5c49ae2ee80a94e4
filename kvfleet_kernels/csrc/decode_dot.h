// The decode kernel's dot products (kvfleet_kernels/csrc/paged_decode_cpu.cpp): a query row against
// 16 cache rows at once, in fp32 or on avx512_bf16's dot product, and the bf16 V pass.
#pragma once

#include <c10/util/BFloat16.h>

#include "cpu_vec.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace kvfleet_cpu {

// Lane j of the result is the sum of v[j]'s lanes: 16 dot products finished at once. Each
// round pairs vectors and halves the lanes each one's partial sums take (8, 4, 2, 1), so
// the whole reduction is 15 shuffle pairs and adds, where 16 separate reduce_add trees
// (and their scalar stores) cost about three times as many instructions.
inline vfloat transpose_sum16(const vfloat* v) {
  vfloat w[8], u[4], t[2];
  for (int i = 0; i < 8; ++i)
    w[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    u[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    t[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(u[2 * i], u[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(t[0], t[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(t[0], t[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// Lane j of the result is the sum of v[j]'s 8 lanes: transpose_sum16's rounds at half width.
using vfloat8 = float __attribute__((vector_size(32)));
constexpr int kHalfLanes = 8;
inline vfloat8 load8(const float* p) {
  vfloat8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, vfloat8 v) { std::memcpy(p, &v, sizeof v); }
inline vfloat8 transpose_sum8(const vfloat8* v) {
  vfloat8 w[4], u[2];
  for (int i = 0; i < 4; ++i)  // lanes 0-3: v[2i]'s halves summed; 4-7: v[2i + 1]'s
    w[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)  // two lanes each of v[4i] .. v[4i + 3]
    u[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(w[2 * i], w[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(u[0], u[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(u[0], u[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

// dot16 for fp32 rows where 16 vfloats of partial sums would not fit the registers (AVX2,
// NEON): two runs of 8 rows, 8 lanes wide, each with its own transposed reduction. The
// 16-vfloat form spilled partial sums to the stack there; this took the whole kernel from
// ~3.4 to ~2.9 ms a layer on a 2-core AVX2 host (40 sequences x 450 positions, fp32, 9/3 heads of 64).
template <int HEAD_DIM>
inline vfloat dot16_narrow(const float* q, const float* first, int64_t row_stride) {
  vfloat8 halves[2];
  for (int h = 0; h < 2; ++h) {
    vfloat8 partial[8];
    for (int i = 0; i < 8; ++i) {
      const float* row = first + (8 * h + i) * row_stride;
      partial[i] = load8(q) * load8(row);
      for (int d = 8; d < HEAD_DIM; d += 8) partial[i] += load8(q + d) * load8(row + d);
    }
    halves[h] = transpose_sum8(partial);
  }
  return __builtin_shufflevector(halves[0], halves[1], 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

// scores[0:16] = q . rows[i] for the 16 rows rows[i] = first + i * row_stride (HEAD_DIM a
// multiple of 16): one partial-sum register per row, then one transposed reduction.
template <int HEAD_DIM, typename scalar_t>
inline vfloat dot16(const float* q, const scalar_t* first, int64_t row_stride) {
  if constexpr (kVfloatRegisters < 32 && std::is_same_v<scalar_t, float>)
    return dot16_narrow<HEAD_DIM>(q, first, row_stride);
  vfloat partial[kLanes];
  for (int i = 0; i < kLanes; ++i) {
    const scalar_t* row = first + i * row_stride;
    partial[i] = load16(q) * load16(row);
    for (int d = kLanes; d < HEAD_DIM; d += kLanes) partial[i] += load16(q + d) * load16(row + d);
  }
  return transpose_sum16(partial);
}

#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;
// scores[0:16] = q . rows[i] as dot16 does, for a bf16 query and bf16 cache rows, with
// avx512_bf16's dot product (32 products into 16 fp32 sums an instruction): the rows are
// read as stored, not widened first. Each bf16 x bf16 product is exact in fp32, as after
// widening; only the order of the fp32 sums differs. ~10% off the whole kernel here
// (64 sequences x 400 positions, bf16, SmolLM2's 9/3 heads of 64).
template <int HEAD_DIM>
inline vfloat dot16_bf16(const at::BFloat16* q, const at::BFloat16* first, int64_t row_stride) {
  static_assert(HEAD_DIM % 32 == 0);
  __m512bh q_pairs[HEAD_DIM / 32];
  for (int c = 0; c < HEAD_DIM / 32; ++c) q_pairs[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  vfloat partial[kLanes];
  for (int i = 0; i < kLanes; ++i) {
    const at::BFloat16* row = first + i * row_stride;
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < HEAD_DIM / 32; ++c) acc = _mm512_dpbf16_ps(acc, q_pairs[c], (__m512bh)_mm512_loadu_si512(row + 32 * c));
    partial[i] = (vfloat)acc;
  }
  return transpose_sum16(partial);
}

// The V pass of dot16_bf16's caches: acc[t] += sum over rows i of weights[t][i] * rows[i] as
// weighted_rows_add_tile does, with avx512_bf16's dot product over pairs of rows: rows i and
// i + 1 interleaved (unpacklo/hi_epi16: dimension d of each side by side) meet the pair of
// their bf16 weights in one instruction, half the work of widening each row and multiplying
// it in fp32. The weights are the softmax numerators rounded to bf16, as torch's bf16
// attention rounds its probabilities before the product with V; the sums stay fp32. `acc`
// holds each row's HEAD_DIM sums in the unpack order (unpack_order_index maps them back); an odd
// last row pairs with itself under a zero weight, so no row outside [0, num_rows) is read.
template <int HEAD_DIM, int TILE>
inline void weighted_rows_add_tile_bf16(float* acc, int64_t acc_stride, const uint16_t* weights,
                                        int64_t weight_stride, const at::BFloat16* first, int64_t row_stride,
                                        int64_t num_rows) {
  constexpr int kPairs = HEAD_DIM / 16;  // accumulators per query row: 16 dimensions each
  __m512 sum[TILE][kPairs];
  for (int t = 0; t < TILE; ++t)
    for (int k = 0; k < kPairs; ++k) sum[t][k] = _mm512_loadu_ps(acc + t * acc_stride + 16 * k);
  auto accumulate = [&](const at::BFloat16* a, const at::BFloat16* b, int64_t i, uint32_t keep_second) {
    __m512i pairs[kPairs];
    for (int c = 0; c < kPairs / 2; ++c) {
      const __m512i va = _mm512_loadu_si512(a + 32 * c), vb = _mm512_loadu_si512(b + 32 * c);
      pairs[2 * c] = _mm512_unpacklo_epi16(va, vb);
      pairs[2 * c + 1] = _mm512_unpackhi_epi16(va, vb);
    }
    for (int t = 0; t < TILE; ++t) {
      uint32_t w;
      std::memcpy(&w, weights + t * weight_stride + i, sizeof(w));
      const __m512bh w2 = (__m512bh)_mm512_set1_epi32(static_cast<int>(w & keep_second));
      for (int k = 0; k < kPairs; ++k) sum[t][k] = _mm512_dpbf16_ps(sum[t][k], (__m512bh)pairs[k], w2);
    }
  };
  int64_t i = 0;
  for (; i + 1 < num_rows; i += 2) accumulate(first + i * row_stride, first + (i + 1) * row_stride, i, ~0u);
  if (i < num_rows) accumulate(first + i * row_stride, first + i * row_stride, i, 0xFFFFu);  // weight pair (w_i, 0)
  for (int t = 0; t < TILE; ++t)
    for (int k = 0; k < kPairs; ++k) _mm512_storeu_ps(acc + t * acc_stride + 16 * k, sum[t][k]);
}

// Dimension d of a row of weighted_rows_add_tile_bf16's sums, which sit in the unpack order:
// per 32 dimensions, 128-bit lane L of the low half holds d = 8L..8L+3, of the high half 8L+4..8L+7.
inline int64_t unpack_order_index(int64_t d) {
  const int64_t chunk = d / 32, in_chunk = d % 32, lane = in_chunk / 8, j = in_chunk % 8;
  return chunk * 32 + (j < 4 ? 0 : 16) + lane * 4 + (j % 4);
}
#else
constexpr bool kHasBf16Dot = false;
template <int HEAD_DIM, int TILE>
inline void weighted_rows_add_tile_bf16(float*, int64_t, const uint16_t*, int64_t, const at::BFloat16*, int64_t,
                                        int64_t) {}  // never called
inline int64_t unpack_order_index(int64_t d) { return d; }
template <int HEAD_DIM>
inline vfloat dot16_bf16(const at::BFloat16*, const at::BFloat16*, int64_t) { return vfloat{}; }  // never called
#endif

}  // namespace kvfleet_cpu
