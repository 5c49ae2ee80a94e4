// The decode kernel's V pass helpers (kvfleet_kernels/csrc/paged_decode_cpu.cpp): 8-lane vectors
// for fp32 rows where 16-lane sums would not fit the registers, and the bf16 V pass on avx512_bf16's
// dot product. Its K pass is csrc/decode_keys.h.
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

// 8 fp32 lanes, half a vfloat: fp32 loops whose 16-lane sums would spill on AVX2 and NEON.
using vfloat8 = float __attribute__((vector_size(32)));
constexpr int kHalfLanes = 8;
inline vfloat8 load8(const float* p) {
  vfloat8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, vfloat8 v) { std::memcpy(p, &v, sizeof v); }

#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;
// The V pass of bf16 caches on avx512_bf16: acc[t] += sum over rows i of weights[t][i] * rows[i] as
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
#endif

}  // namespace kvfleet_cpu
