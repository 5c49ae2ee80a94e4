// One work item of the CPU decode kernel (kvfleet_kernels/csrc/paged_decode_cpu.cpp, which
// splits the work): a sequence and a span of its KV heads, decoded by one thread's ItemDecoder.
#pragma once

#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include "cpu_vec.h"
#include "decode_amx.h"
#include "decode_keys.h"
#include "decode_values.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace kvfleet_cpu {

// value_*: the value cache's [num_blocks, num_kv_heads, block_size / y, head_dim, y]
// (csrc/decode_values.h), value_row from one word row (y positions) to the next; key_*: the key
// cache's [num_blocks, num_kv_heads, head_dim / x, block_size, x] (csrc/decode_keys.h).
struct Strides {
  int64_t query_seq, query_head, out_seq, out_head, table_seq, value_block, value_row, value_head, key_block,
      key_head;
};

// What one launch reads and writes, and its work split (below). cache_t: the caches' element, the
// query's own or fp8 (c10::Float8_e4m3fn, c10::Float8_e5m2), whose stored values times k_scale and
// v_scale are the keys and values (1 for the others).
template <typename scalar_t, typename cache_t = scalar_t>
struct DecodeArgs {
  scalar_t* out;
  const scalar_t* query;
  const cache_t *key_cache, *value_cache;
  const int64_t *block_tables, *context_lens;
  const float* sinks;
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, sliding_window, max_context;
  float scale;
  Strides st;
  bool allow_amx;  // AMX tiles where the shapes suit them (csrc/decode_amx.h)
  float k_scale, v_scale;
};

// A work item is one sequence and a span of its KV heads: its first KV head, its context
// length, and the positions [first, len) it reads (a sliding window's last ones), in blocks
// [first_block, end_block) of its table.
struct Item {
  int64_t seq, first_kv_head, len, first, first_block, end_block;
};

// Blocks sit wherever the allocator put them, so the hardware prefetcher, which follows
// sequential streams within a page, stalls at every block boundary. The walks ask for the
// block kPrefetchBlocks ahead while they work on this one (prefetch_block, csrc/cpu_vec.h,
// which says why every prefetch helper here is KVFLEET_PREFETCH_HELPER).
constexpr int64_t kPrefetchBlocks = 2;

// One thread's decoder: its buffers, and the work of one item at a time. With many sequences
// an item's span is every KV head, so each value block and each block's keys of the span are
// contiguous reads (22% faster than a head at a time at batch 64 here); with few, items are
// single heads so that every thread still has work. Within a block the walk runs head by head:
// the K pass scores 16 slots at a time for the whole GQA group from one read of each word row
// of keys (csrc/decode_keys.h), the V pass reads each value word row once for the whole group,
// its accumulators in registers for the block (csrc/decode_values.h). On AMX both passes run on
// tiles instead (csrc/decode_amx.h).
// An fp8 cache is read as bf16 pairs (csrc/cpu_vec.h: bf16_words32 widens them in registers) by
// the bf16 paths, or widened to fp32 for an fp32 query, with k_scale folded into the scores' scale
// and v_scale into the output's 1/sum.
template <typename scalar_t, int HEAD_DIM, typename cache_t = scalar_t>
class ItemDecoder {
 public:
  // bf16 caches of head size 64 or 128 on avx512_bf16: both passes on its dot product.
  static constexpr bool kDotBf16 = kHasBf16Dot && std::is_same_v<scalar_t, at::BFloat16> &&
                                   (std::is_same_v<cache_t, scalar_t> || kIsFp8<cache_t>) && HEAD_DIM > 0 &&
                                   HEAD_DIM % 32 == 0;
  // ... and on AMX tiles where the CPU has them (csrc/decode_amx.h; amx_ below for the shapes).
  static constexpr bool kAmx = kHasAmxBf16 && kDotBf16 && std::is_same_v<cache_t, scalar_t> &&
                               HEAD_DIM % kAmxValueDims == 0;
  static constexpr int64_t kY = kValueWordElements<cache_t>;  // positions to a value word

  ItemDecoder(const DecodeArgs<scalar_t, cache_t>& args, int64_t span)
      : a_(args), st_(args.st), runtime_head_dim_(args.head_dim), bs_(args.block_size),
        group_(args.num_heads / args.num_kv_heads), span_(span), rows_(span * group_),
        // Row stride of the score buffers: whole blocks, as the K pass writes runs of 16 slots.
        score_stride_((args.max_context + bs_ - 1) / bs_ * bs_),
        scores_(rows_ * score_stride_), queries_(rows_ * head_dim()), acc_(rows_ * head_dim()), row_max_(rows_),
        inv_sum_(rows_), widened_(bs_ * head_dim()), probs_(kDotBf16 ? rows_ * score_stride_ : 0),
        amx_(uses_amx(args)),
        edge_(amx_ ? amx_value_positions(bs_) * kAmxValueDims : 0) {}
  // Both passes on AMX tiles: the CPU has them, and the shapes fit (GQA groups of up to 16 query
  // heads, blocks of whole runs of 16 positions) with a positive scale (the AMX K pass leaves
  // the scale to the softmax, which takes the max of unscaled scores).
  static bool uses_amx(const DecodeArgs<scalar_t, cache_t>& args) {
    const int64_t group = args.num_heads / args.num_kv_heads;
    return kAmx && args.allow_amx && group <= 16 && args.block_size % kLanes == 0 && args.scale > 0;
  }
  ~ItemDecoder() {
    if (amx_) at::native::cpublas::brgemm_release();  // this thread's tiles, as torch's brgemm callers end
  }

  // The item's attention output; `next` (or an empty Item) is the item this thread does next.
  void decode(const Item& item, const Item& next) {
    item_ = item;
    table_ = a_.block_tables + item.seq * st_.table_seq;
    load_queries();
    key_pass();
    softmax_numerators();
    std::fill(acc_.begin(), acc_.end(), 0.f);
    if (amx_) value_pass_amx(next);
    else if constexpr (HEAD_DIM > 0 && HEAD_DIM % kLanes == 0 && (kDotBf16 || kY == 1)) value_pass(next);
    else value_pass_other_sizes();
    write_out();
  }

 private:
  // A constant for the tiled head sizes, so that their loops over it unroll.
  int64_t head_dim() const {
    if constexpr (HEAD_DIM > 0) return HEAD_DIM; else return runtime_head_dim_;
  }
  const scalar_t* raw_query(int64_t r) const {  // row r is query head first_kv_head * group + r
    return a_.query + item_.seq * st_.query_seq + (item_.first_kv_head * group_ + r) * st_.query_head;
  }
  // KV head `kv_head` (of the model) in block `block`: its keys [head_dim / x, block_size, x], contiguous.
  const cache_t* keys_of(int64_t block, int64_t kv_head) const {
    return a_.key_cache + block * st_.key_block + kv_head * st_.key_head;
  }
  // Head `head` of the span in block `block`: its first value word row.
  const cache_t* values_of(int64_t block, int64_t head) const {
    return a_.value_cache + block * st_.value_block + (item_.first_kv_head + head) * st_.value_head;
  }
  KVFLEET_PREFETCH_HELPER void prefetch_keys(int64_t block, int64_t kv_head) const {
    prefetch_block<1>(keys_of(block, kv_head), 1, 0, head_dim() * bs_);
  }
  // Head `head` of the span's values in block `block`: its word rows, contiguous.
  template <int kLocality>
  KVFLEET_PREFETCH_HELPER void prefetch_values(int64_t block, int64_t head) const {
    prefetch_block<kLocality>(values_of(block, head), 1, 0, bs_ * head_dim());
  }
  // visit(j, start, head, lo, hi) for each block j of the table in [first_block, end_block) (its
  // first position `start`) and each head of the span, slots [lo, hi) of the block in range.
  template <typename Visit>
  void for_each_block(Visit&& visit) const {
    for (int64_t start = item_.first - item_.first % bs_; start < item_.len; start += bs_) {
      const int64_t lo = std::max<int64_t>(item_.first - start, 0), hi = std::min(item_.len - start, bs_);
      for (int64_t head = 0; head < span_; ++head) visit(start / bs_, start, head, lo, hi);
    }
  }

  void load_queries() {  // fp32, pre-scaled (k_scale too: q . (k_scale k) = (k_scale q) . k)
    const float scale = a_.scale * a_.k_scale;
    for (int64_t r = 0; r < rows_; ++r) {
      const scalar_t* q = raw_query(r);
      for (int64_t d = 0; d < head_dim(); ++d) queries_[r * head_dim() + d] = static_cast<float>(q[d]) * scale;
    }
  }

  // Scores of the GQA group [r0, r0 + group) at the slots [lo, hi) of one KV head's block,
  // into s [group, score_stride] (at the block's start). Whole runs of 16 slots compute all
  // 16, those outside [lo, hi) never read; the scalar loop serves other head sizes and blocks.
  void key_scores(float* s, int64_t r0, const cache_t* keys, int64_t lo, int64_t hi) const {
    constexpr int64_t x = kKeyWordElements<cache_t>;
    if constexpr (HEAD_DIM > 0 && HEAD_DIM % kLanes == 0) {
      if (bs_ % kLanes == 0) {
        if constexpr (kAmx) {
          if (amx_) {  // the whole group at once, unscaled (softmax_numerators scales)
            for (int64_t c = lo - lo % kLanes; c < hi; c += kLanes)
              amx_key_scores16<HEAD_DIM>(s + c, score_stride_, raw_query(r0), st_.query_head, keys + c * x, bs_ * x);
            return;
          }
        }
        for (int64_t c = lo - lo % kLanes; c < hi; c += kLanes) {
          for_each_tile<kKeyTile>(group_, [&](auto tile, int64_t t) {
            constexpr int kTile = decltype(tile)::value;
            if constexpr (kDotBf16) {
              key_scores16_bf16<HEAD_DIM, kTile>(s + t * score_stride_ + c, score_stride_, raw_query(r0 + t),
                                                 st_.query_head, keys + c * x, bs_ * x, a_.scale * a_.k_scale);
            } else {
              key_scores16<HEAD_DIM, kTile>(s + t * score_stride_ + c, score_stride_,
                                            queries_.data() + (r0 + t) * head_dim(), keys + c * x, bs_ * x);
            }
          });
        }
        return;
      }
    }
    for (int64_t t = 0; t < group_; ++t) {
      const float* q = queries_.data() + (r0 + t) * head_dim();
      for (int64_t slot = lo; slot < hi; ++slot) {
        float total = 0.f;
        for (int64_t d = 0; d < head_dim(); ++d) total += q[d] * key_at(keys, bs_, slot, d);
        s[t * score_stride_ + slot] = total;
      }
    }
  }

  // With each head's work the K pass asks for that head's keys kPrefetchBlocks blocks ahead,
  // and for that head's values of this block into L2: the V pass has too little work per block
  // to hide DRAM latency behind its own prefetch (its loads were a third of the kernel's time),
  // while the K pass computes long enough per block. Issued a head at a time, not the whole
  // block's values at once: the burst waited on the core's few line-fill buffers (perf put ~35%
  // of the kernel's samples on its prefetches, 2-core Xeon with AMX), and spread out a bf16
  // layer of 64 sequences x 420 positions from DRAM went from ~1.28 to ~1.15 ms there. The keys
  // ahead go to L2, not L1: with the K pass's compute cut by the key layout, on a 2-core EPYC
  // with avx512_bf16 a bf16 layer from DRAM with blocks scattered went from ~0.82 to ~0.72 ms
  // (64 x 335 positions) and from ~1.3 to ~1.1 ms (16 x 1,700), interleaved runs.
  void key_pass() {
    if (amx_) configure_key_tiles(group_);
    for_each_block([&](int64_t j, int64_t start, int64_t head, int64_t lo, int64_t hi) {
      if (start + kPrefetchBlocks * bs_ < item_.len)
        prefetch_keys(table_[j + kPrefetchBlocks], item_.first_kv_head + head);
      prefetch_values<1>(table_[j], head);
      key_scores(scores_.data() + head * group_ * score_stride_ + start, head * group_,
                 keys_of(table_[j], item_.first_kv_head + head), lo, hi);
    });
  }

  // Softmax numerators, in place in `scores` (for the bf16 V pass rounded to bf16 in `probs`
  // instead); the 1/sum is applied once to the output. A sink (gpt-oss) is one more logit in the
  // max and the sum that adds nothing to the output. The AMX K pass leaves its scores unscaled
  // (scaled here). Positions outside [first, len) keep whatever an earlier item left there: the
  // bf16 V passes read those weights only against values loaded as zero, and all are finite.
  void softmax_numerators() {
    const int64_t first = item_.first, len = item_.len;
    const float score_scale = amx_ ? a_.scale : 1.f;
    const vfloat scale16 = vfloat{} + score_scale;
    for (int64_t r = 0; r < rows_; ++r) {
      float* s = scores_.data() + r * score_stride_;
      at::BFloat16* p = probs_.data() + r * score_stride_;
      row_max_[r] = max_of(s + first, len - first) * score_scale;
      const float sink = a_.sinks ? a_.sinks[item_.first_kv_head * group_ + r] : 0.f;
      if (a_.sinks) row_max_[r] = std::max(row_max_[r], sink);
      const vfloat max16 = vfloat{} + row_max_[r];
      vfloat sum16{};
      int64_t pos = first;
      for (; pos + kLanes <= len; pos += kLanes) {
        const vfloat numerators = exp16(load16(s + pos) * scale16 - max16);
        if constexpr (kDotBf16) store_probabilities16(p + pos, numerators); else store16(s + pos, numerators);
        sum16 += numerators;
      }
      float total = reduce_add(sum16) + (a_.sinks ? std::exp(sink - row_max_[r]) : 0.f);
      for (; pos < len; ++pos) {
        const float numerator = std::exp(s[pos] * score_scale - row_max_[r]);
        if constexpr (kDotBf16) p[pos] = static_cast<at::BFloat16>(numerator); else s[pos] = numerator;
        total += numerator;
      }
      inv_sum_[r] = a_.v_scale / total;
    }
  }

  // The V pass asks for the next item's keys into L2 meanwhile, spread as the K pass spreads its
  // requests: one of its blocks with each of this item's blocks, the rest with this item's last.
  // Here for the blocks of this item first visited at positions [from, to).
  KVFLEET_PREFETCH_HELPER void prefetch_next_keys(const Item& next, int64_t from, int64_t to, int64_t head) const {
    const int64_t* next_table = a_.block_tables + next.seq * st_.table_seq + next.first_block;
    const int64_t next_blocks = next.end_block - next.first_block;
    for (int64_t j = std::max(item_.first_block, from / bs_); j * bs_ < std::min(to, item_.len); ++j) {
      if (std::max(j * bs_, item_.first) < from) continue;  // visited before `from`
      const int64_t k = j - item_.first_block;  // this block's index in the item, as the next item's blocks count
      const int64_t until = (j + 1) * bs_ >= item_.len ? next_blocks : std::min(k + 1, next_blocks);
      for (int64_t b = k; b < until; ++b) prefetch_keys(next_table[b], next.first_kv_head + head);
    }
  }

  // Head sizes 64 and 128: the V pass runs from L2 (the K pass asked for the values).
  void value_pass(const Item& next) {
    for_each_block([&](int64_t j, int64_t start, int64_t head, int64_t lo, int64_t hi) {
      prefetch_next_keys(next, start + lo, start + lo + 1, head);
      const cache_t* values = values_of(table_[j], head);  // pair rows (bf16) or rows
      const int64_t r = head * group_;  // the group's first query row
      if constexpr (kDotBf16) {
        const auto* weights = reinterpret_cast<const uint16_t*>(probs_.data() + r * score_stride_ + start);
        for_each_tile<kVTile<HEAD_DIM>>(group_, [&](auto tile, int64_t t) {
          weighted_pairs_add_tile_bf16<HEAD_DIM, decltype(tile)::value>(acc_.data() + (r + t) * HEAD_DIM, HEAD_DIM,
                                                                        weights + t * score_stride_, score_stride_,
                                                                        values, st_.value_row, lo, hi);
        });
      } else {
        weighted_rows_add_group<HEAD_DIM>(acc_.data() + r * head_dim(), scores_.data() + r * score_stride_ + start + lo,
                                          score_stride_, values + lo * st_.value_row, st_.value_row, hi - lo, group_);
      }
    });
  }

  // The V pass on AMX tiles (csrc/decode_amx.h): per head of the span and 64 dimensions, a
  // block's positions (up to 32) a product, into C tiles that sum over the whole context. A run
  // with positions outside [first, len) goes through `edge`, those positions zeroed.
  void value_pass_amx(const Item& next) {
    if constexpr (kAmx) {
      const int64_t positions = amx_value_positions(bs_);
      configure_value_tiles(group_, positions);
      for (int64_t head = 0; head < span_; ++head) {
        const int64_t r = head * group_;  // the group's first query row
        for (int64_t d0 = 0; d0 < HEAD_DIM; d0 += kAmxValueDims) {
          zero_value_tiles();
          for (int64_t c0 = item_.first - item_.first % positions; c0 < item_.len; c0 += positions) {
            if (d0 == 0) prefetch_next_keys(next, c0, c0 + positions, head);
            const cache_t* pairs = values_of(table_[c0 / bs_], head) + (c0 % bs_) / 2 * st_.value_row + 2 * d0;
            const at::BFloat16* probs = probs_.data() + r * score_stride_ + c0;
            if (c0 >= item_.first && c0 + positions <= item_.len) {
              amx_weighted_values(probs, score_stride_, pairs, st_.value_row);
            } else {
              copy_pairs_masked(edge_.data(), pairs, st_.value_row, positions / 2, item_.first - c0, item_.len - c0);
              amx_weighted_values(probs, score_stride_, edge_.data(), 2 * kAmxValueDims);
            }
          }
          store_value_tiles(acc_.data() + r * HEAD_DIM + d0, HEAD_DIM);
        }
      }
    }
  }

  // Other head sizes: fp32 rows read in place, bf16 and fp16 ones widened once per KV head into
  // `widened` for the whole GQA group; each head's values of the block kPrefetchBlocks ahead
  // asked for first.
  void value_pass_other_sizes() {
    for_each_block([&](int64_t j, int64_t start, int64_t head, int64_t lo, int64_t hi) {
      if (start + kPrefetchBlocks * bs_ < item_.len) prefetch_values<3>(table_[j + kPrefetchBlocks], head);
      const cache_t* rows_of_head = values_of(table_[j], head);
      const float* values = reinterpret_cast<const float*>(rows_of_head);
      int64_t stride = st_.value_row;
      if constexpr (!std::is_same_v<cache_t, float>) {
        widen_rows(widened_.data(), rows_of_head, st_.value_row, lo, hi, head_dim());
        values = widened_.data(), stride = head_dim();
      }
      for (int64_t r = head * group_; r < (head + 1) * group_; ++r)
        weighted_rows_add(acc_.data() + r * head_dim(), scores_.data() + r * score_stride_ + start + lo,
                          values + lo * stride, stride, hi - lo, head_dim());
    });
  }

  void write_out() const {
    for (int64_t r = 0; r < rows_; ++r) {
      scalar_t* o = a_.out + item_.seq * st_.out_seq + (item_.first_kv_head * group_ + r) * st_.out_head;
      for (int64_t d = 0; d < head_dim(); ++d) o[d] = static_cast<scalar_t>(acc_[r * head_dim() + d] * inv_sum_[r]);
    }
  }

  const DecodeArgs<scalar_t, cache_t>& a_;
  const Strides st_;
  const int64_t runtime_head_dim_, bs_, group_, span_, rows_, score_stride_;
  std::vector<float> scores_;   // [rows, score_stride]
  std::vector<float> queries_;  // [rows, head_dim], fp32, pre-scaled
  std::vector<float> acc_;      // [rows, head_dim]
  std::vector<float> row_max_, inv_sum_;
  std::vector<float> widened_;  // [block_size, head_dim], one KV head's rows in fp32
  std::vector<at::BFloat16> probs_;  // [rows, score_stride], bf16 weights
  const bool amx_;  // uses_amx
  std::vector<at::BFloat16> edge_;  // [pairs of a product, 64 dimensions x 2]: an edge's values, masked
  Item item_{};
  const int64_t* table_ = nullptr;  // the item's block table row
};

}  // namespace kvfleet_cpu
