// Paged decode attention for the CPU: one new query token per sequence, reading K/V
// in place through the block table (no gather into padded buffers), the CPU peer of
// kvfleet_kernels/paged_attention.py. Same contract as kvfleet_kernels.reference.paged_decode_attention.
//
// Why native code: on the CPU the torch path gathers every sequence's blocks into a
// [num_seqs, max_context] buffer and runs SDPA over strided rows; that moves the KV
// three times and pads to the longest context. Here each (sequence, KV head) streams
// its own blocks once, and all query heads of a GQA group share each K/V row read.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "decode_dot.h"
#include "decode_keys.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using namespace kvfleet_cpu;  // NOLINT: the vector helpers are this kernel's vocabulary

// cache_*: the value cache's [num_blocks, block_size, num_kv_heads, head_dim]; key_*: the key
// cache's [num_blocks, num_kv_heads, head_dim / x, block_size, x] (csrc/decode_keys.h).
struct Strides {
  int64_t query_seq, query_head, out_seq, out_head, table_seq, cache_block, cache_slot, cache_head, key_block,
      key_head;
};

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

// The rows [lo, hi) of one KV head of a value cache block, widened to fp32 once into `dst`
// ([block_size, head_dim]) so that the GQA group's query rows read them without converting
// each again (the V pass of head sizes other than 64 and 128); fp32 rows are read in place.
template <typename scalar_t>
inline void widen_rows(float* dst, const scalar_t* rows, int64_t row_stride, int64_t lo, int64_t hi,
                       int64_t head_dim) {
  for (int64_t i = lo; i < hi; ++i) {
    int64_t d = 0;
    for (; d + kLanes <= head_dim; d += kLanes) store16(dst + i * head_dim + d, load16(rows + i * row_stride + d));
    for (; d < head_dim; ++d) dst[i * head_dim + d] = static_cast<float>(rows[i * row_stride + d]);
  }
}

// Blocks sit wherever the allocator put them, so the hardware prefetcher, which follows
// sequential streams within a page, stalls at every block boundary. The walk asks for the
// block kPrefetchBlocks ahead while it works on this one: `rows` slots of `row_elements`
// elements, `row_stride` apart.
constexpr int64_t kPrefetchBlocks = 2;
template <int kLocality = 3, typename scalar_t>
inline void prefetch_block(const scalar_t* block, int64_t rows, int64_t row_stride, int64_t row_elements) {
  constexpr int64_t kLine = 64 / sizeof(scalar_t);  // elements per cache line
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t e = 0; e < row_elements; e += kLine) __builtin_prefetch(block + row * row_stride + e, 0, kLocality);
}

// A work item is one sequence and a span of its KV heads. With many sequences the span is
// every head, so each value block [block_size, num_kv_heads, head_dim] and each block's keys
// of the span are contiguous reads (22% faster than a head at a time at batch 64 here); with
// few, items are single heads so that every thread still has work. Within a block the loops
// run head by head: the K pass scores 16 slots at a time for the whole GQA group from one read
// of each word row of keys (csrc/decode_keys.h), the V pass reads each V row once for the
// whole group, its accumulators in registers for the block.
template <typename scalar_t, int HEAD_DIM>
void decode_kernel(scalar_t* out, const scalar_t* query, const scalar_t* key_cache, const scalar_t* value_cache,
                   const int64_t* block_tables, const int64_t* context_lens, const float* sinks, int64_t num_seqs,
                   int64_t num_heads, int64_t num_kv_heads, int64_t runtime_head_dim, int64_t block_size,
                   float scale, int64_t sliding_window, int64_t max_context, Strides st) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : runtime_head_dim;
  // Row stride of the score buffers: whole blocks, as the K pass writes runs of 16 slots.
  const int64_t score_stride = (max_context + block_size - 1) / block_size * block_size;
  // bf16 caches of head size 64 or 128 on avx512_bf16: both passes on its dot product.
  constexpr bool kDotBf16 = kHasBf16Dot && std::is_same_v<scalar_t, at::BFloat16> && HEAD_DIM > 0 &&
                            HEAD_DIM % 32 == 0;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t span = num_seqs >= 4 * at::get_num_threads() ? num_kv_heads : 1;  // KV heads per item
  const int64_t spans_per_seq = num_kv_heads / span;
  const int64_t rows = span * group;  // query heads per item
  // Work item `work`: its sequence and first KV head, its context length, and the positions
  // [first, len) it reads (a sliding window's last ones), in blocks [first_block, end_block).
  struct Item {
    int64_t seq, first_kv_head, len, first, first_block, end_block;
  };
  auto item_at = [&](int64_t work) {
    const int64_t seq = work / spans_per_seq, len = context_lens[seq];
    const int64_t first = sliding_window > 0 && len > sliding_window ? len - sliding_window : 0;
    return Item{seq, (work % spans_per_seq) * span, len, first, first / block_size, (len + block_size - 1) / block_size};
  };
  // Items cost about their number of positions, which differ by up to the longest context
  // (an even split of the item range left half the bandwidth unused at the end).
  const int64_t num_items = num_seqs * spans_per_seq;
  std::vector<int64_t> cost_before(num_items + 1, 0);  // [num_items + 1], prefix sums
  for (int64_t work = 0; work < num_items; ++work) {
    const Item item = item_at(work);
    cost_before[work + 1] = cost_before[work] + (item.len - item.first) + block_size;  // + a block's fixed work
  }
  parallel_for_by_cost(cost_before, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(rows * score_stride);  // [rows, score_stride]
    std::vector<float> queries(rows * head_dim);    // [rows, head_dim], fp32, pre-scaled
    std::vector<float> acc(rows * head_dim);        // [rows, head_dim]
    std::vector<float> row_max(rows), inv_sum(rows);
    std::vector<float> widened(block_size * head_dim);  // [block_size, head_dim], one KV head's rows in fp32
    std::vector<at::BFloat16> probs(kDotBf16 ? rows * score_stride : 0);  // [rows, score_stride], bf16 weights
    for (int64_t work = begin; work < end; ++work) {
      const Item item = item_at(work);
      const int64_t seq = item.seq, first_kv_head = item.first_kv_head, len = item.len, first = item.first;
      const int64_t* table = block_tables + seq * st.table_seq;
      auto raw_query = [&](int64_t r) {  // row r is query head first_kv_head * group + r
        return query + seq * st.query_seq + (first_kv_head * group + r) * st.query_head;
      };
      for (int64_t r = 0; r < rows; ++r) {
        const scalar_t* q = raw_query(r);
        for (int64_t d = 0; d < head_dim; ++d) queries[r * head_dim + d] = static_cast<float>(q[d]) * scale;
      }

      // The walk over the value cache's blocks of [first, len): visit(rows, head, start, lo, hi)
      // for each KV head of the item in each block, rows pointing at slot 0 of that head as
      // stored, slots [lo, hi) in range; with `prefetch_ahead` it asks for the block
      // kPrefetchBlocks ahead, a KV head's share of its rows before that head's work.
      auto for_each_block = [&](const scalar_t* cache, bool prefetch_ahead, auto&& visit) {
        for (int64_t start = first - first % block_size; start < len; start += block_size) {
          const int64_t offset = table[start / block_size] * st.cache_block + first_kv_head * st.cache_head;
          const bool ahead = prefetch_ahead && start + kPrefetchBlocks * block_size < len;
          const scalar_t* ahead_block = ahead ? cache + table[start / block_size + kPrefetchBlocks] * st.cache_block +
                                                    first_kv_head * st.cache_head : nullptr;
          const int64_t lo = std::max<int64_t>(first - start, 0), hi = std::min(len - start, block_size);
          for (int64_t head = 0; head < span; ++head) {
            const int64_t row0 = head * block_size / span, row1 = (head + 1) * block_size / span;
            if (ahead) prefetch_block(ahead_block + row0 * st.cache_slot, row1 - row0, st.cache_slot, span * st.cache_head);
            visit(cache + offset + head * st.cache_head, head, start, lo, hi);
          }
        }
      };
      // One KV head's keys in a block: [head_dim / x, block_size, x], contiguous.
      auto keys_of = [&](int64_t block, int64_t head) {
        return key_cache + block * st.key_block + (first_kv_head + head) * st.key_head;
      };
      // Scores of the GQA group [r0, r0 + group) at the slots [lo, hi) of one KV head's block,
      // into s [group, score_stride] (at the block's start). Whole runs of 16 slots compute all
      // 16, those outside [lo, hi) never read; the scalar loop serves other head sizes and blocks.
      auto key_scores = [&](float* s, int64_t r0, const scalar_t* keys, int64_t lo, int64_t hi) {
        constexpr int64_t x = kKeyWordElements<scalar_t>;
        if constexpr (HEAD_DIM > 0 && HEAD_DIM % kLanes == 0) {
          if (block_size % kLanes == 0) {
            for (int64_t c = lo - lo % kLanes; c < hi; c += kLanes) {
              for_each_tile<kKeyTile>(group, [&](auto tile, int64_t t) {
                constexpr int kTile = decltype(tile)::value;
                if constexpr (kDotBf16) {
                  key_scores16_bf16<HEAD_DIM, kTile>(s + t * score_stride + c, score_stride, raw_query(r0 + t),
                                                     st.query_head, keys + c * x, block_size * x, scale);
                } else {
                  key_scores16<HEAD_DIM, kTile>(s + t * score_stride + c, score_stride,
                                                queries.data() + (r0 + t) * head_dim, keys + c * x, block_size * x);
                }
              });
            }
            return;
          }
        }
        for (int64_t t = 0; t < group; ++t) {
          const float* q = queries.data() + (r0 + t) * head_dim;
          for (int64_t slot = lo; slot < hi; ++slot) {
            float total = 0.f;
            for (int64_t d = 0; d < head_dim; ++d) total += q[d] * key_at(keys, block_size, slot, d);
            s[t * score_stride + slot] = total;
          }
        }
      };
      // The K pass, block by block and KV head by KV head. With each head's work it asks for
      // that head's keys kPrefetchBlocks blocks ahead, and for its share of this block's values
      // into L2: the V pass has too little work per block to hide DRAM latency behind its own
      // prefetch (its loads were a third of the kernel's time), while the K pass computes long
      // enough per block. Issued a head's share at a time, not the whole block's at once: the
      // burst waited on the core's few line-fill buffers (perf put ~35% of the kernel's samples on
      // its prefetches, 2-core Xeon with AMX), and spread out a bf16 layer of 64 sequences x 420
      // positions from DRAM went from ~1.28 to ~1.15 ms there. The keys ahead go to L2, not L1:
      // with the K pass's compute cut by the key layout, on a 2-core EPYC with avx512_bf16 a bf16
      // layer from DRAM with blocks scattered went from ~0.82 to ~0.72 ms (64 x 335 positions)
      // and from ~1.3 to ~1.1 ms (16 x 1,700), interleaved runs.
      for (int64_t start = first - first % block_size; start < len; start += block_size) {
        const int64_t block = table[start / block_size];
        const bool ahead = start + kPrefetchBlocks * block_size < len;
        const int64_t lo = std::max<int64_t>(first - start, 0), hi = std::min(len - start, block_size);
        const scalar_t* values = value_cache + block * st.cache_block + first_kv_head * st.cache_head;
        for (int64_t head = 0; head < span; ++head) {
          if (ahead) prefetch_block<1>(keys_of(table[start / block_size + kPrefetchBlocks], head), 1, 0, head_dim * block_size);
          const int64_t row0 = head * block_size / span, row1 = (head + 1) * block_size / span;
          prefetch_block<1>(values + row0 * st.cache_slot, row1 - row0, st.cache_slot, span * st.cache_head);
          key_scores(scores.data() + head * group * score_stride + start, head * group, keys_of(block, head), lo, hi);
        }
      }
      // Softmax numerators, in place in `scores` (for the bf16 V pass rounded to bf16 in `probs`
      // instead); the 1/sum is applied once to the output. A sink (gpt-oss) is one more logit in the max and
      // the sum that adds nothing to the output.
      for (int64_t r = 0; r < rows; ++r) {
        float* s = scores.data() + r * score_stride;
        at::BFloat16* p = probs.data() + r * score_stride;
        row_max[r] = max_of(s + first, len - first);
        const float sink = sinks ? sinks[first_kv_head * group + r] : 0.f;
        if (sinks) row_max[r] = std::max(row_max[r], sink);
        const vfloat max16 = vfloat{} + row_max[r];
        vfloat sum16{};
        int64_t pos = first;
        for (; pos + kLanes <= len; pos += kLanes) {
          const vfloat numerators = exp16(load16(s + pos) - max16);
          if constexpr (kDotBf16) store16(p + pos, numerators); else store16(s + pos, numerators);
          sum16 += numerators;
        }
        float total = reduce_add(sum16) + (sinks ? std::exp(sink - row_max[r]) : 0.f);
        for (; pos < len; ++pos) {
          const float numerator = std::exp(s[pos] - row_max[r]);
          if constexpr (kDotBf16) p[pos] = static_cast<at::BFloat16>(numerator); else s[pos] = numerator;
          total += numerator;
        }
        inv_sum[r] = 1.f / total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      if constexpr (HEAD_DIM > 0 && HEAD_DIM % kLanes == 0) {
        // The next item's K blocks, asked for into L2 while this item's V pass computes from L2:
        // one with each of this item's blocks, the rest with its last.
        const Item next = work + 1 < end ? item_at(work + 1) : Item{};
        const int64_t next_blocks = next.end_block - next.first_block;
        const int64_t* next_table = block_tables + next.seq * st.table_seq + next.first_block;
        for_each_block(value_cache, false, [&](const scalar_t* values, int64_t head, int64_t start, int64_t lo,
                                               int64_t hi) {
          {  // the next item's keys of this KV head, as the K pass spreads its requests
            const int64_t j = start / block_size - item.first_block;
            const int64_t to = start + block_size >= len ? next_blocks : std::min(j + 1, next_blocks);
            for (int64_t b = j; b < to; ++b)
              prefetch_block<1>(key_cache + next_table[b] * st.key_block + (next.first_kv_head + head) * st.key_head, 1, 0,
                                head_dim * block_size);
          }
          const int64_t r = head * group;  // the group's first query row
          if constexpr (kDotBf16) {
            const auto* weights = reinterpret_cast<const uint16_t*>(probs.data() + r * score_stride + start + lo);
            for_each_tile<kVTile<HEAD_DIM>>(group, [&](auto tile, int64_t t) {
              weighted_rows_add_tile_bf16<HEAD_DIM, decltype(tile)::value>(
                  acc.data() + (r + t) * head_dim, head_dim, weights + t * score_stride, score_stride,
                  values + lo * st.cache_slot, st.cache_slot, hi - lo);
            });
          } else {
            weighted_rows_add_group<HEAD_DIM>(acc.data() + r * head_dim, scores.data() + r * score_stride + start + lo,
                                              score_stride, values + lo * st.cache_slot, st.cache_slot, hi - lo, group);
          }
        });
      } else {
        // Other head sizes: fp32 rows read in place, bf16 and fp16 ones widened once per KV head
        // into `widened` for the whole GQA group.
        for_each_block(value_cache, true, [&](const scalar_t* rows_of_head, int64_t head, int64_t start, int64_t lo,
                                              int64_t hi) {
          const float* values = reinterpret_cast<const float*>(rows_of_head);
          int64_t stride = st.cache_slot;
          if constexpr (!std::is_same_v<scalar_t, float>) {
            widen_rows(widened.data(), rows_of_head, st.cache_slot, lo, hi, head_dim);
            values = widened.data(), stride = head_dim;
          }
          for (int64_t r = head * group; r < (head + 1) * group; ++r)
            weighted_rows_add(acc.data() + r * head_dim, scores.data() + r * score_stride + start + lo,
                              values + lo * stride, stride, hi - lo, head_dim);
        });
      }
      for (int64_t r = 0; r < rows; ++r) {
        scalar_t* o = out + seq * st.out_seq + (first_kv_head * group + r) * st.out_head;
        for (int64_t d = 0; d < head_dim; ++d) {
          const int64_t from = kDotBf16 ? unpack_order_index(d) : d;  // the bf16 V pass's order
          o[d] = static_cast<scalar_t>(acc[r * head_dim + from] * inv_sum[r]);
        }
      }
    }
  });
}

template <typename scalar_t>
void dispatch_head_dim(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_tables,
                       const at::Tensor& context_lens, const float* sinks, double scale, int64_t sliding_window) {
  TORCH_CHECK(key_cache.size(4) == kKeyWordElements<scalar_t>, "key_cache's last dimension must be ",
              kKeyWordElements<scalar_t>, " for ", query.scalar_type(), " (elements to a 32-bit word)");
  const int64_t block_size = value_cache.size(1);
  const int64_t* lens = context_lens.const_data_ptr<int64_t>();
  const int64_t max_context = query.size(0) ? *std::max_element(lens, lens + query.size(0)) : 0;
  const int64_t min_context = query.size(0) ? *std::min_element(lens, lens + query.size(0)) : 1;
  TORCH_CHECK(min_context >= 1 && max_context <= block_tables.size(1) * block_size,
              "context_lens must be in [1, max_blocks * block_size]");
  const Strides st{query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
                   value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), key_cache.stride(0),
                   key_cache.stride(1)};
  auto run = [&](auto kernel) {
    kernel(out.data_ptr<scalar_t>(), query.const_data_ptr<scalar_t>(), key_cache.const_data_ptr<scalar_t>(),
           value_cache.const_data_ptr<scalar_t>(), block_tables.const_data_ptr<int64_t>(),
           context_lens.const_data_ptr<int64_t>(), sinks, query.size(0), query.size(1), value_cache.size(2),
           query.size(2), block_size, static_cast<float>(scale), sliding_window, max_context, st);
  };
  switch (query.size(2)) {
    case 64: run(decode_kernel<scalar_t, 64>); break;
    case 128: run(decode_kernel<scalar_t, 128>); break;
    default: run(decode_kernel<scalar_t, 0>);
  }
}

// out, query: [num_seqs, num_heads, head_dim]; key_cache: [num_blocks, num_kv_heads, head_dim / x,
// block_size, x], x = 2 for bf16 and fp16, 1 for fp32 (csrc/decode_keys.h); value_cache:
// [num_blocks, block_size, num_kv_heads, head_dim]; block_tables: [num_seqs, max_blocks] int64;
// context_lens: [num_seqs] int64, each >= 1; sinks: none, or [num_heads] fp32, one logit per
// head in every softmax's denominator. As for the Triton kernel, block ids must be valid rows
// of the caches: they are not checked per read.
void paged_decode_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, int64_t sliding_window,
                            const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [num_seqs, heads, dim]");
  TORCH_CHECK(value_cache.dim() == 4 && value_cache.size(3) == query.size(2) && value_cache.stride(3) == 1,
              "value_cache must be [num_blocks, block_size, num_kv_heads, head_dim], head_dim dense");
  TORCH_CHECK(key_cache.dim() == 5 && key_cache.size(0) == value_cache.size(0) &&
                  key_cache.size(1) == value_cache.size(2) && key_cache.size(2) * key_cache.size(4) == query.size(2) &&
                  key_cache.size(3) == value_cache.size(1),
              "key_cache must be [num_blocks, num_kv_heads, head_dim / x, block_size, x] for the value cache's sizes");
  TORCH_CHECK(key_cache.stride(4) == 1 && key_cache.stride(3) == key_cache.size(4) &&
                  key_cache.stride(2) == key_cache.size(3) * key_cache.size(4),
              "each block and head of key_cache must be dense");
  TORCH_CHECK(query.size(1) % value_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head_dim must be dense");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && out.scalar_type() == query.scalar_type() &&
                  value_cache.scalar_type() == query.scalar_type(), "query, out and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == query.size(0) && block_tables.stride(1) == 1,
              "block_tables must be [num_seqs, max_blocks], rows dense");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == query.size(0) && context_lens.is_contiguous(),
              "context_lens must be [num_seqs]");
  TORCH_CHECK(query.device().is_cpu() && out.device().is_cpu() && key_cache.device().is_cpu() &&
                  value_cache.device().is_cpu() && block_tables.device().is_cpu() && context_lens.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == query.size(1) &&
                         sinks->is_contiguous() && sinks->device().is_cpu()),
              "sinks must be [num_heads] fp32, dense, on the CPU");
  const float* sink_logits = sinks ? sinks->const_data_ptr<float>() : nullptr;
  switch (query.scalar_type()) {
    case at::kFloat: dispatch_head_dim<float>(out, query, key_cache, value_cache, block_tables, context_lens,
                                              sink_logits, scale, sliding_window); break;
    case at::kBFloat16: dispatch_head_dim<at::BFloat16>(out, query, key_cache, value_cache, block_tables,
                                                        context_lens, sink_logits, scale, sliding_window); break;
    case at::kHalf: dispatch_head_dim<at::Half>(out, query, key_cache, value_cache, block_tables, context_lens,
                                                sink_logits, scale, sliding_window); break;
    default: TORCH_CHECK(false, "unsupported dtype ", query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(kvfleet_cpu, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor context_lens, float scale, int sliding_window, Tensor? sinks=None) -> ()");
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
