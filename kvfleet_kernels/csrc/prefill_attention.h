// What the native prefill attention kernels share: the argument checks of the contiguous ones
// (prefill_attention_cpu.cpp on avx512_bf16, prefill_attention_brgemm.cpp on AMX; each checks its
// own head sizes after), and the keys each query position sees (those two AMX kernels and
// paged_prefill_amx.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

namespace kvfleet_cpu {

// A prefill's queries are the context's last num_queries positions; window 0: none. Query
// position p (counted from the first query) sees keys [first_key(p), end_key(p)).
struct CausalSpan {
  int64_t num_queries, context_len, window;
  int64_t first_key(int64_t position) const {
    const int64_t context_pos = context_len - num_queries + position;
    return window > 0 ? std::max<int64_t>(0, context_pos - window + 1) : 0;
  }
  int64_t end_key(int64_t position) const { return context_len - num_queries + position + 1; }
};

// out, query: [Q, Hq, D] bf16; key, value: [C, Hkv, D] bf16 with Hq a multiple of Hkv and
// C >= Q >= 1 (the queries are the last Q positions of the context); D dense in each.
inline void check_prefill_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key,
                                    const at::Tensor& value) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3 && out.sizes() == query.sizes() &&
                  key.sizes() == value.sizes(), "query and out must be [Q, Hq, D], key and value [C, Hkv, D]");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
                  value.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "bf16 tensors only");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1 && out.stride(2) == 1,
              "head_dim must be dense");
  TORCH_CHECK(query.size(1) % key.size(1) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(key.size(0) >= query.size(0) && query.size(0) >= 1, "the context must hold the queries");
}

}  // namespace kvfleet_cpu
