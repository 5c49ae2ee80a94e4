// Writes and reads of the CPU cache layouts (kvfleet_kernels/cpu_paged_attention.py): keys as
// [num_blocks, num_kv_heads, head_dim / x, block_size, x] (csrc/decode_keys.h), values as
// [num_blocks, num_kv_heads, block_size / y, head_dim, y] (csrc/decode_values.h), x and y the
// elements to a word of each (2 for bf16 and fp8; the keys also 2 for fp16, 1 for fp32). A decode
// step's new keys and values into their slots, and a sequence's back in token order for a
// prefill over a cached prefix. torch's index_put_ on the permuted view did the key store at
// 7.5x index_copy_'s time (60 against 8 us for 64 tokens; 5.1 against 0.6 ms for 8,192).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "decode_keys.h"
#include "decode_values.h"

#include <cstdint>
#include <cstring>

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace {

// One cache's geometry. A token's [num_kv_heads, head_dim] elements are, per head, `head_units`
// units of `word` elements (a key word: x elements; a value: one element) of `element` bytes;
// unit u of head h of slot s of a block lies (h * head_stride + u * unit_stride + s / group *
// group_stride + s % group) elements in: keys unit_stride = block_size * x, group 1 and
// group_stride x; values unit_stride = y, group y and group_stride head_dim * y.
struct CacheLayout {
  char* cache;
  int64_t num_blocks, block_size, element, word, num_heads, head_units, head_stride, unit_stride, group,
      group_stride, block_bytes;

  CacheLayout(const at::Tensor& cache_tensor, bool keys) {
    TORCH_CHECK(cache_tensor.dim() == 5 && cache_tensor.is_contiguous() && cache_tensor.device().is_cpu(),
                keys ? "key_cache must be a dense CPU [num_blocks, num_kv_heads, head_dim / x, block_size, x]"
                     : "value_cache must be a dense CPU [num_blocks, num_kv_heads, block_size / y, head_dim, y]");
    element = cache_tensor.element_size();
    const int64_t x = cache_tensor.size(4);
    cache = static_cast<char*>(cache_tensor.data_ptr());
    num_blocks = cache_tensor.size(0), num_heads = cache_tensor.size(1), head_stride = cache_tensor.stride(1);
    if (keys) {
      TORCH_CHECK(x == kvfleet_cpu::key_word_elements(cache_tensor.scalar_type()),
                  "key_cache's x must be 1 for fp32, 2 otherwise");
      block_size = cache_tensor.size(3), word = x, head_units = cache_tensor.size(2);
      unit_stride = block_size * x, group = 1, group_stride = x;
    } else {
      TORCH_CHECK(x == kvfleet_cpu::value_word_elements(cache_tensor.scalar_type()),
                  "value_cache's y must be 2 for bf16 and fp8, 1 otherwise");
      block_size = cache_tensor.size(2) * x, word = 1, head_units = cache_tensor.size(3);
      unit_stride = x, group = x, group_stride = head_units * x;
    }
    block_bytes = cache_tensor.stride(0) * element;
  }
  int64_t token_elements() const { return num_heads * head_units * word; }
  int64_t token_bytes() const { return token_elements() * element; }

  // Copies one token's elements (dense in `token`) to or from cache slot `slot`.
  template <bool kToCache>
  void copy_token(int64_t slot, char* token) const {
    const int64_t offset = slot % block_size, unit = word * element, stride = unit_stride * element;
    char* block = cache + slot / block_size * block_bytes;
    for (int64_t h = 0; h < num_heads; ++h) {
      char* first = block + (h * head_stride + offset / group * group_stride + offset % group) * element;
      char* mine = token + h * head_units * unit;
      if (unit == stride) {  // the units sit side by side: one copy
        if constexpr (kToCache) std::memcpy(first, mine, head_units * unit); else std::memcpy(mine, first, head_units * unit);
        continue;
      }
#if defined(__AVX512BW__)
      if (group == 2 && element == 2 && head_units % 16 == 0) {  // bf16 values: one half of each word
        copy_half_words<kToCache>(first - offset % 2 * element, mine, offset % 2);
        continue;
      }
      if (group == 2 && element == 1 && head_units % 32 == 0) {  // fp8 values: one byte of each pair
        copy_half_pairs<kToCache>(first - offset % 2, mine, offset % 2);
        continue;
      }
#endif
      for (int64_t u = 0; u < head_units; ++u) {
        if constexpr (kToCache) std::memcpy(first + u * stride, mine + u * unit, unit);
        else std::memcpy(mine + u * unit, first + u * stride, unit);
      }
    }
  }

#if defined(__AVX512BW__)
  // One head of a bf16 value token, head_units elements, to or from half `half` (0: the low, even
  // position) of the words at `words`, 16 at a time: a 2-byte copy per element ran store_kv ~3x and
  // gather_values ~2x slower than the keys' 4-byte words.
  template <bool kToCache>
  void copy_half_words(char* words, char* token, int64_t half) const {
    const __mmask32 mine = half ? 0xAAAAAAAAu : 0x55555555u;
    for (int64_t i = 0; i < head_units; i += 16) {
      void* at = words + i * 4;
      if constexpr (kToCache) {
        __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(token + i * 2)));
        if (half) wide = _mm512_slli_epi32(wide, 16);
        _mm512_mask_storeu_epi16(at, mine, wide);
      } else {
        __m512i wide = _mm512_loadu_si512(at);
        if (half) wide = _mm512_srli_epi32(wide, 16);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(token + i * 2), _mm512_cvtepi32_epi16(wide));
      }
    }
  }

  // copy_half_words for an fp8 value token: head_units bytes to or from byte `half` of the 16-bit
  // pairs at `pairs`, 32 at a time (a byte's memcpy each cost store_kv most of its time).
  template <bool kToCache>
  void copy_half_pairs(char* pairs, char* token, int64_t half) const {
    const __mmask64 mine = half ? 0xAAAAAAAAAAAAAAAAull : 0x5555555555555555ull;
    for (int64_t i = 0; i < head_units; i += 32) {
      void* at = pairs + i * 2;
      if constexpr (kToCache) {
        __m512i wide = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(token + i)));
        if (half) wide = _mm512_slli_epi16(wide, 8);
        _mm512_mask_storeu_epi8(at, mine, wide);
      } else {
        __m512i wide = _mm512_loadu_si512(at);
        if (half) wide = _mm512_srli_epi16(wide, 8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(token + i), _mm512_cvtepi16_epi8(wide));
      }
    }
  }
#endif
};

// Checks rows [num_tokens, num_kv_heads, head_dim] and slot_mapping [num_tokens] int64 (block *
// block_size + offset) against a cache: each token's rows dense, tokens possibly apart (the keys
// and values arrive as slices of the fused qkv projection, read in place), every slot inside.
const int64_t* checked_slots(const CacheLayout& layout, const at::Tensor& cache, const at::Tensor& rows,
                             const at::Tensor& slot_mapping, const char* name) {
  TORCH_CHECK(rows.dim() == 3 && rows.size(1) == layout.num_heads && rows.size(2) == layout.head_units * layout.word &&
                  rows.scalar_type() == cache.scalar_type() && rows.stride(2) == 1 && rows.stride(1) == rows.size(2),
              name, " must be [num_tokens, num_kv_heads, head_dim] for its cache, in its dtype, each token's rows dense");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == rows.size(0), "slot_mapping must be [num_tokens] int64");
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < rows.size(0); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < layout.num_blocks * layout.block_size, "slot ", slots[t],
                " is outside the cache");
  return slots;
}

// key, value [num_tokens, num_kv_heads, head_dim] -> the slots slot_mapping [num_tokens] of the
// two caches: a step's new K/V in one call a layer, where a second op cost its own dispatch.
void store_kv(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& key,
              const at::Tensor& value, const at::Tensor& slot_mapping) {
  const CacheLayout keys(key_cache, true), values(value_cache, false);
  TORCH_CHECK(values.num_blocks == keys.num_blocks && values.block_size == keys.block_size,
              "value_cache must have key_cache's number of blocks and block size");
  TORCH_CHECK(value.sizes() == key.sizes(), "value must be as key");
  const int64_t* slots = checked_slots(keys, key_cache, key, slot_mapping, "key");
  checked_slots(values, value_cache, value, slot_mapping, "value");
  auto* key_rows = static_cast<char*>(key.data_ptr());
  auto* value_rows = static_cast<char*>(value.data_ptr());
  const int64_t key_stride = key.stride(0) * key.element_size(), value_stride = value.stride(0) * value.element_size();
  at::parallel_for(0, key.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      keys.copy_token<true>(slots[t], key_rows + t * key_stride);
      values.copy_token<true>(slots[t], value_rows + t * value_stride);
    }
  });
}

// One sequence's first context_len keys (or values), block_table [num_blocks_of_seq] int64 -> a
// new [context_len, num_kv_heads, head_dim] tensor in token order.
at::Tensor gather_tokens(const at::Tensor& cache, const at::Tensor& block_table, int64_t context_len, bool keys) {
  const CacheLayout layout(cache, keys);
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 1 && block_table.is_contiguous() &&
                  context_len >= 0 && context_len <= block_table.numel() * layout.block_size,
              "block_table must be [num_blocks] int64 covering context_len");
  const int64_t* table = block_table.const_data_ptr<int64_t>();
  for (int64_t b = 0; b * layout.block_size < context_len; ++b)
    TORCH_CHECK(table[b] >= 0 && table[b] < layout.num_blocks, "block ", table[b], " is outside the cache");
  at::Tensor out = at::empty({context_len, layout.num_heads, layout.head_units * layout.word}, cache.options());
  auto* tokens = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, context_len, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = table[t / layout.block_size] * layout.block_size + t % layout.block_size;
      layout.copy_token<false>(slot, tokens + t * layout.token_bytes());
    }
  });
  return out;
}

at::Tensor gather_keys(const at::Tensor& key_cache, const at::Tensor& block_table, int64_t context_len) {
  return gather_tokens(key_cache, block_table, context_len, true);
}
at::Tensor gather_values(const at::Tensor& value_cache, const at::Tensor& block_table, int64_t context_len) {
  return gather_tokens(value_cache, block_table, context_len, false);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("store_kv(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()");
  m.def("gather_keys(Tensor key_cache, Tensor block_table, int context_len) -> Tensor");
  m.def("gather_values(Tensor value_cache, Tensor block_table, int context_len) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) {
  m.impl("store_kv", &store_kv);
  m.impl("gather_keys", &gather_keys);
  m.impl("gather_values", &gather_values);
}
