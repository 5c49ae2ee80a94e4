// Paged decode attention for the CPU: one new query token per sequence, reading K/V
// in place through the block table (no gather into padded buffers), the CPU peer of
// kernels/paged_attention.py. Same contract as kernels.reference.paged_decode_attention.
//
// Why native code: on the CPU the torch path gathers every sequence's blocks into a
// [num_seqs, max_context] buffer and runs SDPA over strided rows; that moves the KV
// three times and pads to the longest context. Here each (sequence, KV head) streams
// its own blocks once, and all query heads of a GQA group share each K/V row read.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

struct Strides {
  int64_t query_seq, query_head, out_seq, out_head, table_seq, cache_block, cache_slot, cache_head;
};

// HEAD_DIM > 0 fixes the inner loop length at compile time so it vectorises fully;
// HEAD_DIM == 0 reads it at run time (any other head size).
//
// A work item is one sequence and a span of its KV heads. With many sequences the span is
// every head, so each cache block [block_size, num_kv_heads, head_dim] is read front to back
// (22% faster than a head at a time at batch 64 here); with few, items are single heads so
// that every thread still has work.
template <typename scalar_t, int HEAD_DIM>
void decode_kernel(scalar_t* out, const scalar_t* query, const scalar_t* key_cache, const scalar_t* value_cache,
                   const int64_t* block_tables, const int64_t* context_lens, int64_t num_seqs, int64_t num_heads,
                   int64_t num_kv_heads, int64_t runtime_head_dim, int64_t block_size, float scale,
                   int64_t sliding_window, int64_t max_context, Strides st) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : runtime_head_dim;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t span = num_seqs >= 4 * at::get_num_threads() ? num_kv_heads : 1;  // KV heads per item
  const int64_t spans_per_seq = num_kv_heads / span;
  const int64_t rows = span * group;  // query heads per item
  at::parallel_for(0, num_seqs * spans_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(rows * max_context);  // [rows, max_context]
    std::vector<float> queries(rows * head_dim);    // [rows, head_dim], fp32, pre-scaled
    std::vector<float> acc(rows * head_dim);        // [rows, head_dim]
    std::vector<float> row_max(rows), inv_sum(rows);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t seq = work / spans_per_seq, first_kv_head = (work % spans_per_seq) * span;
      const int64_t len = context_lens[seq];
      const int64_t first = sliding_window > 0 && len > sliding_window ? len - sliding_window : 0;
      const int64_t* table = block_tables + seq * st.table_seq;
      for (int64_t r = 0; r < rows; ++r) {  // row r is query head first_kv_head * group + r
        const scalar_t* q = query + seq * st.query_seq + (first_kv_head * group + r) * st.query_head;
        for (int64_t d = 0; d < head_dim; ++d) queries[r * head_dim + d] = static_cast<float>(q[d]) * scale;
      }
      std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<float>::infinity());

      // Calls visit(row, position) for every position in [first, len); row points at that
      // position's K (or V) for the item's first KV head, straight in the paged cache.
      auto for_each_position = [&](const scalar_t* cache, auto&& visit) {
        for (int64_t start = first - first % block_size; start < len; start += block_size) {
          const scalar_t* block = cache + table[start / block_size] * st.cache_block + first_kv_head * st.cache_head;
          const int64_t lo = std::max<int64_t>(first - start, 0), hi = std::min(len - start, block_size);
          for (int64_t slot = lo; slot < hi; ++slot) visit(block + slot * st.cache_slot, start + slot);
        }
      };
      for_each_position(key_cache, [&](const scalar_t* key_row, int64_t pos) {
        for (int64_t r = 0; r < rows; ++r) {
          const scalar_t* k = key_row + (r / group) * st.cache_head;
          const float* q = queries.data() + r * head_dim;
          float dot = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) dot += q[d] * static_cast<float>(k[d]);
          scores[r * max_context + pos] = dot;
          row_max[r] = std::max(row_max[r], dot);
        }
      });
      // Softmax numerators in place; the 1/sum is applied once to the output.
      for (int64_t r = 0; r < rows; ++r) {
        float* s = scores.data() + r * max_context;
        float total = 0.f;
        for (int64_t pos = first; pos < len; ++pos) {
          s[pos] = std::exp(s[pos] - row_max[r]);
          total += s[pos];
        }
        inv_sum[r] = 1.f / total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_position(value_cache, [&](const scalar_t* value_row, int64_t pos) {
        for (int64_t r = 0; r < rows; ++r) {
          const scalar_t* v = value_row + (r / group) * st.cache_head;
          const float weight = scores[r * max_context + pos];
          float* a = acc.data() + r * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += weight * static_cast<float>(v[d]);
        }
      });
      for (int64_t r = 0; r < rows; ++r) {
        scalar_t* o = out + seq * st.out_seq + (first_kv_head * group + r) * st.out_head;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<scalar_t>(acc[r * head_dim + d] * inv_sum[r]);
      }
    }
  });
}

template <typename scalar_t>
void dispatch_head_dim(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_tables,
                       const at::Tensor& context_lens, double scale, int64_t sliding_window) {
  const int64_t* lens = context_lens.const_data_ptr<int64_t>();
  const int64_t max_context = query.size(0) ? *std::max_element(lens, lens + query.size(0)) : 0;
  const int64_t min_context = query.size(0) ? *std::min_element(lens, lens + query.size(0)) : 1;
  TORCH_CHECK(min_context >= 1 && max_context <= block_tables.size(1) * key_cache.size(1),
              "context_lens must be in [1, max_blocks * block_size]");
  const Strides st{query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
                   key_cache.stride(0), key_cache.stride(1), key_cache.stride(2)};
  auto run = [&](auto kernel) {
    kernel(out.data_ptr<scalar_t>(), query.const_data_ptr<scalar_t>(), key_cache.const_data_ptr<scalar_t>(),
           value_cache.const_data_ptr<scalar_t>(), block_tables.const_data_ptr<int64_t>(),
           context_lens.const_data_ptr<int64_t>(), query.size(0), query.size(1), key_cache.size(2),
           query.size(2), key_cache.size(1), static_cast<float>(scale), sliding_window, max_context, st);
  };
  switch (query.size(2)) {
    case 64: run(decode_kernel<scalar_t, 64>); break;
    case 128: run(decode_kernel<scalar_t, 128>); break;
    default: run(decode_kernel<scalar_t, 0>);
  }
}

// out, query: [num_seqs, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
// block_tables: [num_seqs, max_blocks] int64; context_lens: [num_seqs] int64, each >= 1.
// As for the Triton kernel, block ids must be valid rows of the caches: they are not checked per read.
void paged_decode_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, int64_t sliding_window) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [num_seqs, heads, dim]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(), "caches must match, 4-d");
  TORCH_CHECK(key_cache.strides() == value_cache.strides(), "key and value caches must share strides");
  TORCH_CHECK(key_cache.size(3) == query.size(2), "head_dim of query and cache differ");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1, "head_dim must be dense");
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
  switch (query.scalar_type()) {
    case at::kFloat: dispatch_head_dim<float>(out, query, key_cache, value_cache, block_tables, context_lens,
                                              scale, sliding_window); break;
    case at::kBFloat16: dispatch_head_dim<at::BFloat16>(out, query, key_cache, value_cache, block_tables,
                                                        context_lens, scale, sliding_window); break;
    case at::kHalf: dispatch_head_dim<at::Half>(out, query, key_cache, value_cache, block_tables, context_lens,
                                                scale, sliding_window); break;
    default: TORCH_CHECK(false, "unsupported dtype ", query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(kvfleet_cpu, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor context_lens, float scale, int sliding_window) -> ()");
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
