// The decode kernel's V pass (kvfleet_kernels/csrc/paged_decode_cpu.cpp): acc[t] += sum over
// slots i of weights[t][i] * value_row[i] for the query rows t of a GQA group. Tiled for head
// sizes 64 and 128 (fp32, with 8-lane vectors where 16-lane sums would not fit the registers,
// and bf16 on avx512_bf16's dot product), a plain loop for other sizes. Its K pass is
// csrc/decode_keys.h, its AMX form csrc/decode_amx.h.
//
// The CPU value cache layout: [num_blocks, num_kv_heads, block_size / y, head_dim, y], y the
// positions to a 32-bit word: 2 for bf16, 1 otherwise (plain rows). Per block a KV head's values
// are contiguous, as its keys are (csrc/decode_keys.h): a head's walk over its blocks reads whole
// runs of lines. Why pairs for bf16: both bf16 products, avx512_bf16's dot product and AMX's
// tiles, take two positions' values of a dimension side by side in one word, against their two
// weights. Stored that way, a pair row is read as it lies; stored as rows, the dot product had
// to interleave every two rows first (two unpacks a 32 dimensions), and AMX to pack 32
// positions into a buffer before each product, which made its V pass slower than the dot
// product's (8 sequences x 400 positions in L2, 2-core Xeon with AMX: 33 against 25 us).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>

#include "cpu_vec.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace kvfleet_cpu {

// y of the value layout: positions to a word of a value cache of this dtype: 2 for bf16 (a
// 32-bit word) and fp8 (16 bits, one bf16 pair in registers), else 1;
// kvfleet_kernels/cpu_paged_attention.py's value_word_elements is its Python twin.
inline int64_t value_word_elements(at::ScalarType dtype) {
  return dtype == at::kBFloat16 || dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2 ? 2 : 1;
}
template <typename scalar_t>
constexpr int64_t kValueWordElements = std::is_same_v<scalar_t, at::BFloat16> || kIsFp8<scalar_t> ? 2 : 1;

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
// The V pass of bf16 caches on avx512_bf16: acc[t] += sum over positions i in [lo, hi) of
// weights[t][i] * value_i, for TILE query rows, over one KV head's pair rows (pair row j: the
// words of positions 2j and 2j + 1, `pairs` + j * pair_stride). A word row meets the word of its
// two bf16 weights, broadcast, in one instruction. The weights are the softmax numerators rounded
// to bf16, as torch's bf16 attention rounds its probabilities before the product with V; the sums
// stay fp32. A pair with one position outside [lo, hi) loads that half as zero: its weight is zero
// too, but its slot may hold a freed sequence's values, NaN included, and 0 x NaN is NaN.
template <int HEAD_DIM, int TILE, typename cache_t>
inline void weighted_pairs_add_tile_bf16(float* acc, int64_t acc_stride, const uint16_t* weights,
                                         int64_t weight_stride, const cache_t* pairs, int64_t pair_stride,
                                         int64_t lo, int64_t hi) {
  constexpr int kWords = HEAD_DIM / 16;  // 16-word registers per pair row: 16 dimensions each
  __m512 sum[TILE][kWords];
  for (int t = 0; t < TILE; ++t)
    for (int k = 0; k < kWords; ++k) sum[t][k] = _mm512_loadu_ps(acc + t * acc_stride + 16 * k);
  auto accumulate = [&](int64_t j, __mmask32 keep) {
    __m512i words[kWords];
    for (int k = 0; k < kWords; ++k) {
      if constexpr (kIsFp8<cache_t>) words[k] = _mm512_maskz_mov_epi16(keep, bf16_words32(pairs + j * pair_stride + 32 * k));
      else words[k] = _mm512_maskz_loadu_epi16(keep, pairs + j * pair_stride + 32 * k);
    }
    for (int t = 0; t < TILE; ++t) {
      uint32_t w;
      std::memcpy(&w, weights + t * weight_stride + 2 * j, sizeof(w));
      const __m512bh w2 = (__m512bh)_mm512_set1_epi32(static_cast<int>(w));
      for (int k = 0; k < kWords; ++k) sum[t][k] = _mm512_dpbf16_ps(sum[t][k], (__m512bh)words[k], w2);
    }
  };
  int64_t j = lo / 2;
  if (lo % 2) accumulate(j++, 0xAAAAAAAAu);  // only position 2j + 1 = lo
  for (; 2 * j + 1 < hi; ++j) accumulate(j, 0xFFFFFFFFu);
  if (2 * j < hi) accumulate(j, 0x55555555u);  // only position 2j = hi - 1
  for (int t = 0; t < TILE; ++t)
    for (int k = 0; k < kWords; ++k) _mm512_storeu_ps(acc + t * acc_stride + 16 * k, sum[t][k]);
}

// 16 softmax numerators rounded to bf16 (nearest even) by avx512_bf16's convert: one
// instruction for store16's six. It flushes denormals, which never come here: exp16's floor
// keeps every numerator at e^-87 or above, a normal float.
inline void store_probabilities16(at::BFloat16* p, vfloat v) {
  __m512 x;
  std::memcpy(&x, &v, sizeof x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
}

#else
template <int HEAD_DIM, int TILE, typename cache_t>
inline void weighted_pairs_add_tile_bf16(float*, int64_t, const uint16_t*, int64_t, const cache_t*, int64_t,
                                         int64_t, int64_t) {}  // never called
inline void store_probabilities16(at::BFloat16* p, vfloat v) { store16(p, v); }  // never called
#endif

// acc[0:head_dim] += sum over rows i of weights[i] * rows[i], rows[i] = first + i * row_stride:
// the V pass for head sizes other than 64 and 128 (those run weighted_rows_add_group).
template <typename scalar_t>
inline void weighted_rows_add(float* acc, const float* weights, const scalar_t* first, int64_t row_stride,
                              int64_t num_rows, int64_t head_dim) {
  for (int64_t i = 0; i < num_rows; ++i)
    for (int64_t d = 0; d < head_dim; ++d) acc[d] += weights[i] * static_cast<float>(first[i * row_stride + d]);
}

// weighted_rows_add_tile for fp32 rows where its TILE * HEAD_DIM / 16 sums do not fit the
// registers (AVX2, NEON: 8 vfloats): 16 dimensions at a time, as two 8-lane sums a query row
// (g++ kept arrays of 16-lane ones on the stack), re-reading the block's rows from L1 once per
// 16 dimensions. Holding every sum spilled them, a load and a store around each multiply-add:
// the whole kernel ran ~5.2 ms a layer on a 2-core AVX2 host where it runs ~3.4 this way
// (fp32, 40 sequences x 450 positions, 9/3 heads of 64).
template <int HEAD_DIM, int TILE>
inline void weighted_rows_add_tile_narrow(float* acc, int64_t acc_stride, const float* weights,
                                          int64_t weight_stride, const float* first, int64_t row_stride,
                                          int64_t num_rows) {
  for (int c = 0; c < HEAD_DIM; c += 2 * kHalfLanes) {
    vfloat8 low[TILE], high[TILE];
    for (int t = 0; t < TILE; ++t) {
      low[t] = load8(acc + t * acc_stride + c);
      high[t] = load8(acc + t * acc_stride + c + kHalfLanes);
    }
    for (int64_t i = 0; i < num_rows; ++i) {
      const float* row = first + i * row_stride + c;
      const vfloat8 v_low = load8(row), v_high = load8(row + kHalfLanes);
      for (int t = 0; t < TILE; ++t) {
        const float w = weights[t * weight_stride + i];
        low[t] += w * v_low;
        high[t] += w * v_high;
      }
    }
    for (int t = 0; t < TILE; ++t) {
      store8(acc + t * acc_stride + c, low[t]);
      store8(acc + t * acc_stride + c + kHalfLanes, high[t]);
    }
  }
}

// The V pass for TILE query rows of one GQA group at once: acc[t] += sum over rows i of
// weights[t * weight_stride + i] * rows[i]. Each V row is loaded (and widened from bf16/fp16)
// once into registers and feeds all TILE accumulators, which stay in registers for the
// block: widening a block into a buffer and re-reading it per query row cost about twice the
// instructions. TILE * HEAD_DIM / 16 accumulators plus a row's HEAD_DIM / 16 must fit the 32
// vector registers (AVX-512); where they do not, fp32 rows take the narrow form above.
template <int HEAD_DIM, int TILE, typename scalar_t>
inline void weighted_rows_add_tile(float* acc, int64_t acc_stride, const float* weights, int64_t weight_stride,
                                   const scalar_t* first, int64_t row_stride, int64_t num_rows) {
  constexpr int kChunks = HEAD_DIM / kLanes;
  if constexpr ((TILE + 1) * kChunks > kVfloatRegisters && std::is_same_v<scalar_t, float>) {
    weighted_rows_add_tile_narrow<HEAD_DIM, TILE>(acc, acc_stride, weights, weight_stride, first, row_stride, num_rows);
    return;
  }
  vfloat sum[TILE][kChunks];
  for (int t = 0; t < TILE; ++t)
    for (int c = 0; c < kChunks; ++c) sum[t][c] = load16(acc + t * acc_stride + c * kLanes);
  for (int64_t i = 0; i < num_rows; ++i) {
    const scalar_t* row = first + i * row_stride;
    vfloat v[kChunks];
    for (int c = 0; c < kChunks; ++c) v[c] = load16(row + c * kLanes);
    for (int t = 0; t < TILE; ++t) {
      const float w = weights[t * weight_stride + i];
      for (int c = 0; c < kChunks; ++c) sum[t][c] += w * v[c];
    }
  }
  for (int t = 0; t < TILE; ++t)
    for (int c = 0; c < kChunks; ++c) store16(acc + t * acc_stride + c * kLanes, sum[t][c]);
}

// Query rows per V-pass tile: TILE * HEAD_DIM / 16 accumulators plus a V row's (or row
// pair's) HEAD_DIM / 16 registers within the 32.
template <int HEAD_DIM>
constexpr int kVTile = HEAD_DIM <= 64 ? 4 : 2;

// The V pass for `count` query rows (a GQA group) of fp32 weights.
template <int HEAD_DIM, typename scalar_t>
inline void weighted_rows_add_group(float* acc, const float* weights, int64_t weight_stride, const scalar_t* first,
                                    int64_t row_stride, int64_t num_rows, int64_t count) {
  for_each_tile<kVTile<HEAD_DIM>>(count, [&](auto tile, int64_t r) {
    weighted_rows_add_tile<HEAD_DIM, decltype(tile)::value>(acc + r * HEAD_DIM, HEAD_DIM, weights + r * weight_stride,
                                                            weight_stride, first, row_stride, num_rows);
  });
}

// The positions [lo, hi) of one KV head of a value cache block, widened to fp32 once into `dst`
// ([block_size, head_dim]) so that the GQA group's query rows read them without converting
// each again (the V pass of head sizes other than 64 and 128, and of bf16 without
// avx512_bf16); fp32 rows are read in place. `rows` is the head's first word row, word rows
// (y positions each) word_row_stride apart.
template <typename scalar_t>
inline void widen_rows(float* dst, const scalar_t* rows, int64_t word_row_stride, int64_t lo, int64_t hi,
                       int64_t head_dim) {
  constexpr int64_t y = kValueWordElements<scalar_t>;
  for (int64_t i = lo; i < hi; ++i) {
    const scalar_t* row = rows + i / y * word_row_stride + i % y;
    int64_t d = 0;
    if constexpr (y == 1)
      for (; d + kLanes <= head_dim; d += kLanes) store16(dst + i * head_dim + d, load16(row + d));
    for (; d < head_dim; ++d) dst[i * head_dim + d] = static_cast<float>(row[d * y]);
  }
}

}  // namespace kvfleet_cpu
