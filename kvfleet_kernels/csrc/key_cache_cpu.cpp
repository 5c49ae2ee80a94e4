// Writes and reads of the CPU key cache layout, [num_blocks, num_kv_heads, head_dim / x,
// block_size, x] (csrc/decode_keys.h), for kvfleet_kernels/cpu_paged_attention.py: the
// decode step's new keys (and values) into their slots, and a sequence's keys back in token order for a
// prefill over a cached prefix. torch's index_put_ on the permuted view did the same store at
// 7.5x index_copy_'s time (60 against 8 us for 64 tokens; 5.1 against 0.6 ms for 8,192).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "decode_keys.h"

#include <cstdint>
#include <cstring>

namespace {

// One key cache's geometry in bytes; a token's keys are num_words words, (kv head, d / x) flattened.
struct KeyLayout {
  char* cache;
  int64_t num_blocks, block_size, word_bytes, num_words, block_bytes;

  explicit KeyLayout(const at::Tensor& key_cache) {
    TORCH_CHECK(key_cache.dim() == 5 && key_cache.is_contiguous() && key_cache.device().is_cpu(),
                "key_cache must be a dense CPU [num_blocks, num_kv_heads, head_dim / x, block_size, x]");
    TORCH_CHECK(key_cache.size(4) == kvfleet_cpu::key_word_elements(key_cache.element_size()),
                "key_cache's x must be 2 for 2-byte dtypes, 1 otherwise");
    cache = static_cast<char*>(key_cache.data_ptr());
    num_blocks = key_cache.size(0);
    block_size = key_cache.size(3);
    word_bytes = key_cache.size(4) * key_cache.element_size();
    num_words = key_cache.size(1) * key_cache.size(2);
    block_bytes = key_cache.stride(0) * key_cache.element_size();
  }

  // Copies one token's num_words words (dense in `token`) to or from cache slot `slot`.
  template <bool kToCache>
  void copy_token(int64_t slot, char* token) const {
    char* block = cache + slot / block_size * block_bytes;
    const int64_t offset = slot % block_size;
    for (int64_t w = 0; w < num_words; ++w) {
      char* cached = block + (w * block_size + offset) * word_bytes;
      if constexpr (kToCache) std::memcpy(cached, token + w * word_bytes, word_bytes);
      else std::memcpy(token + w * word_bytes, cached, word_bytes);
    }
  }
};

// Checks key [num_tokens, num_kv_heads, head_dim] and slot_mapping [num_tokens] int64 (block *
// block_size + offset) against the cache: each token's keys dense, tokens possibly apart (the
// keys arrive as a slice of the fused qkv projection, read in place), every slot inside.
const int64_t* checked_slots(const KeyLayout& layout, const at::Tensor& key_cache, const at::Tensor& key,
                             const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.size(1) == key_cache.size(1) && key.size(2) == key_cache.size(2) * key_cache.size(4),
              "key must be [num_tokens, num_kv_heads, head_dim] for this cache");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && key.stride(2) == 1 && key.stride(1) == key.size(2),
              "key must be the cache's dtype, each token's [num_kv_heads, head_dim] dense");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0), "slot_mapping must be [num_tokens] int64");
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < key.size(0); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < layout.num_blocks * layout.block_size, "slot ", slots[t],
                " is outside the cache");
  return slots;
}

// key [num_tokens, num_kv_heads, head_dim] -> the slots slot_mapping [num_tokens] of key_cache,
// and value (the same shape, each token's rows dense) into the same slots of value_cache
// [num_blocks, block_size, num_kv_heads, head_dim]: a step's new K/V in one call a layer, where
// index_copy_ for the values cost a second op and its dispatch.
void store_kv(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& key,
              const at::Tensor& value, const at::Tensor& slot_mapping) {
  const KeyLayout layout(key_cache);
  const int64_t* slots = checked_slots(layout, key_cache, key, slot_mapping);
  TORCH_CHECK(value_cache.dim() == 4 && value_cache.is_contiguous() && value_cache.size(0) == layout.num_blocks &&
                  value_cache.size(1) == layout.block_size && value_cache.scalar_type() == key_cache.scalar_type(),
              "value_cache must be a dense [num_blocks, block_size, num_kv_heads, head_dim] beside key_cache");
  TORCH_CHECK(value.sizes() == key.sizes() && value.scalar_type() == key.scalar_type() && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2) && value.size(1) == value_cache.size(2) &&
                  value.size(2) == value_cache.size(3), "value must be as key, each token's rows dense");
  auto* keys = static_cast<char*>(key.data_ptr());
  const auto* values = static_cast<const char*>(value.data_ptr());
  auto* value_slots = static_cast<char*>(value_cache.data_ptr());
  const int64_t key_stride = key.stride(0) * key.element_size(), value_stride = value.stride(0) * value.element_size();
  const int64_t value_bytes = value.size(1) * value.size(2) * value.element_size();  // one token's [Hkv, D]
  at::parallel_for(0, key.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      layout.copy_token<true>(slots[t], keys + t * key_stride);
      std::memcpy(value_slots + slots[t] * value_bytes, values + t * value_stride, value_bytes);
    }
  });
}

// One sequence's first context_len keys, block_table [num_blocks_of_seq] int64 -> a new
// [context_len, num_kv_heads, head_dim] tensor in token order.
at::Tensor gather_keys(const at::Tensor& key_cache, const at::Tensor& block_table, int64_t context_len) {
  const KeyLayout layout(key_cache);
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 1 && block_table.is_contiguous() &&
                  context_len >= 0 && context_len <= block_table.numel() * layout.block_size,
              "block_table must be [num_blocks] int64 covering context_len");
  const int64_t* table = block_table.const_data_ptr<int64_t>();
  for (int64_t b = 0; b * layout.block_size < context_len; ++b)
    TORCH_CHECK(table[b] >= 0 && table[b] < layout.num_blocks, "block ", table[b], " is outside the cache");
  at::Tensor out = at::empty({context_len, key_cache.size(1), key_cache.size(2) * key_cache.size(4)},
                             key_cache.options());
  auto* tokens = static_cast<char*>(out.data_ptr());
  const int64_t token_bytes = layout.num_words * layout.word_bytes;
  at::parallel_for(0, context_len, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = table[t / layout.block_size] * layout.block_size + t % layout.block_size;
      layout.copy_token<false>(slot, tokens + t * token_bytes);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("store_kv(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()");
  m.def("gather_keys(Tensor key_cache, Tensor block_table, int context_len) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) {
  m.impl("store_kv", &store_kv);
  m.impl("gather_keys", &gather_keys);
}
