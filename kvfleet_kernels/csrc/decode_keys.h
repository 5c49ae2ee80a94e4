// The decode kernel's K pass (kvfleet_kernels/csrc/paged_decode_cpu.cpp) over the CPU key cache
// layout: per block and KV head, [head_dim / x, block_size, x] with x elements to a 32-bit word
// (x = 2 for bf16 and fp16, 1 for fp32): vLLM's paged K layout with a 4-byte x.
//
// Why this layout: with rows stored [block_size, head_dim], a query row's 16 scores took 16
// partial-sum registers and a 16-way transposed reduction, each K row loaded once per query row
// of the GQA group: ~330 instructions per 16 positions for SmolLM2's groups of 3 (bf16). Stored
// transposed, one load of a word row (16 positions of dimensions d and d + 1) feeds every
// query row of the group, and the sums finish in their lanes: ~130. The kernel alone, bf16,
// 64 sequences x 335 positions, 9/3 heads of 64, on a 2-core AMD EPYC with avx512_bf16:
// ~0.73 -> ~0.45 ms a layer with the cache in L3.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cpu_vec.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace kvfleet_cpu {

// x: elements of a key cache dtype to one word of the layout: 1 for fp32, else 2 (bf16 and fp16: a
// 32-bit word; fp8: 16 bits, which become one bf16 pair in registers);
// kvfleet_kernels/cpu_paged_attention.py's key_word_elements is its Python twin.
inline int64_t key_word_elements(at::ScalarType dtype) { return dtype == at::kFloat ? 1 : 2; }
template <typename scalar_t>
constexpr int64_t kKeyWordElements = std::is_same_v<scalar_t, float> ? 1 : 2;

// Dimensions d and d + 1 of 16 consecutive positions, from one row of 16 words (bf16, fp16).
template <typename scalar_t>
inline void load_word_pairs(const scalar_t* words, vfloat& even, vfloat& odd) {
  using u32x16 = uint32_t __attribute__((vector_size(64)));
  u32x16 w;
  std::memcpy(&w, words, sizeof w);
  if constexpr (kIsFp8<scalar_t>) {  // 16 positions' (d, d + 1) byte pairs
    load_fp8_pairs(words, even, odd);
  } else if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {  // bf16 is the top half of an fp32
    const u32x16 low = w << 16, high = w & 0xFFFF0000u;
    std::memcpy(&even, &low, sizeof even);
    std::memcpy(&odd, &high, sizeof odd);
  } else {
    using u16x16 = uint16_t __attribute__((vector_size(32)));
    using f16x16 = _Float16 __attribute__((vector_size(32)));
    const u16x16 low = __builtin_convertvector(w, u16x16), high = __builtin_convertvector(w >> 16, u16x16);
    f16x16 a, b;
    std::memcpy(&a, &low, sizeof a);
    std::memcpy(&b, &high, sizeof b);
    even = __builtin_convertvector(a, vfloat);
    odd = __builtin_convertvector(b, vfloat);
  }
}

// s[t * s_stride + i] = q[t] . k_i for TILE query rows (fp32, pre-scaled, HEAD_DIM apart) and 16
// positions i of one KV head's block, `keys` at the first position's word of dimension 0,
// `word_row` elements from one word row to the next (block_size * x). Two sums a row, over even
// and odd dimensions, so that no row waits on one long chain of multiply-adds.
template <int HEAD_DIM, int TILE, typename scalar_t>
inline void key_scores16(float* s, int64_t s_stride, const float* q, const scalar_t* keys, int64_t word_row) {
  vfloat even_sum[TILE] = {}, odd_sum[TILE] = {};
  for (int d = 0; d < HEAD_DIM; d += 2) {
    vfloat even, odd;  // dimensions d and d + 1 at 16 positions
    if constexpr (std::is_same_v<scalar_t, float>) {
      even = load16(keys + d * word_row);
      odd = load16(keys + (d + 1) * word_row);
    } else {
      load_word_pairs(keys + (d / 2) * word_row, even, odd);
    }
    for (int t = 0; t < TILE; ++t) {
      even_sum[t] += q[t * HEAD_DIM + d] * even;
      odd_sum[t] += q[t * HEAD_DIM + d + 1] * odd;
    }
  }
  for (int t = 0; t < TILE; ++t) store16(s + t * s_stride, even_sum[t] + odd_sum[t]);
}

// Query rows per key_scores16 tile: 2 * TILE sums plus a word row's 2 vfloats within the registers.
constexpr int kKeyTile = kVfloatRegisters >= 32 ? 4 : 2;

#if defined(__AVX512BF16__)
// key_scores16 for bf16 query rows (q_stride apart) and a bf16 or fp8 cache on avx512_bf16's dot
// product: a word row is 16 positions' (d, d + 1) pairs, which meet the query's own pair,
// broadcast, in one instruction. Each bf16 x bf16 product is exact in fp32, as after widening;
// fp8 pairs are widened to bf16 exactly first (bf16_words32).
template <int HEAD_DIM, int TILE, typename cache_t>
inline void key_scores16_bf16(float* s, int64_t s_stride, const at::BFloat16* q, int64_t q_stride,
                              const cache_t* keys, int64_t word_row, float scale) {
  __m512 even_sum[TILE], odd_sum[TILE];  // pairs (d, d + 1) with d / 2 even, and odd
  for (int t = 0; t < TILE; ++t) even_sum[t] = odd_sum[t] = _mm512_setzero_ps();
  // Unrolled whole: rolled, g++ (12) kept two temporaries for the loop, re-loading a word row
  // once per query row and spilling the other; in cache a bf16 layer of 14 sequences x 1,400
  // positions went from ~0.356 to ~0.329 ms unrolled (2-core EPYC, interleaved runs).
#pragma GCC unroll 32
  for (int p = 0; p < HEAD_DIM / 2; p += 2) {
    const __m512bh k0 = (__m512bh)bf16_words32(keys + p * word_row);
    const __m512bh k1 = (__m512bh)bf16_words32(keys + (p + 1) * word_row);
    for (int t = 0; t < TILE; ++t) {
      int32_t q0, q1;
      std::memcpy(&q0, q + t * q_stride + 2 * p, sizeof q0);
      std::memcpy(&q1, q + t * q_stride + 2 * p + 2, sizeof q1);
      even_sum[t] = _mm512_dpbf16_ps(even_sum[t], k0, (__m512bh)_mm512_set1_epi32(q0));
      odd_sum[t] = _mm512_dpbf16_ps(odd_sum[t], k1, (__m512bh)_mm512_set1_epi32(q1));
    }
  }
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int t = 0; t < TILE; ++t)
    _mm512_storeu_ps(s + t * s_stride, _mm512_mul_ps(_mm512_add_ps(even_sum[t], odd_sum[t]), scale16));
}
#else
template <int HEAD_DIM, int TILE, typename cache_t>
inline void key_scores16_bf16(float*, int64_t, const at::BFloat16*, int64_t, const cache_t*, int64_t,
                              float) {}  // never called
#endif

// Dimension d of position `slot` in one KV head's block of the layout (the scalar path).
template <typename scalar_t>
inline float key_at(const scalar_t* keys, int64_t block_size, int64_t slot, int64_t d) {
  constexpr int64_t x = kKeyWordElements<scalar_t>;
  return static_cast<float>(keys[(d / x) * block_size * x + slot * x + d % x]);
}

}  // namespace kvfleet_cpu
