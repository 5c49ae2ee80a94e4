// CPU layers beside the decode kernel, in the same library (kernels/cpu_layers.py): the
// residual add fused with RMSNorm for bf16/fp16 models and with LayerNorm for mixed-precision
// encoders, and the op that pins OpenMP threads to cores (engine/cpu_runtime.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// RMSNorm with the residual add before it, one pass over each row, for bf16 and fp16
// (fp32 stays on the torch path, whose rounding the exact-token tests pin). It rounds where
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
    default: TORCH_CHECK(false, "add_rms_norm runs bf16 and fp16, not ", x.scalar_type());
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
  m.def("bind_threads(int[] cpus) -> ()", &bind_threads);  // no tensor to dispatch on: one kernel for all
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("add_layer_norm", &add_layer_norm);
}
