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
#include "decode_item.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

using namespace kvfleet_cpu;  // NOLINT: the vector helpers are this kernel's vocabulary

template <typename scalar_t, int HEAD_DIM, typename cache_t>
void decode_kernel(const DecodeArgs<scalar_t, cache_t>& args) {
  // KV heads per item: every one with many sequences, one with few so that every thread has
  // work. On AMX always one: its tiles hold one GQA group's sums, and a head's walk over its
  // blocks reads two contiguous runs each (its keys, its values); on a 2-core Xeon with AMX, 30
  // layers cycled from DRAM, 24 x 1,400 positions went from ~1.59 to ~1.37 ms a layer and 64 x
  // 420 from ~1.22-1.32 to ~1.13-1.16 (the dot product: ~1.84 to ~1.67 and ~1.47 to ~1.41 there,
  // not yet measured on a CPU without AMX, where every head at once was 22% faster with the
  // values stored token by token).
  const bool one_head = ItemDecoder<scalar_t, HEAD_DIM, cache_t>::uses_amx(args) || args.num_seqs < 4 * at::get_num_threads();
  const int64_t span = one_head ? 1 : args.num_kv_heads;
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
    ItemDecoder<scalar_t, HEAD_DIM, cache_t> decoder(args, span);
    Item item = item_at(begin);
    for (int64_t work = begin; work < end; ++work) {
      const Item next = work + 1 < end ? item_at(work + 1) : Item{};
      decoder.decode(item, next);
      item = next;
    }
  });
}

// The scales a launch applies: an fp8 cache's (k_scale, v_scale), else (1, 1).
struct KVScales {
  double k, v;
};

template <typename scalar_t, typename cache_t>
void dispatch_head_dim(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_tables,
                       const at::Tensor& context_lens, const float* sinks, double scale, int64_t sliding_window,
                       bool allow_amx, KVScales kv_scales) {
  TORCH_CHECK(key_cache.size(4) == kKeyWordElements<cache_t>, "key_cache's last dimension must be ",
              kKeyWordElements<cache_t>, " for ", key_cache.scalar_type(), " (elements to a 32-bit word)");
  TORCH_CHECK(value_cache.size(4) == kValueWordElements<cache_t>, "value_cache's last dimension must be ",
              kValueWordElements<cache_t>, " for ", value_cache.scalar_type(), " (positions to a 32-bit word)");
  const int64_t block_size = value_cache.size(2) * value_cache.size(4);
  const int64_t* lens = context_lens.const_data_ptr<int64_t>();
  const int64_t max_context = query.size(0) ? *std::max_element(lens, lens + query.size(0)) : 0;
  const int64_t min_context = query.size(0) ? *std::min_element(lens, lens + query.size(0)) : 1;
  TORCH_CHECK(min_context >= 1 && max_context <= block_tables.size(1) * block_size,
              "context_lens must be in [1, max_blocks * block_size]");
  const Strides st{query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
                   value_cache.stride(0), value_cache.stride(2), value_cache.stride(1), key_cache.stride(0),
                   key_cache.stride(1)};
  const DecodeArgs<scalar_t, cache_t> args{out.data_ptr<scalar_t>(), query.const_data_ptr<scalar_t>(),
                                  key_cache.const_data_ptr<cache_t>(), value_cache.const_data_ptr<cache_t>(),
                                  block_tables.const_data_ptr<int64_t>(), context_lens.const_data_ptr<int64_t>(),
                                  sinks, query.size(0), query.size(1), value_cache.size(1), query.size(2), block_size,
                                  sliding_window, max_context, static_cast<float>(scale), st,
                                  allow_amx && amx_permitted(), static_cast<float>(kv_scales.k),
                                  static_cast<float>(kv_scales.v)};
  switch (query.size(2)) {
    case 64: decode_kernel<scalar_t, 64>(args); break;
    case 128: decode_kernel<scalar_t, 128>(args); break;
    default: decode_kernel<scalar_t, 0>(args);
  }
}

// The caches' element: the query's own (no scales), or fp8.
template <typename scalar_t>
void dispatch_cache_dtype(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables,
                          const at::Tensor& context_lens, const float* sinks, double scale, int64_t sliding_window,
                          bool allow_amx, KVScales kv_scales) {
  switch (key_cache.scalar_type()) {
    case at::kFloat8_e4m3fn:
      return dispatch_head_dim<scalar_t, c10::Float8_e4m3fn>(out, query, key_cache, value_cache, block_tables,
                                                             context_lens, sinks, scale, sliding_window, false, kv_scales);
    case at::kFloat8_e5m2:
      return dispatch_head_dim<scalar_t, c10::Float8_e5m2>(out, query, key_cache, value_cache, block_tables,
                                                           context_lens, sinks, scale, sliding_window, false, kv_scales);
    default:
      TORCH_CHECK(kv_scales.k == 1 && kv_scales.v == 1, "k_scale and v_scale are for fp8 caches only");
      return dispatch_head_dim<scalar_t, scalar_t>(out, query, key_cache, value_cache, block_tables, context_lens,
                                                   sinks, scale, sliding_window, allow_amx, kv_scales);
  }
}

// out, query: [num_seqs, num_heads, head_dim]; key_cache: [num_blocks, num_kv_heads, head_dim / x,
// block_size, x], x = 2 for bf16 and fp16, 1 for fp32 (csrc/decode_keys.h); value_cache:
// [num_blocks, num_kv_heads, block_size / y, head_dim, y], y = 2 for bf16, 1 otherwise
// (csrc/decode_values.h); the caches in the query's dtype, or fp8 (x = y = 1) holding K / k_scale
// and V / v_scale; block_tables: [num_seqs, max_blocks] int64;
// context_lens: [num_seqs] int64, each >= 1; sinks: none, or [num_heads] fp32, one logit per
// head in every softmax's denominator. As for the Triton kernel, block ids must be valid rows
// of the caches: they are not checked per read.
void paged_decode_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, int64_t sliding_window,
                            const std::optional<at::Tensor>& sinks, bool allow_amx, double k_scale, double v_scale) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [num_seqs, heads, dim]");
  TORCH_CHECK(value_cache.dim() == 5 && value_cache.size(3) == query.size(2) &&
                  (value_cache.stride(4) == 1 || value_cache.size(4) == 1) && value_cache.stride(3) == value_cache.size(4),
              "value_cache must be [num_blocks, num_kv_heads, block_size / y, head_dim, y], each word row dense");
  TORCH_CHECK(key_cache.dim() == 5 && key_cache.size(0) == value_cache.size(0) &&
                  key_cache.size(1) == value_cache.size(1) && key_cache.size(2) * key_cache.size(4) == query.size(2) &&
                  key_cache.size(3) == value_cache.size(2) * value_cache.size(4),
              "key_cache must be [num_blocks, num_kv_heads, head_dim / x, block_size, x] for the value cache's sizes");
  TORCH_CHECK(key_cache.stride(4) == 1 && key_cache.stride(3) == key_cache.size(4) &&
                  key_cache.stride(2) == key_cache.size(3) * key_cache.size(4),
              "each block and head of key_cache must be dense");
  TORCH_CHECK(query.size(1) % value_cache.size(1) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head_dim must be dense");
  const bool fp8 = key_cache.scalar_type() == at::kFloat8_e4m3fn || key_cache.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && value_cache.scalar_type() == key_cache.scalar_type() &&
                  (fp8 || key_cache.scalar_type() == query.scalar_type()),
              "query, out and caches must share a dtype (or the caches be fp8)");
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
  const KVScales kv_scales{k_scale, v_scale};
  switch (query.scalar_type()) {
    case at::kFloat: dispatch_cache_dtype<float>(out, query, key_cache, value_cache, block_tables, context_lens,
                                                 sink_logits, scale, sliding_window, allow_amx, kv_scales); break;
    case at::kBFloat16: dispatch_cache_dtype<at::BFloat16>(out, query, key_cache, value_cache, block_tables,
                                                           context_lens, sink_logits, scale, sliding_window, allow_amx,
                                                           kv_scales); break;
    case at::kHalf: dispatch_cache_dtype<at::Half>(out, query, key_cache, value_cache, block_tables, context_lens,
                                                   sink_logits, scale, sliding_window, allow_amx, kv_scales); break;
    default: TORCH_CHECK(false, "unsupported dtype ", query.scalar_type());
  }
}

}  // namespace

// Whether bf16 decode can run on AMX tiles here: built for a CPU with amx_bf16, and Linux lends
// this process the tile state (csrc/decode_amx.h).
bool decode_amx_available() { return kHasAmxBf16 && amx_permitted(); }

TORCH_LIBRARY(kvfleet_cpu, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor context_lens, float scale, int sliding_window, Tensor? sinks=None, "
        "bool allow_amx=True, float k_scale=1.0, float v_scale=1.0) -> ()");
  m.def("decode_amx_available() -> bool", &decode_amx_available);
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
