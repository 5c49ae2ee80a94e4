// The LoRA delta of a mixed-adapter step on the CPU (punica's BGMV: each token reads its own
// slot's A and B), in the library kvfleet_kernels/cpu_paged_attention.py builds; engine/lora/layers.py
// calls it through kvfleet_kernels/cpu_layers.py: add_lora.
//
// Why native: a decode step's LoRA work is tiny products (64 tokens x rank 8) on every one of
// a model's linears. Through torch it was a gather, two batched matmuls and a scatter-add per
// linear, ~35 ms of a ~110 ms SmolLM2 step with 8 adapters, almost all of it fixed cost per
// call. Here one pass per token: its input row widened once, the shrink as P*R dot products
// against its slot's A rows, the expand as R rows of B accumulated into its output row and
// rounded once. A slot's A and B (tens of KiB per linear) stay in L2 across its tokens.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using kvfleet_cpu::kLanes;
using kvfleet_cpu::load16;
using kvfleet_cpu::reduce_add;
using kvfleet_cpu::store16;
using kvfleet_cpu::vfloat;

// shrunk[k] = x . a[k] for k < rows: four rows a pass, so each load of x feeds four products.
template <typename scalar_t>
void shrink_rows(float* shrunk, const float* x, const scalar_t* a, int64_t rows, int64_t in) {
  int64_t k = 0;
  for (; k + 4 <= rows; k += 4) {
    const scalar_t* a0 = a + k * in;
    vfloat acc0{}, acc1{}, acc2{}, acc3{};
    int64_t i = 0;
    for (; i + kLanes <= in; i += kLanes) {
      const vfloat xv = load16(x + i);
      acc0 += xv * load16(a0 + i);
      acc1 += xv * load16(a0 + in + i);
      acc2 += xv * load16(a0 + 2 * in + i);
      acc3 += xv * load16(a0 + 3 * in + i);
    }
    float tail[4] = {0.f, 0.f, 0.f, 0.f};
    for (; i < in; ++i)
      for (int r = 0; r < 4; ++r) tail[r] += x[i] * static_cast<float>(a0[r * in + i]);
    shrunk[k] = reduce_add(acc0) + tail[0];
    shrunk[k + 1] = reduce_add(acc1) + tail[1];
    shrunk[k + 2] = reduce_add(acc2) + tail[2];
    shrunk[k + 3] = reduce_add(acc3) + tail[3];
  }
  for (; k < rows; ++k) {
    float total = 0.f;
    for (int64_t i = 0; i < in; ++i) total += x[i] * static_cast<float>(a[k * in + i]);
    shrunk[k] = total;
  }
}

// out[j] += sum_r shrunk[r] * b_t[r][j] for columns [begin, end), rounded once into out.
template <typename scalar_t>
void expand_columns(scalar_t* out, const float* shrunk, const scalar_t* b_t, int64_t rank, int64_t width,
                    int64_t begin, int64_t end) {
  int64_t j = begin;
  for (; j + kLanes <= end; j += kLanes) {
    vfloat acc = load16(out + j);
    for (int64_t r = 0; r < rank; ++r) acc += shrunk[r] * load16(b_t + r * width + j);
    store16(out + j, acc);
  }
  for (; j < end; ++j) {
    float acc = static_cast<float>(out[j]);
    for (int64_t r = 0; r < rank; ++r) acc += shrunk[r] * static_cast<float>(b_t[r * width + j]);
    out[j] = static_cast<scalar_t>(acc);
  }
}

// One token's delta added into its output row: x_row [in], out_row [width], its slot's
// a [P * R, in] and b_t [R, width], part p's columns [offsets[p], offsets[p + 1]).
template <typename scalar_t>
void add_token_delta(scalar_t* out_row, const scalar_t* x_row, const scalar_t* a, const scalar_t* b_t,
                     const std::vector<int64_t>& offsets, int64_t rank, int64_t in, int64_t width,
                     float* x_wide, float* shrunk) {
  const int64_t parts = static_cast<int64_t>(offsets.size()) - 1;
  for (int64_t i = 0; i < in; ++i) x_wide[i] = static_cast<float>(x_row[i]);
  shrink_rows(shrunk, x_wide, a, parts * rank, in);
  for (int64_t p = 0; p < parts; ++p)
    expand_columns(out_row, shrunk + p * rank, b_t, rank, width, offsets[p], offsets[p + 1]);
}

template <typename scalar_t>
void add_lora_kernel(const at::Tensor& out, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b_t,
                     const int64_t* slots, const std::vector<int64_t>& offsets) {
  const int64_t tokens = x.size(0), in = x.size(1), width = out.size(1);
  const int64_t rank = lora_b_t.size(1), a_rows = lora_a.size(1);
  scalar_t* out_data = out.data_ptr<scalar_t>();
  const scalar_t* x_data = x.const_data_ptr<scalar_t>();
  const scalar_t* a_data = lora_a.const_data_ptr<scalar_t>();
  const scalar_t* b_data = lora_b_t.const_data_ptr<scalar_t>();
  // A token costs ~(P * R * in + R * width) multiply-adds, some thousands: a few a task.
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> x_wide(in), shrunk(a_rows);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // the base model: no delta
      add_token_delta(out_data + t * out.stride(0), x_data + t * x.stride(0), a_data + slot * a_rows * in,
                      b_data + slot * rank * width, offsets, rank, in, width, x_wide.data(), shrunk.data());
    }
  });
}

// out [T, width] (rows of any stride, dense columns) += each token's delta, in place.
// x [T, in] dense columns; lora_a [L, P * R, in] and lora_b_t [L, R, width] contiguous, all in
// out's dtype (fp32, bf16 or fp16); token_slots [T] int64, -1 for none; part_offsets [P + 1]:
// the columns where each part's outputs start, then width.
void add_lora(const at::Tensor& out, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b_t,
              const at::Tensor& token_slots, c10::ArrayRef<int64_t> part_offsets) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0) && x.stride(1) == 1 && out.stride(1) == 1,
              "x and out must be [T, features] with dense columns");
  TORCH_CHECK(lora_a.dim() == 3 && lora_b_t.dim() == 3 && lora_a.is_contiguous() && lora_b_t.is_contiguous() &&
                  lora_a.size(0) == lora_b_t.size(0) && lora_a.size(2) == x.size(1) && lora_b_t.size(2) == out.size(1),
              "lora_a must be [L, P * R, in] and lora_b_t [L, R, width], contiguous");
  const int64_t parts = static_cast<int64_t>(part_offsets.size()) - 1, rank = lora_b_t.size(1);
  TORCH_CHECK(parts >= 1 && lora_a.size(1) == parts * rank && part_offsets.front() == 0 &&
                  part_offsets.back() == out.size(1), "part_offsets must be [P + 1] columns from 0 to width");
  TORCH_CHECK(token_slots.scalar_type() == at::kLong && token_slots.is_contiguous() &&
                  token_slots.numel() == x.size(0), "token_slots must be [T] int64");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && lora_a.scalar_type() == out.scalar_type() &&
                  lora_b_t.scalar_type() == out.scalar_type(), "x, out, lora_a and lora_b_t share a dtype");
  const int64_t* slots = token_slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < token_slots.numel(); ++t)
    TORCH_CHECK(slots[t] >= -1 && slots[t] < lora_a.size(0), "token slot ", slots[t], " is outside [-1, L)");
  const std::vector<int64_t> offsets(part_offsets.begin(), part_offsets.end());
  switch (out.scalar_type()) {
    case at::kFloat: add_lora_kernel<float>(out, x, lora_a, lora_b_t, slots, offsets); break;
    case at::kBFloat16: add_lora_kernel<at::BFloat16>(out, x, lora_a, lora_b_t, slots, offsets); break;
    case at::kHalf: add_lora_kernel<at::Half>(out, x, lora_a, lora_b_t, slots, offsets); break;
    default: TORCH_CHECK(false, "add_lora runs fp32, bf16 and fp16, not ", out.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("add_lora(Tensor(a!) out, Tensor x, Tensor lora_a, Tensor lora_b_t, Tensor token_slots, "
        "int[] part_offsets) -> ()");
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) { m.impl("add_lora", &add_lora); }
