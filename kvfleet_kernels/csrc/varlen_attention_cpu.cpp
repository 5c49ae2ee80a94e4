// Packed (varlen) attention for the CPU: embedding models' inputs laid back to back in one
// [T, heads, head_dim] batch, each attending to itself alone (bidirectional for encoders,
// causal for decoder embedding models), with no KV cache. Same contract as
// kvfleet_kernels.reference.varlen_attention; the CPU peer of kvfleet_kernels/varlen_attention.py.
//
// Why native code: the torch path pads runs of inputs to their longest and calls SDPA, whose
// CPU flash kernel reached ~23 GFLOP/s at all-MiniLM's shapes (head_dim 32, ~60 tokens) and,
// with the gathers that pad, took a quarter of a bf16 step. Here each (input, KV head) widens
// its K (transposed) and V to fp32 once, then runs blocks of four query rows against 16 keys
// at a time in registers; all query heads of a GQA group share the widened K/V.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <omp.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace kvfleet_cpu;  // NOLINT: the vector helpers are this kernel's vocabulary

constexpr int kRows = 8;  // query rows per block: each K vector loaded feeds eight FMAs

struct Layout {
  int64_t q_row, q_head, k_row, k_head, v_row, v_head, out_row, out_head;
  int64_t num_heads, num_kv_heads, head_dim;
  float scale;
  bool causal;
};

// rows[16] becomes its transpose in place: four rounds of interleaving row i with row i + 8
// (64 shuffles for 256 elements, where a scalar transpose costs a load and a store each).
inline void transpose16(vfloat* rows) {
  for (int round = 0; round < 4; ++round) {
    vfloat next[kLanes];
    for (int i = 0; i < 8; ++i) {
      next[2 * i] = __builtin_shufflevector(rows[i], rows[i + 8], 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
      next[2 * i + 1] =
          __builtin_shufflevector(rows[i], rows[i + 8], 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    }
    std::copy(next, next + kLanes, rows);
  }
}

// One input's K and V for one KV head, widened to fp32: K transposed [head_dim][padded_len]
// (keys along the vector lanes; padding keys are zero and never reach the softmax), V [len][head_dim].
struct WidenedKV {
  std::vector<float> key_t, value;
  int64_t padded_len = 0;

  template <int HEAD_DIM, typename scalar_t>
  void load(const scalar_t* key, const scalar_t* value_in, int64_t len, const Layout& l) {
    padded_len = (len + kLanes - 1) / kLanes * kLanes;
    key_t.resize(l.head_dim * padded_len);
    value.resize(len * l.head_dim);
    if constexpr (HEAD_DIM > 0) {
      for (int64_t j = 0; j < padded_len; j += kLanes)  // 16 keys x 16 dims a tile
        for (int d = 0; d < HEAD_DIM; d += kLanes) {
          vfloat tile[kLanes];
          for (int i = 0; i < kLanes; ++i) tile[i] = j + i < len ? load16(key + (j + i) * l.k_row + d) : vfloat{};
          transpose16(tile);
          for (int i = 0; i < kLanes; ++i) store16(key_t.data() + (d + i) * padded_len + j, tile[i]);
        }
      for (int64_t j = 0; j < len; ++j)
        for (int d = 0; d < HEAD_DIM; d += kLanes)
          store16(value.data() + j * HEAD_DIM + d, load16(value_in + j * l.v_row + d));
    } else {
      std::fill(key_t.begin(), key_t.end(), 0.f);
      for (int64_t j = 0; j < len; ++j)
        for (int64_t d = 0; d < l.head_dim; ++d) {
          key_t[d * padded_len + j] = static_cast<float>(key[j * l.k_row + d]);
          value[j * l.head_dim + d] = static_cast<float>(value_in[j * l.v_row + d]);
        }
    }
  }
};

// scores[r][0:num_keys] = q_r . k_j for the block's rows (q already scaled), 16 keys at a time.
inline void block_scores(float* scores, const float* q, int rows, const WidenedKV& kv, int64_t num_keys,
                         int64_t head_dim) {
  const int64_t stride = kv.padded_len;
  for (int64_t j = 0; j < num_keys; j += kLanes) {
    vfloat acc[kRows] = {};
    for (int64_t d = 0; d < head_dim; ++d) {
      const vfloat k = load16(kv.key_t.data() + d * stride + j);
      for (int r = 0; r < kRows; ++r) acc[r] += q[r * head_dim + d] * k;
    }
    for (int r = 0; r < rows; ++r) store16(scores + r * stride + j, acc[r]);
  }
}

// Row r of scores becomes its softmax numerators over keys [0, visible), zero beyond (up to
// `num_keys` rounded up to 16); returns their sum.
inline float softmax_numerators(float* row, int64_t visible, int64_t num_keys) {
  const float best = max_of(row, visible);
  const vfloat iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  vfloat total = {};
  for (int64_t j = 0; j < num_keys; j += kLanes) {
    const vfloat p = exp16(load16(row + j) - best);
    const vfloat kept = iota + static_cast<float>(j) < static_cast<float>(visible) ? p : vfloat{};
    store16(row + j, kept);
    total += kept;
  }
  return reduce_add(total);
}

// out rows of the block = sum_j p_rj v_j / sum_r, HEAD_DIM fixed (a multiple of 16) or 0 (any).
template <int HEAD_DIM, typename scalar_t>
void block_values(scalar_t* out, const float* probs, const float* sums, int rows, const WidenedKV& kv,
                  int64_t num_keys, const Layout& l) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : l.head_dim;
  if constexpr (HEAD_DIM > 0) {
    constexpr int kVecs = HEAD_DIM / kLanes;
    vfloat acc[kRows][kVecs] = {};
    for (int64_t j = 0; j < num_keys; ++j) {
      const float* v = kv.value.data() + j * HEAD_DIM;
      for (int c = 0; c < kVecs; ++c) {
        const vfloat vc = load16(v + c * kLanes);
        for (int r = 0; r < kRows; ++r) acc[r][c] += probs[r * kv.padded_len + j] * vc;
      }
    }
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < kVecs; ++c) store16(out + r * l.out_row + c * kLanes, acc[r][c] * (1.f / sums[r]));
  } else {
    std::vector<float> acc(head_dim);
    for (int r = 0; r < rows; ++r) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < num_keys; ++j) {
        const float p = probs[r * kv.padded_len + j];
        for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * kv.value[j * head_dim + d];
      }
      for (int64_t d = 0; d < head_dim; ++d) out[r * l.out_row + d] = static_cast<scalar_t>(acc[d] / sums[r]);
    }
  }
}

// Every query head of one KV head's group, over one input of `len` tokens.
template <int HEAD_DIM, typename scalar_t>
void attend_input(scalar_t* out, const scalar_t* query, const WidenedKV& kv, int64_t len, int64_t kv_head,
                  const Layout& l, std::vector<float>& q_block, std::vector<float>& scores) {
  const int64_t group = l.num_heads / l.num_kv_heads;
  q_block.assign(kRows * l.head_dim, 0.f);
  scores.resize(kRows * kv.padded_len);
  for (int64_t head = kv_head * group; head < (kv_head + 1) * group; ++head) {
    for (int64_t i = 0; i < len; i += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, len - i));
      for (int r = 0; r < rows; ++r) {
        const scalar_t* q = query + (i + r) * l.q_row + head * l.q_head;
        if constexpr (HEAD_DIM > 0)
          for (int d = 0; d < HEAD_DIM; d += kLanes) store16(q_block.data() + r * HEAD_DIM + d, load16(q + d) * l.scale);
        else
          for (int64_t d = 0; d < l.head_dim; ++d) q_block[r * l.head_dim + d] = static_cast<float>(q[d]) * l.scale;
      }
      const int64_t num_keys = l.causal ? i + rows : len;  // the block's last row sees the most
      block_scores(scores.data(), q_block.data(), rows, kv, num_keys, l.head_dim);
      float sums[kRows];
      std::fill_n(sums, kRows, 1.f);
      for (int r = 0; r < rows; ++r)
        sums[r] = softmax_numerators(scores.data() + r * kv.padded_len, l.causal ? i + r + 1 : len, num_keys);
      for (int r = rows; r < kRows; ++r)  // rows past the input's end weigh nothing
        std::fill_n(scores.data() + r * kv.padded_len, kv.padded_len, 0.f);
      block_values<HEAD_DIM>(out + i * l.out_row + head * l.out_head, scores.data(), sums, rows, kv, num_keys, l);
    }
  }
}

template <int HEAD_DIM, typename scalar_t>
void varlen_kernel(scalar_t* out, const scalar_t* query, const scalar_t* key, const scalar_t* value,
                   const int32_t* cu_seqlens, int64_t num_seqs, const Layout& l) {
  const int64_t num_tasks = num_seqs * l.num_kv_heads;
  // Dynamic: inputs arrive sorted by length, so equal static shares would be unequal work.
#pragma omp parallel num_threads(at::get_num_threads())
  {
    WidenedKV kv;
    std::vector<float> q_block, scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task) {
      const int64_t seq = task / l.num_kv_heads, kv_head = task % l.num_kv_heads;
      const int64_t start = cu_seqlens[seq], len = cu_seqlens[seq + 1] - start;
      if (len == 0) continue;
      kv.load<HEAD_DIM>(key + start * l.k_row + kv_head * l.k_head, value + start * l.v_row + kv_head * l.v_head, len, l);
      attend_input<HEAD_DIM>(out + start * l.out_row, query + start * l.q_row, kv, len, kv_head, l, q_block,
                             scores);
    }
  }
}

// out [T, heads, head_dim] contiguous; query [T, heads, head_dim] and key/value [T, kv_heads,
// head_dim] with dense last dims (row and head strides free: q/k/v may be views of one fused
// projection); cu_seqlens [num_seqs + 1] int32, each input's first row then the total (<= T).
void varlen_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const at::Tensor& cu_seqlens, double scale, bool causal) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3, "query, key and value must be [T, heads, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1, "head_dim must be dense");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes(), "out must be contiguous and shaped like query");
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(0) == query.size(0) && key.size(2) == query.size(2) &&
                  query.size(1) % key.size(1) == 0, "key/value must be [T, kv_heads, head_dim], heads a multiple of kv_heads");
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt && cu_seqlens.dim() == 1 && cu_seqlens.is_contiguous() &&
                  cu_seqlens.size(0) >= 1, "cu_seqlens must be a contiguous int32 [num_seqs + 1]");
  TORCH_CHECK(cu_seqlens[-1].item<int32_t>() <= query.size(0), "cu_seqlens ends past the batch");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type() &&
                  out.scalar_type() == query.scalar_type(), "query, key, value and out share a dtype");
  const Layout layout{query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0),
                      value.stride(1), out.stride(0), out.stride(1), query.size(1), key.size(1), query.size(2),
                      static_cast<float>(scale), causal};
  auto run = [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    auto call = [&](auto head_dim_tag) {
      varlen_kernel<decltype(head_dim_tag)::value, scalar_t>(
          out.data_ptr<scalar_t>(), query.const_data_ptr<scalar_t>(), key.const_data_ptr<scalar_t>(),
          value.const_data_ptr<scalar_t>(), cu_seqlens.const_data_ptr<int32_t>(), cu_seqlens.size(0) - 1, layout);
    };
    switch (layout.head_dim) {
      case 32: call(std::integral_constant<int, 32>{}); break;
      case 64: call(std::integral_constant<int, 64>{}); break;
      case 128: call(std::integral_constant<int, 128>{}); break;
      default: call(std::integral_constant<int, 0>{});
    }
  };
  switch (query.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<at::BFloat16*>(nullptr)); break;
    case at::kHalf: run(static_cast<at::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "varlen_attention runs fp32, bf16 and fp16, not ", query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("varlen_attention(Tensor(a!) out, Tensor query, Tensor key, Tensor value, Tensor cu_seqlens, float scale, "
        "bool causal) -> ()");
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) { m.impl("varlen_attention", &varlen_attention); }
