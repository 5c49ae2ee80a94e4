// Causal prefill attention for bf16 models on CPUs with AMX: flash attention whose two products
// run on oneDNN's batch-reduce GEMM microkernel (torch's cpublas::brgemm, AMX tiles). Same
// contract as prefill_attention_cpu.cpp (kvfleet_kernels/cpu_prefill_attention.py chooses).
//
// Why: torch's CPU flash kernel, the AMX hosts' prefill attention before this, spent ~0.5 ns a
// computed score on two cores (~20% of the bf16 matmul probe) and computes ~1/3 more scores than
// the causal triangle holds (its 256 x 512 blocks); a document's prefill step spent ~46% there.
// Here a work item is (KV head, block of kBlockPositions query positions): every query head of
// the group becomes rows of one matrix, so K and V blocks serve the group at once; key blocks
// past a row block's last position are never computed, and only the blocks on the diagonal (or a
// window's edge) are masked. K and V are packed once per call into the VNNI layouts brgemm reads
// (per key block: K^T as [D / 2][kBlockKeys] pair words, V as [kBlockKeys / 2][D]), so every
// microkernel call has the same shape and leading dimensions (one JIT kernel each).
// Online softmax in fp32; the probabilities are rounded to bf16 for the second product, as
// torch's flash kernel and FlashAttention do.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "prefill_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

namespace cpublas = at::native::cpublas;
using namespace kvfleet_cpu;  // NOLINT: the vector helpers are this kernel's vocabulary

constexpr int64_t kBlockKeys = 128;      // keys per block: the first product's N, the second's K
constexpr int64_t kBlockPositions = 32;  // query positions per work item (times the GQA group: its rows)

struct Shape : CausalSpan {  // the queries, the context and the window: which keys each query sees
  int64_t num_blocks, num_heads, num_kv_heads, head_dim, group;
  int64_t q_row, q_head, k_row, k_head, v_row, v_head, out_row, out_head;
  float scale;
};

// e^x for x <= 0 (scores minus the row max; a masked key's -inf gives ~2^-126, which the caller
// zeroes): 2^(x log2 e) as 2^n (vscalefps) times 2^f, f in [-1/2, 1/2], by its degree-5 Taylor
// polynomial (relative error < 2.4e-6, far inside the bf16 rounding the probabilities get).
// About half the instructions of cpu_vec.h's exp16, whose range reduction goes through integer
// bits: the exponentials were most of this kernel's softmax, itself most of its time.
inline vfloat exp16_scalef(vfloat x) {
#if defined(__AVX512F__)
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(reinterpret_cast<__m512>(x), _mm512_set1_ps(1.44269504f)),
                                 _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.33335581e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.61812911e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55041087e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147181e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return reinterpret_cast<vfloat>(_mm512_scalef_ps(p, n));
#else
  return exp16(x);
#endif
}

// 16 lanes to bf16, rounded to nearest even: one vcvtneps2bf16 where the CPU has it (every AMX
// host does), cpu_vec.h's integer rounding elsewhere; the same bits for finite values.
inline void store16_bf16(at::BFloat16* p, vfloat v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(v))));
#else
  store16(p, v);
#endif
}

// Key block b of one KV head: key_block = K^T as [D / 2][kBlockKeys] words of two adjacent
// dimensions (VNNI), value_block = V as [kBlockKeys / 2][D] words of two adjacent keys; keys past
// the context are zero.
void pack_block(at::BFloat16* key_block, at::BFloat16* value_block, const at::BFloat16* key, const at::BFloat16* value,
                int64_t b, const Shape& s) {
  const int64_t d = s.head_dim, k0 = b * kBlockKeys, keys = std::min(kBlockKeys, s.context_len - k0);
  auto* key_words = reinterpret_cast<uint32_t*>(key_block);
  for (int64_t i = 0; i < d / 2; ++i) {
    uint32_t* row = key_words + i * kBlockKeys;
    for (int64_t n = 0; n < keys; ++n) std::memcpy(row + n, key + (k0 + n) * s.k_row + 2 * i, sizeof(uint32_t));
    std::fill(row + keys, row + kBlockKeys, 0u);
  }
  auto* value_halves = reinterpret_cast<uint16_t*>(value_block);
  for (int64_t j = 0; j < kBlockKeys / 2; ++j) {  // keys 2j and 2j + 1, interleaved per dimension
    uint16_t* out = value_halves + j * 2 * d;
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t n = 2 * j + half;
      const auto* in = reinterpret_cast<const uint16_t*>(value + (k0 + n) * s.v_row);
      if (n < keys)
        for (int64_t i = 0; i < d; ++i) out[2 * i + half] = in[i];
      else
        for (int64_t i = 0; i < d; ++i) out[2 * i + half] = 0;
    }
  }
}

// Per-thread buffers of one work item: rows = positions x group, row r = g * positions + i.
struct Workspace {
  std::vector<at::BFloat16> q, probs;  // [rows, D], [rows, kBlockKeys]
  std::vector<float> scores, acc, row_max, row_sum;
  Workspace(int64_t rows, int64_t d)
      : q(rows * d), probs(rows * kBlockKeys), scores(rows * kBlockKeys), acc(rows * d), row_max(rows),
        row_sum(rows) {}
};

// The row's running max, sum and output moved to new_max (scores were against the old one).
inline void rescale_row(Workspace& w, int64_t r, float new_max, float block_sum, int64_t d) {
  if (new_max == w.row_max[r]) {  // most blocks after the first few: nothing to rescale
    w.row_sum[r] += block_sum;
    return;
  }
  const float correction = std::exp(w.row_max[r] - new_max);  // 0 on the row's first visible block
  w.row_max[r] = new_max;
  w.row_sum[r] = w.row_sum[r] * correction + block_sum;
  if (correction == 1.f) return;
  float* out = w.acc.data() + r * d;
  const vfloat c = vfloat{} + correction;
  for (int64_t i = 0; i < d; i += kLanes) store16(out + i, load16(out + i) * c);
}

// Row r's scores for keys [k0, k0 + kBlockKeys) -> probabilities (bf16) against the running max,
// exactly zero outside [lo, hi); rescales the row's running sum and output by the max's change.
// A row that sees none of these keys (a window starting past them) gets zero probabilities.
void softmax_block(Workspace& w, int64_t r, int64_t k0, int64_t lo, int64_t hi, float scale, int64_t d) {
  const float* s = w.scores.data() + r * kBlockKeys;
  at::BFloat16* probs = w.probs.data() + r * kBlockKeys;
  const vfloat scale16 = vfloat{} + scale;
  if (lo <= k0 && k0 + kBlockKeys <= hi) {  // every key visible: one pass, no masks
    vfloat best = load16(s);
    for (int64_t n = kLanes; n < kBlockKeys; n += kLanes) {
      const vfloat v = load16(s + n);
      best = v > best ? v : best;
    }
    const float new_max = std::max(w.row_max[r], reduce_max(best) * scale);
    const vfloat shift = vfloat{} - new_max;
    vfloat total{};
    for (int64_t n = 0; n < kBlockKeys; n += kLanes) {
      const vfloat p = exp16_scalef(load16(s + n) * scale16 + shift);
      total += p;
      store16_bf16(probs + n, p);
    }
    rescale_row(w, r, new_max, reduce_add(total), d);
    return;
  }
  const int64_t first = std::clamp<int64_t>(lo - k0, 0, kBlockKeys), end = std::clamp<int64_t>(hi - k0, 0, kBlockKeys);
  if (first >= end) {
    std::fill(probs, probs + kBlockKeys, at::BFloat16(0.f));
    return;
  }
  using i32x16 = int32_t __attribute__((vector_size(64)));
  const i32x16 lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const float new_max = std::max(w.row_max[r], max_of(s + first, end - first) * scale);
  const vfloat shift = vfloat{} - new_max;
  vfloat sum16{};
  for (int64_t n = 0; n < kBlockKeys; n += kLanes) {  // a diagonal or window-edge block: masked per lane
    const i32x16 key = lanes + static_cast<int32_t>(n);
    const vfloat p = (key >= static_cast<int32_t>(first)) & (key < static_cast<int32_t>(end))
                         ? exp16_scalef(load16(s + n) * scale16 + shift) : vfloat{};
    sum16 += p;
    store16_bf16(probs + n, p);
  }
  const float total = reduce_add(sum16);
  rescale_row(w, r, new_max, total, d);
}

// Query positions [p0, p1) of KV head h: every key block any of them sees, two brgemm calls each.
void attend_item(at::BFloat16* out, const at::BFloat16* query, const at::BFloat16* key_blocks,
                 const at::BFloat16* value_blocks, int64_t h, int64_t p0, int64_t p1, const Shape& s, Workspace& w) {
  const int64_t d = s.head_dim, positions = p1 - p0, rows = positions * s.group, block_elements = kBlockKeys * d;
  for (int64_t g = 0; g < s.group; ++g)
    for (int64_t i = 0; i < positions; ++i)
      std::memcpy(w.q.data() + (g * positions + i) * d, query + (p0 + i) * s.q_row + (h * s.group + g) * s.q_head,
                  d * sizeof(at::BFloat16));
  std::fill(w.acc.begin(), w.acc.begin() + rows * d, 0.f);
  std::fill(w.row_max.begin(), w.row_max.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(w.row_sum.begin(), w.row_sum.begin() + rows, 0.f);
  const int64_t first_block = s.first_key(p0) / kBlockKeys, end_block = (s.end_key(p1 - 1) - 1) / kBlockKeys + 1;
  for (int64_t b = first_block; b < end_block; ++b) {
    const int64_t k0 = b * kBlockKeys;
    cpublas::brgemm(rows, kBlockKeys, d, d, kBlockKeys, kBlockKeys, false, w.q.data(), key_blocks + b * block_elements,
                    w.scores.data());  // [rows, kBlockKeys] = q [rows, D] @ K^T
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t position = p0 + r % positions;
      softmax_block(w, r, k0, s.first_key(position), s.end_key(position), s.scale, d);
    }
    cpublas::brgemm(rows, d, kBlockKeys, kBlockKeys, d, d, true, w.probs.data(), value_blocks + b * block_elements,
                    w.acc.data());  // acc [rows, D] += probs @ V
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t g = r / positions, i = r % positions;
    at::BFloat16* o = out + (p0 + i) * s.out_row + (h * s.group + g) * s.out_head;
    const vfloat inv_sum = vfloat{} + 1.f / w.row_sum[r];
    for (int64_t c = 0; c < d; c += kLanes) store16(o + c, load16(w.acc.data() + r * d + c) * inv_sum);
  }
}

void prefill_kernel(at::BFloat16* out, const at::BFloat16* query, const at::BFloat16* key, const at::BFloat16* value,
                    const Shape& s) {
  const int64_t head_elements = s.num_blocks * kBlockKeys * s.head_dim;
  std::vector<at::BFloat16> key_blocks(s.num_kv_heads * head_elements), value_blocks(s.num_kv_heads * head_elements);
  const int64_t block_elements = kBlockKeys * s.head_dim;
  at::parallel_for(0, s.num_kv_heads * s.num_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / s.num_blocks, b = item % s.num_blocks, at = h * head_elements + b * block_elements;
      pack_block(key_blocks.data() + at, value_blocks.data() + at, key + h * s.k_head, value + h * s.v_head, b, s);
    }
  });
  // Items cost about the key blocks their rows see, which grow along the causal triangle.
  const int64_t blocks = (s.num_queries + kBlockPositions - 1) / kBlockPositions, num_items = s.num_kv_heads * blocks;
  std::vector<int64_t> cost_before(num_items + 1, 0);
  for (int64_t item = 0; item < num_items; ++item) {
    const int64_t p0 = item % blocks * kBlockPositions, p1 = std::min(p0 + kBlockPositions, s.num_queries);
    cost_before[item + 1] = cost_before[item] + (s.end_key(p1 - 1) - s.first_key(p0)) / kBlockKeys + 1;
  }
  parallel_for_by_cost(cost_before, [&](int64_t begin, int64_t end) {
    Workspace workspace(kBlockPositions * s.group, s.head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / blocks, p0 = item % blocks * kBlockPositions;
      attend_item(out, query, key_blocks.data() + h * head_elements, value_blocks.data() + h * head_elements, h, p0,
                  std::min(p0 + kBlockPositions, s.num_queries), s, workspace);
    }
    cpublas::brgemm_release();  // the AMX tile state, per thread
  });
}

// out, query: [Q, Hq, D] bf16; key, value: [C, Hkv, D] bf16, C >= Q (the queries are the last
// Q positions of the context); rows of any stride, D dense, a multiple of 32 up to 256;
// sliding_window 0: none.
void prefill_attention_brgemm(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key,
                              const at::Tensor& value, double scale, int64_t sliding_window) {
  TORCH_CHECK(cpublas::could_pack(at::kBFloat16), "prefill_attention_brgemm needs AMX (oneDNN's bf16 brgemm)");
  kvfleet_cpu::check_prefill_attention(out, query, key, value);
  TORCH_CHECK(query.size(2) == key.size(2) && query.size(2) % 32 == 0 && query.size(2) <= 256,
              "head_dim must be a multiple of 32 up to 256, shared by query and key");
  const int64_t context_len = key.size(0);
  const Shape s{{query.size(0), context_len, sliding_window > 0 ? sliding_window : 0},
                (context_len + kBlockKeys - 1) / kBlockKeys, query.size(1), key.size(1), query.size(2),
                query.size(1) / key.size(1), query.stride(0), query.stride(1), key.stride(0), key.stride(1),
                value.stride(0), value.stride(1), out.stride(0), out.stride(1), static_cast<float>(scale)};
  prefill_kernel(out.data_ptr<at::BFloat16>(), query.const_data_ptr<at::BFloat16>(),
                 key.const_data_ptr<at::BFloat16>(), value.const_data_ptr<at::BFloat16>(), s);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("prefill_attention_brgemm(Tensor(a!) out, Tensor query, Tensor key, Tensor value, float scale, "
        "int sliding_window) -> ()");
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) { m.impl("prefill_attention_brgemm", &prefill_attention_brgemm); }
