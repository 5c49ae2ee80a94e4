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
#include "decode_keys.h"
#include "decode_values.h"

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

// What one launch reads and writes, and its work split (below).
template <typename scalar_t>
struct DecodeArgs {
  scalar_t* out;
  const scalar_t *query, *key_cache, *value_cache;
  const int64_t *block_tables, *context_lens;
  const float* sinks;
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, sliding_window, max_context;
  float scale;
  Strides st;
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
// an item's span is every KV head, so each value block [block_size, num_kv_heads, head_dim]
// and each block's keys of the span are contiguous reads (22% faster than a head at a time at
// batch 64 here); with few, items are single heads so that every thread still has work.
// Within a block the walk runs head by head: the K pass scores 16 slots at a time for the
// whole GQA group from one read of each word row of keys (csrc/decode_keys.h), the V pass
// reads each V row once for the whole group, its accumulators in registers for the block.
template <typename scalar_t, int HEAD_DIM>
class ItemDecoder {
 public:
  // bf16 caches of head size 64 or 128 on avx512_bf16: both passes on its dot product.
  static constexpr bool kDotBf16 = kHasBf16Dot && std::is_same_v<scalar_t, at::BFloat16> && HEAD_DIM > 0 &&
                                   HEAD_DIM % 32 == 0;

  ItemDecoder(const DecodeArgs<scalar_t>& args, int64_t span)
      : a_(args), st_(args.st), runtime_head_dim_(args.head_dim), bs_(args.block_size),
        group_(args.num_heads / args.num_kv_heads), span_(span), rows_(span * group_),
        // Row stride of the score buffers: whole blocks, as the K pass writes runs of 16 slots.
        score_stride_((args.max_context + bs_ - 1) / bs_ * bs_),
        scores_(rows_ * score_stride_), queries_(rows_ * head_dim()), acc_(rows_ * head_dim()), row_max_(rows_),
        inv_sum_(rows_), widened_(bs_ * head_dim()), probs_(kDotBf16 ? rows_ * score_stride_ : 0) {}

  // The item's attention output; `next` (or an empty Item) is the item this thread does next.
  void decode(const Item& item, const Item& next) {
    item_ = item;
    table_ = a_.block_tables + item.seq * st_.table_seq;
    load_queries();
    key_pass();
    softmax_numerators();
    std::fill(acc_.begin(), acc_.end(), 0.f);
    if constexpr (HEAD_DIM > 0 && HEAD_DIM % kLanes == 0) value_pass(next); else value_pass_other_sizes();
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
  const scalar_t* keys_of(int64_t block, int64_t kv_head) const {
    return a_.key_cache + block * st_.key_block + kv_head * st_.key_head;
  }
  // Head `head` of the span in block `block`: slot 0 of its value rows.
  const scalar_t* values_of(int64_t block, int64_t head) const {
    return a_.value_cache + block * st_.cache_block + (item_.first_kv_head + head) * st_.cache_head;
  }
  KVFLEET_PREFETCH_HELPER void prefetch_keys(int64_t block, int64_t kv_head) const {
    prefetch_block<1>(keys_of(block, kv_head), 1, 0, head_dim() * bs_);
  }
  // A head's share of the span's value block: rows [row0, row1) of it, every head of the span.
  template <int kLocality>
  KVFLEET_PREFETCH_HELPER void prefetch_value_share(int64_t block, int64_t head) const {
    const int64_t row0 = head * bs_ / span_, row1 = (head + 1) * bs_ / span_;
    prefetch_block<kLocality>(values_of(block, 0) + row0 * st_.cache_slot, row1 - row0, st_.cache_slot,
                              span_ * st_.cache_head);
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

  void load_queries() {  // fp32, pre-scaled
    for (int64_t r = 0; r < rows_; ++r) {
      const scalar_t* q = raw_query(r);
      for (int64_t d = 0; d < head_dim(); ++d) queries_[r * head_dim() + d] = static_cast<float>(q[d]) * a_.scale;
    }
  }

  // Scores of the GQA group [r0, r0 + group) at the slots [lo, hi) of one KV head's block,
  // into s [group, score_stride] (at the block's start). Whole runs of 16 slots compute all
  // 16, those outside [lo, hi) never read; the scalar loop serves other head sizes and blocks.
  void key_scores(float* s, int64_t r0, const scalar_t* keys, int64_t lo, int64_t hi) const {
    constexpr int64_t x = kKeyWordElements<scalar_t>;
    if constexpr (HEAD_DIM > 0 && HEAD_DIM % kLanes == 0) {
      if (bs_ % kLanes == 0) {
        for (int64_t c = lo - lo % kLanes; c < hi; c += kLanes) {
          for_each_tile<kKeyTile>(group_, [&](auto tile, int64_t t) {
            constexpr int kTile = decltype(tile)::value;
            if constexpr (kDotBf16) {
              key_scores16_bf16<HEAD_DIM, kTile>(s + t * score_stride_ + c, score_stride_, raw_query(r0 + t),
                                                 st_.query_head, keys + c * x, bs_ * x, a_.scale);
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
  // and for its share of this block's values into L2: the V pass has too little work per block
  // to hide DRAM latency behind its own prefetch (its loads were a third of the kernel's time),
  // while the K pass computes long enough per block. Issued a head's share at a time, not the
  // whole block's at once: the burst waited on the core's few line-fill buffers (perf put ~35%
  // of the kernel's samples on its prefetches, 2-core Xeon with AMX), and spread out a bf16
  // layer of 64 sequences x 420 positions from DRAM went from ~1.28 to ~1.15 ms there. The keys
  // ahead go to L2, not L1: with the K pass's compute cut by the key layout, on a 2-core EPYC
  // with avx512_bf16 a bf16 layer from DRAM with blocks scattered went from ~0.82 to ~0.72 ms
  // (64 x 335 positions) and from ~1.3 to ~1.1 ms (16 x 1,700), interleaved runs.
  void key_pass() {
    for_each_block([&](int64_t j, int64_t start, int64_t head, int64_t lo, int64_t hi) {
      if (start + kPrefetchBlocks * bs_ < item_.len)
        prefetch_keys(table_[j + kPrefetchBlocks], item_.first_kv_head + head);
      prefetch_value_share<1>(table_[j], head);
      key_scores(scores_.data() + head * group_ * score_stride_ + start, head * group_,
                 keys_of(table_[j], item_.first_kv_head + head), lo, hi);
    });
  }

  // Softmax numerators, in place in `scores` (for the bf16 V pass rounded to bf16 in `probs`
  // instead); the 1/sum is applied once to the output. A sink (gpt-oss) is one more logit in the
  // max and the sum that adds nothing to the output.
  void softmax_numerators() {
    const int64_t first = item_.first, len = item_.len;
    for (int64_t r = 0; r < rows_; ++r) {
      float* s = scores_.data() + r * score_stride_;
      at::BFloat16* p = probs_.data() + r * score_stride_;
      row_max_[r] = max_of(s + first, len - first);
      const float sink = a_.sinks ? a_.sinks[item_.first_kv_head * group_ + r] : 0.f;
      if (a_.sinks) row_max_[r] = std::max(row_max_[r], sink);
      const vfloat max16 = vfloat{} + row_max_[r];
      vfloat sum16{};
      int64_t pos = first;
      for (; pos + kLanes <= len; pos += kLanes) {
        const vfloat numerators = exp16(load16(s + pos) - max16);
        if constexpr (kDotBf16) store_probabilities16(p + pos, numerators); else store16(s + pos, numerators);
        sum16 += numerators;
      }
      float total = reduce_add(sum16) + (a_.sinks ? std::exp(sink - row_max_[r]) : 0.f);
      for (; pos < len; ++pos) {
        const float numerator = std::exp(s[pos] - row_max_[r]);
        if constexpr (kDotBf16) p[pos] = static_cast<at::BFloat16>(numerator); else s[pos] = numerator;
        total += numerator;
      }
      inv_sum_[r] = 1.f / total;
    }
  }

  // Head sizes 64 and 128: the V pass runs from L2 (the K pass asked for the values), and asks
  // for the next item's keys into L2 meanwhile, spread as the K pass spreads its requests: one
  // block with each of this item's blocks, the rest with its last.
  void value_pass(const Item& next) {
    const int64_t* next_table = a_.block_tables + next.seq * st_.table_seq + next.first_block;
    const int64_t next_blocks = next.end_block - next.first_block;
    for_each_block([&](int64_t j, int64_t start, int64_t head, int64_t lo, int64_t hi) {
      const int64_t k = j - item_.first_block;  // this block's index in the item, as the next item's blocks count
      const int64_t to = start + bs_ >= item_.len ? next_blocks : std::min(k + 1, next_blocks);
      for (int64_t b = k; b < to; ++b) prefetch_keys(next_table[b], next.first_kv_head + head);
      const scalar_t* values = values_of(table_[j], head) + lo * st_.cache_slot;
      const int64_t r = head * group_;  // the group's first query row
      if constexpr (kDotBf16) {
        const auto* weights = reinterpret_cast<const uint16_t*>(probs_.data() + r * score_stride_ + start + lo);
        for_each_tile<kVTile<HEAD_DIM>>(group_, [&](auto tile, int64_t t) {
          weighted_rows_add_tile_bf16<HEAD_DIM, decltype(tile)::value>(acc_.data() + (r + t) * head_dim(), head_dim(),
                                                                       weights + t * score_stride_, score_stride_,
                                                                       values, st_.cache_slot, hi - lo);
        });
      } else {
        weighted_rows_add_group<HEAD_DIM>(acc_.data() + r * head_dim(), scores_.data() + r * score_stride_ + start + lo,
                                          score_stride_, values, st_.cache_slot, hi - lo, group_);
      }
    });
  }

  // Other head sizes: fp32 rows read in place, bf16 and fp16 ones widened once per KV head into
  // `widened` for the whole GQA group; each head's share of the block kPrefetchBlocks ahead
  // asked for first.
  void value_pass_other_sizes() {
    for_each_block([&](int64_t j, int64_t start, int64_t head, int64_t lo, int64_t hi) {
      if (start + kPrefetchBlocks * bs_ < item_.len) prefetch_value_share<3>(table_[j + kPrefetchBlocks], head);
      const scalar_t* rows_of_head = values_of(table_[j], head);
      const float* values = reinterpret_cast<const float*>(rows_of_head);
      int64_t stride = st_.cache_slot;
      if constexpr (!std::is_same_v<scalar_t, float>) {
        widen_rows(widened_.data(), rows_of_head, st_.cache_slot, lo, hi, head_dim());
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
      for (int64_t d = 0; d < head_dim(); ++d) {
        const int64_t from = kDotBf16 ? unpack_order_index(d) : d;  // the bf16 V pass's order
        o[d] = static_cast<scalar_t>(acc_[r * head_dim() + from] * inv_sum_[r]);
      }
    }
  }

  const DecodeArgs<scalar_t>& a_;
  const Strides st_;
  const int64_t runtime_head_dim_, bs_, group_, span_, rows_, score_stride_;
  std::vector<float> scores_;   // [rows, score_stride]
  std::vector<float> queries_;  // [rows, head_dim], fp32, pre-scaled
  std::vector<float> acc_;      // [rows, head_dim]
  std::vector<float> row_max_, inv_sum_;
  std::vector<float> widened_;  // [block_size, head_dim], one KV head's rows in fp32
  std::vector<at::BFloat16> probs_;  // [rows, score_stride], bf16 weights
  Item item_{};
  const int64_t* table_ = nullptr;  // the item's block table row
};

template <typename scalar_t, int HEAD_DIM>
void decode_kernel(const DecodeArgs<scalar_t>& args) {
  const int64_t span = args.num_seqs >= 4 * at::get_num_threads() ? args.num_kv_heads : 1;  // KV heads per item
  const int64_t spans_per_seq = args.num_kv_heads / span, bs = args.block_size;
  auto item_at = [&](int64_t work) {
    const int64_t seq = work / spans_per_seq, len = args.context_lens[seq];
    const int64_t first = args.sliding_window > 0 && len > args.sliding_window ? len - args.sliding_window : 0;
    return Item{seq, (work % spans_per_seq) * span, len, first, first / bs, (len + bs - 1) / bs};
  };
  // Items cost about their number of positions, which differ by up to the longest context
  // (an even split of the item range left half the bandwidth unused at the end).
  const int64_t num_items = args.num_seqs * spans_per_seq;
  std::vector<int64_t> cost_before(num_items + 1, 0);  // [num_items + 1], prefix sums
  for (int64_t work = 0; work < num_items; ++work) {
    const Item item = item_at(work);
    cost_before[work + 1] = cost_before[work] + (item.len - item.first) + bs;  // + a block's fixed work
  }
  parallel_for_by_cost(cost_before, [&](int64_t begin, int64_t end) {
    if (begin >= end) return;
    ItemDecoder<scalar_t, HEAD_DIM> decoder(args, span);
    Item item = item_at(begin);
    for (int64_t work = begin; work < end; ++work) {
      const Item next = work + 1 < end ? item_at(work + 1) : Item{};
      decoder.decode(item, next);
      item = next;
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
  const DecodeArgs<scalar_t> args{out.data_ptr<scalar_t>(), query.const_data_ptr<scalar_t>(),
                                  key_cache.const_data_ptr<scalar_t>(), value_cache.const_data_ptr<scalar_t>(),
                                  block_tables.const_data_ptr<int64_t>(), context_lens.const_data_ptr<int64_t>(),
                                  sinks, query.size(0), query.size(1), value_cache.size(2), query.size(2), block_size,
                                  sliding_window, max_context, static_cast<float>(scale), st};
  switch (query.size(2)) {
    case 64: decode_kernel<scalar_t, 64>(args); break;
    case 128: decode_kernel<scalar_t, 128>(args); break;
    default: decode_kernel<scalar_t, 0>(args);
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
