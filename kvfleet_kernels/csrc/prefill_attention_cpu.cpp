// Causal prefill attention for bf16 models on CPUs with avx512_bf16: one sequence's new tokens
// (the last Q positions of its context) over its whole context, optionally inside a sliding
// window. Same contract as kvfleet_kernels.reference.prefill_attention without sinks; called through
// kvfleet_kernels/cpu_prefill_attention.py.
//
// Why native: torch's CPU flash kernel runs bf16 no faster than fp32 (~115 GFLOP/s here at
// 1,500 tokens of SmolLM2's 9/3 heads of 64, where a bf16 matmul reaches ~375), and a
// document's prefill spent half its time there. Both products here run on avx512_bf16's dot
// product (32 bf16 products into 16 fp32 sums an instruction), on operands laid out once per
// KV head in the pairs it reads: K as [D / 2][C] words of two adjacent dimensions, V as
// [C / 2][D] words of two adjacent keys. The softmax is exact per row (all its scores, then
// max, exp and sum in fp32); the probabilities are rounded to bf16 for the second product, as
// torch's flash kernel and FlashAttention do.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "prefill_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using namespace kvfleet_cpu;  // NOLINT: the vector helpers are this kernel's vocabulary

constexpr int64_t kBlockPositions = 8;  // query positions per work item (times the GQA group: its rows)
constexpr int64_t kKeyTile = 64;        // keys per score tile: four vectors of 16

bool bf16_prefill_available() { return kHasBf16Dot; }

#if defined(__AVX512BF16__)

struct Shape {
  int64_t num_queries, context_len, padded_len, num_heads, num_kv_heads, head_dim, group, window;
  int64_t q_row, q_head, k_row, k_head, v_row, v_head, out_row, out_head;
  float scale;
};

// A bf16 pair read as one 32-bit word (the first element in the low half).
inline uint32_t pair_word(const at::BFloat16* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof word);
  return word;
}

// One KV head's K as [D / 2][padded_len] words (dims 2i, 2i + 1 of each key) and V as
// [padded_len / 2][D] words (keys 2j, 2j + 1 of each dim); keys past the context are zero.
void pack_head(uint32_t* key_pairs, uint32_t* value_pairs, const at::BFloat16* key, const at::BFloat16* value,
               const Shape& s) {
  const int64_t half_dim = s.head_dim / 2;
  for (int64_t c = 0; c < s.padded_len; ++c)
    for (int64_t i = 0; i < half_dim; ++i)
      key_pairs[i * s.padded_len + c] = c < s.context_len ? pair_word(key + c * s.k_row + 2 * i) : 0u;
  for (int64_t j = 0; j < s.padded_len / 2; ++j) {
    for (int64_t d = 0; d < s.head_dim; ++d) {
      const int64_t c = 2 * j;
      uint16_t low = 0, high = 0;
      if (c < s.context_len) std::memcpy(&low, value + c * s.v_row + d, 2);
      if (c + 1 < s.context_len) std::memcpy(&high, value + (c + 1) * s.v_row + d, 2);
      value_pairs[j * s.head_dim + d] = static_cast<uint32_t>(low) | (static_cast<uint32_t>(high) << 16);
    }
  }
}

// scores[t][k0, k1) = scale * q_t . key_k for TILE query rows (their bf16 words q_words[t]),
// 64 keys a pass: TILE * 4 independent accumulators per pass over the dimensions, each
// broadcast query word feeding four products. TILE is a compile-time constant so that the
// accumulators stay in registers: with a runtime row count g++ kept them on the stack and
// stored all sixteen every pass (a third of the kernel's time went to this loop).
template <int TILE>
void score_tile(float* scores, int64_t score_stride, const uint32_t* const* q_words, const uint32_t* key_pairs,
                int64_t k0, int64_t k1, const Shape& s) {
  constexpr int kVectors = kKeyTile / 16;
  const int64_t half_dim = s.head_dim / 2;
  const __m512 scale = _mm512_set1_ps(s.scale);
  for (int64_t k = k0; k < k1; k += kKeyTile) {
    __m512 acc[TILE][kVectors];
    for (int t = 0; t < TILE; ++t)
      for (int c = 0; c < kVectors; ++c) acc[t][c] = _mm512_setzero_ps();
    const uint32_t* keys_at = key_pairs + k;
    for (int64_t i = 0; i < half_dim; ++i, keys_at += s.padded_len) {
      __m512bh keys[kVectors];
      for (int c = 0; c < kVectors; ++c) keys[c] = (__m512bh)_mm512_loadu_si512(keys_at + 16 * c);
      for (int t = 0; t < TILE; ++t) {
        const __m512bh q = (__m512bh)_mm512_set1_epi32(static_cast<int>(q_words[t][i]));
        for (int c = 0; c < kVectors; ++c) acc[t][c] = _mm512_dpbf16_ps(acc[t][c], q, keys[c]);
      }
    }
    for (int t = 0; t < TILE; ++t)
      for (int c = 0; c < kVectors; ++c)
        _mm512_storeu_ps(scores + t * score_stride + k + 16 * c, _mm512_mul_ps(acc[t][c], scale));
  }
}

// score_tile over `rows` query rows: four at a time, then the rest as one tile.
void score_rows(float* scores, int64_t score_stride, const uint32_t* const* q_words, int64_t rows,
                const uint32_t* key_pairs, int64_t k0, int64_t k1, const Shape& s) {
  for_each_tile<4>(rows, [&](auto tile, int64_t r) {
    score_tile<decltype(tile)::value>(scores + r * score_stride, score_stride, q_words + r, key_pairs, k0, k1, s);
  });
}

// Row r's softmax over keys [lo, hi) in place, as bf16 pair words in prob_words[k0 / 2, k1 / 2)
// (zero outside [lo, hi)); returns 1 / sum for the output. k0 and k1 are multiples of kKeyTile.
float softmax_row(uint32_t* prob_words, float* scores, int64_t lo, int64_t hi, int64_t k0, int64_t k1) {
  using i32x16 = int32_t __attribute__((vector_size(64)));
  const i32x16 lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const vfloat row_max = vfloat{} + max_of(scores + lo, hi - lo);
  vfloat total{};
  for (int64_t k = k0; k < k1; k += kLanes) {
    const i32x16 key = lanes + static_cast<int32_t>(k);
    const vfloat p = (key >= static_cast<int32_t>(lo)) & (key < static_cast<int32_t>(hi))
                         ? exp16(load16(scores + k) - row_max) : vfloat{};
    store16(scores + k, p);
    total += p;
  }
  for (int64_t k = k0; k < k1; k += 32) {
    const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(scores + k + 16), _mm512_loadu_ps(scores + k));
    _mm512_storeu_si512(prob_words + k / 2, (__m512i)pairs);
  }
  return 1.f / reduce_add(total);
}

// out rows += probabilities . V for TILE rows over key pairs [j0, j1): each V word vector
// loaded once feeds TILE rows; TILE * D / 16 accumulators stay in registers.
template <int HEAD_DIM, int TILE>
void weigh_values(float* acc, const uint32_t* const* prob_words, const uint32_t* value_pairs, int64_t j0, int64_t j1) {
  constexpr int kChunks = HEAD_DIM / 16;
  __m512 sum[TILE][kChunks];
  for (int t = 0; t < TILE; ++t)
    for (int c = 0; c < kChunks; ++c) sum[t][c] = _mm512_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    __m512bh v[kChunks];
    for (int c = 0; c < kChunks; ++c) v[c] = (__m512bh)_mm512_loadu_si512(value_pairs + j * HEAD_DIM + 16 * c);
    for (int t = 0; t < TILE; ++t) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(prob_words[t][j]));
      for (int c = 0; c < kChunks; ++c) sum[t][c] = _mm512_dpbf16_ps(sum[t][c], p, v[c]);
    }
  }
  for (int t = 0; t < TILE; ++t)
    for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(acc + t * HEAD_DIM + 16 * c, sum[t][c]);
}

template <int HEAD_DIM>
void weigh_all(float* acc, const uint32_t* const* prob_words, int64_t rows, const uint32_t* value_pairs, int64_t j0,
               int64_t j1) {
  for_each_tile<HEAD_DIM <= 64 ? 4 : 2>(rows, [&](auto tile, int64_t r) {
    weigh_values<HEAD_DIM, decltype(tile)::value>(acc + r * HEAD_DIM, prob_words + r, value_pairs, j0, j1);
  });
}

// The rows of one work item: query positions [p0, p1) of the new tokens, every query head of
// KV head `kv_head`. Keys a position sees: [its window start, its context position].
template <int HEAD_DIM>
void attend_block(at::BFloat16* out, const at::BFloat16* query, const uint32_t* key_pairs, const uint32_t* value_pairs,
                  int64_t kv_head, int64_t p0, int64_t p1, const Shape& s, std::vector<float>& scores,
                  std::vector<uint32_t>& prob_words, std::vector<float>& acc) {
  const int64_t rows = (p1 - p0) * s.group, offset = s.context_len - s.num_queries;
  auto key_range = [&](int64_t position) {  // [lo, hi) of context keys the query at `position` sees
    const int64_t context_pos = offset + position;
    return std::pair<int64_t, int64_t>{s.window > 0 ? std::max<int64_t>(0, context_pos - s.window + 1) : 0,
                                       context_pos + 1};
  };
  const int64_t k0 = key_range(p0).first / kKeyTile * kKeyTile;
  const int64_t k1 = (key_range(p1 - 1).second + kKeyTile - 1) / kKeyTile * kKeyTile;
  std::vector<uint32_t> q_buffer(rows * HEAD_DIM / 2);  // each row's query as bf16 pair words
  std::vector<const uint32_t*> q_words(rows), row_probs(rows);
  for (int64_t r = 0; r < rows; ++r) {  // row r: position p0 + r / group, query head kv_head * group + r % group
    const at::BFloat16* q = query + (p0 + r / s.group) * s.q_row + (kv_head * s.group + r % s.group) * s.q_head;
    std::memcpy(q_buffer.data() + r * HEAD_DIM / 2, q, HEAD_DIM * sizeof(at::BFloat16));
    q_words[r] = q_buffer.data() + r * HEAD_DIM / 2;
    row_probs[r] = prob_words.data() + r * (s.padded_len / 2);
  }
  score_rows(scores.data(), s.padded_len, q_words.data(), rows, key_pairs, k0, k1, s);
  std::vector<float> inv_sum(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const auto [lo, hi] = key_range(p0 + r / s.group);
    inv_sum[r] = softmax_row(prob_words.data() + r * (s.padded_len / 2), scores.data() + r * s.padded_len, lo, hi,
                             k0, k1);
  }
  weigh_all<HEAD_DIM>(acc.data(), row_probs.data(), rows, value_pairs, k0 / 2, k1 / 2);
  for (int64_t r = 0; r < rows; ++r) {
    at::BFloat16* o = out + (p0 + r / s.group) * s.out_row + (kv_head * s.group + r % s.group) * s.out_head;
    for (int64_t d = 0; d < HEAD_DIM; ++d) o[d] = static_cast<at::BFloat16>(acc[r * HEAD_DIM + d] * inv_sum[r]);
  }
}

template <int HEAD_DIM>
void prefill_kernel(at::BFloat16* out, const at::BFloat16* query, const at::BFloat16* key, const at::BFloat16* value,
                    const Shape& s) {
  const int64_t half_dim = s.head_dim / 2;
  std::vector<uint32_t> key_pairs(s.num_kv_heads * half_dim * s.padded_len);  // per head [D / 2][padded_len]
  std::vector<uint32_t> value_pairs(s.num_kv_heads * s.padded_len / 2 * s.head_dim);  // per head [padded_len / 2][D]
  at::parallel_for(0, s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h)
      pack_head(key_pairs.data() + h * half_dim * s.padded_len, value_pairs.data() + h * s.padded_len / 2 * s.head_dim,
                key + h * s.k_head, value + h * s.v_head, s);
  });
  // Items (KV head, block of positions) cost about the keys their last position sees, which
  // grow along the causal triangle.
  const int64_t blocks = (s.num_queries + kBlockPositions - 1) / kBlockPositions, num_items = s.num_kv_heads * blocks;
  std::vector<int64_t> cost_before(num_items + 1, 0);
  for (int64_t item = 0; item < num_items; ++item) {
    const int64_t last = std::min((item % blocks + 1) * kBlockPositions, s.num_queries) + s.context_len - s.num_queries;
    cost_before[item + 1] = cost_before[item] + (s.window > 0 ? std::min(last, s.window) : last) + kKeyTile;
  }
  parallel_for_by_cost(cost_before, [&](int64_t begin, int64_t end) {
    const int64_t max_rows = kBlockPositions * s.group;
    std::vector<float> scores(max_rows * s.padded_len), acc(max_rows * HEAD_DIM);
    std::vector<uint32_t> prob_words(max_rows * s.padded_len / 2);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / blocks, p0 = (item % blocks) * kBlockPositions;
      attend_block<HEAD_DIM>(out, query, key_pairs.data() + h * half_dim * s.padded_len,
                             value_pairs.data() + h * s.padded_len / 2 * s.head_dim, h, p0,
                             std::min(p0 + kBlockPositions, s.num_queries), s, scores, prob_words, acc);
    }
  });
}

#endif  // __AVX512BF16__

// out, query: [Q, Hq, D] bf16; key, value: [C, Hkv, D] bf16, C >= Q (the queries are the last
// Q positions of the context); rows of any stride, D dense; D 64 or 128; sliding_window 0: none.
void prefill_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       double scale, int64_t sliding_window) {
  TORCH_CHECK(bf16_prefill_available(), "prefill_attention needs avx512_bf16");
  kvfleet_cpu::check_prefill_attention(out, query, key, value);
  TORCH_CHECK(query.size(2) == key.size(2) && (query.size(2) == 64 || query.size(2) == 128),
              "head_dim must be 64 or 128 and shared by query and key");
#if defined(__AVX512BF16__)
  const int64_t context_len = key.size(0);
  const Shape s{query.size(0), context_len, (context_len + kKeyTile - 1) / kKeyTile * kKeyTile, query.size(1),
                key.size(1), query.size(2), query.size(1) / key.size(1), sliding_window > 0 ? sliding_window : 0,
                query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                out.stride(0), out.stride(1), static_cast<float>(scale)};
  auto run = [&](auto kernel) {
    kernel(out.data_ptr<at::BFloat16>(), query.const_data_ptr<at::BFloat16>(), key.const_data_ptr<at::BFloat16>(),
           value.const_data_ptr<at::BFloat16>(), s);
  };
  if (s.head_dim == 64) run(prefill_kernel<64>);
  else run(prefill_kernel<128>);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("prefill_attention(Tensor(a!) out, Tensor query, Tensor key, Tensor value, float scale, "
        "int sliding_window) -> ()");
  m.def("bf16_prefill_available() -> bool", &bf16_prefill_available);
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
