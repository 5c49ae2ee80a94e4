// bf16 linear layers on oneDNN's batch-reduce GEMM microkernel (torch's cpublas::brgemm, AMX
// tiles where the CPU has them) over a weight packed once into its VNNI layout: the CPU
// linear of bf16 models on AMX hosts (engine/models/layers.py: PackedBf16Linear, kernel "brgemm").
//
// Why not oneDNN's matmul primitive (mkldnn::_linear_pointwise over a reordered weight), as
// the other CPU paths use: on a 2-core Xeon with AMX, SmolLM2's 120 decoder linears took 14.6 ms
// at 16 rows and 15.5 ms at 64 against 8.0 and 12.6 ms here, and 32.8 against 25.8 ms at 8,192
// rows (a prefill step). At 16 rows a step streams the weights at 27 GB/s here, about the
// host's read probe, where the primitive reached 15.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "packed_linear.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

namespace cpublas = at::native::cpublas;
using kvfleet_cpu::kLanes;
using kvfleet_cpu::load16;
using kvfleet_cpu::round16;
using kvfleet_cpu::silu_mul16;
using kvfleet_cpu::store16;
using kvfleet_cpu::vfloat;

// Output columns per packed block (the microkernel's N: four 16-column AMX tiles) and rows
// per work item: a 256-row block of activations stays in L2 while every weight block passes.
constexpr int64_t kBlockN = kvfleet_cpu::kPackedColumns, kBlockM = 256;

// weight [N, K] bf16 -> [ceil(N / 64), K * 64]: block b holds output columns [64b, 64b + 64)
// (zeros past N) as cpublas::pack lays out B = weight^T, K/2 row pairs of 64 interleaved
// column pairs (VNNI).
at::Tensor pack_brgemm_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "weight must be [N, K] bf16 on the CPU");
  TORCH_CHECK(weight.size(1) % 2 == 0, "K must be even (bf16 pairs)");
  const int64_t n = weight.size(0), k = weight.size(1), blocks = (n + kBlockN - 1) / kBlockN;
  at::Tensor transposed = at::zeros({k, blocks * kBlockN}, weight.options());  // [K, N padded]
  transposed.narrow(1, 0, n).copy_(weight.t());
  at::Tensor packed = at::empty({blocks, k * kBlockN}, weight.options());
  for (int64_t b = 0; b < blocks; ++b)
    cpublas::pack(k, kBlockN, blocks * kBlockN, kBlockN, at::kBFloat16, at::kBFloat16,
                  transposed.const_data_ptr<at::BFloat16>() + b * kBlockN, packed.data_ptr<at::BFloat16>() + b * k * kBlockN);
  return packed;
}

// out[rows, cols] (row stride out_stride) = acc[rows, 64] + bias, rounded to bf16; cols <= 64.
void store_block(at::BFloat16* out, int64_t out_stride, const float* acc, const float* bias, int64_t rows,
                 int64_t cols) {
  for (int64_t m = 0; m < rows; ++m) {
    int64_t c = 0;
    for (; c + kLanes <= cols; c += kLanes)
      store16(out + m * out_stride + c, load16(acc + m * kBlockN + c) + (bias ? load16(bias + c) : vfloat{}));
    for (; c < cols; ++c) out[m * out_stride + c] = static_cast<at::BFloat16>(acc[m * kBlockN + c] + (bias ? bias[c] : 0.f));
  }
}

// One call's share of a linear: rows [row0, row0 + num_rows) against output columns
// [col0, col0 + width), all within panel col0 / 64.
struct Piece {
  int64_t row0, num_rows, col0, width;
  int64_t panel_offset() const { return col0 % kBlockN; }  // the piece's first column within its panel
};

// Calls body(piece) for each piece of `rows` x `col_blocks` panels, on torch's threads. Shares
// are cut at 16-column slices, not at panels, so that every thread gets the same work when the
// panels do not divide among the threads: SmolLM2's 576 outputs are 9 panels, 5 and 4 of them
// on two threads, and at 64 rows such a layer ran as slow as one of 10 panels (65 against 57 us
// for 8, 2-core Xeon with AMX). A thread's share is then its whole panels and at most a slice
// run at each end. A column's sum runs in the same order whichever call computes it.
template <typename Body>
void for_each_piece(int64_t rows, int64_t col_blocks, Body&& body) {
  constexpr int64_t kSlice = 16, kSlices = kBlockN / kSlice;  // columns a slice, slices a panel
  const int64_t row_blocks = (rows + kBlockM - 1) / kBlockM, units = row_blocks * col_blocks * kSlices;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end;) {
      const int64_t block = unit / kSlices;  // (row block, panel), row-block major
      const int64_t stop = std::min(end, (block + 1) * kSlices), row0 = block / col_blocks * kBlockM;
      body(Piece{row0, std::min(kBlockM, rows - row0), block % col_blocks * kBlockN + unit % kSlices * kSlice,
                 (stop - unit) * kSlice});
      unit = stop;
    }
    cpublas::brgemm_release();  // the AMX tile state, per thread
  });
}

// out [M, N] = x [M, K] @ weight^T + bias, weight as pack_brgemm_weight left it: at decode sizes
// (one row block) each thread streams its share of the weight once.
void brgemm_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                   const std::optional<at::Tensor>& bias) {
  kvfleet_cpu::check_packed_linear(out, x, packed, bias, "pack_brgemm_weight");
  const int64_t rows = x.size(0), k = x.size(1), n = out.size(1);
  const at::BFloat16* a = x.const_data_ptr<at::BFloat16>();
  const at::BFloat16* b = packed.const_data_ptr<at::BFloat16>();
  const float* bias_data = bias ? bias->const_data_ptr<float>() : nullptr;
  at::BFloat16* c = out.data_ptr<at::BFloat16>();
  thread_local std::vector<float> acc;  // [rows of a block, kBlockN] fp32 sums
  for_each_piece(rows, packed.size(0), [&](const Piece& p) {
    const int64_t cols = std::min(p.width, n - p.col0);
    if (cols <= 0) return;  // wholly in the last panel's padding
    acc.resize(p.num_rows * kBlockN);
    const int64_t panel = p.col0 - p.panel_offset();
    cpublas::brgemm(p.num_rows, p.width, k, x.stride(0), kBlockN, kBlockN, false, a + p.row0 * x.stride(0),
                    b + panel * k + 2 * p.panel_offset(), acc.data());
    store_block(c + p.row0 * out.stride(0) + p.col0, out.stride(0), acc.data(), bias_data ? bias_data + p.col0 : nullptr,
                p.num_rows, cols);
  });
}

// out[rows, cols] (row stride out_stride) = SiLU(gate) * up, where gate and up are the fp32 sums
// gate_acc and up_acc [rows, 64] plus their biases, each rounded to bf16 first: bit for bit
// what store_block's two bf16 panels and then silu_and_mul (csrc/cpu_layers.cpp) give; cols a
// multiple of 16.
void store_silu_block(at::BFloat16* out, int64_t out_stride, const float* gate_acc, const float* up_acc,
                      const float* gate_bias, const float* up_bias, int64_t rows, int64_t cols) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t c = 0; c < cols; c += kLanes) {
      const vfloat gate = load16(gate_acc + m * kBlockN + c) + (gate_bias ? load16(gate_bias + c) : vfloat{});
      const vfloat up = load16(up_acc + m * kBlockN + c) + (up_bias ? load16(up_bias + c) : vfloat{});
      store16(out + m * out_stride + c, silu_mul16<at::BFloat16>(round16<at::BFloat16>(gate), round16<at::BFloat16>(up)));
    }
}

// out [M, I] = SiLU(gate) * up for [gate, up] = x [M, K] @ weight^T + bias: a gated MLP's gate_up
// projection and vLLM's silu_and_mul in one pass, so that the [M, 2I] product never goes to
// memory and back (at 8,192 rows of SmolLM2, 50 MB a layer). weight [2I, K] as
// pack_brgemm_weight left it, I a multiple of 64: gate panel c pairs with up panel c + I / 64.
void brgemm_gate_up_silu(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias) {
  kvfleet_cpu::check_gate_up_silu(out, x, packed, bias, "pack_brgemm_weight");
  const int64_t rows = x.size(0), k = x.size(1), width = out.size(1);
  const at::BFloat16* a = x.const_data_ptr<at::BFloat16>();
  const at::BFloat16* b = packed.const_data_ptr<at::BFloat16>();
  const float* bias_data = bias ? bias->const_data_ptr<float>() : nullptr;
  at::BFloat16* c = out.data_ptr<at::BFloat16>();
  thread_local std::vector<float> gate, up;  // [rows of a block, kBlockN] fp32 sums each
  for_each_piece(rows, width / kBlockN, [&](const Piece& p) {
    gate.resize(p.num_rows * kBlockN);
    up.resize(p.num_rows * kBlockN);
    const at::BFloat16* rows_of_x = a + p.row0 * x.stride(0);
    const int64_t panel = p.col0 - p.panel_offset();
    cpublas::brgemm(p.num_rows, p.width, k, x.stride(0), kBlockN, kBlockN, false, rows_of_x,
                    b + panel * k + 2 * p.panel_offset(), gate.data());
    cpublas::brgemm(p.num_rows, p.width, k, x.stride(0), kBlockN, kBlockN, false, rows_of_x,
                    b + (width + panel) * k + 2 * p.panel_offset(), up.data());
    store_silu_block(c + p.row0 * width + p.col0, width, gate.data(), up.data(), bias_data ? bias_data + p.col0 : nullptr,
                     bias_data ? bias_data + width + p.col0 : nullptr, p.num_rows, p.width);
  });
}

bool brgemm_bf16_supported() { return cpublas::could_pack(at::kBFloat16); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("pack_brgemm_weight(Tensor weight) -> Tensor");
  m.def("brgemm_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias=None) -> ()");
  m.def("brgemm_gate_up_silu(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias=None) -> ()");
  m.def("brgemm_bf16_supported() -> bool", &brgemm_bf16_supported);
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) {
  m.impl("pack_brgemm_weight", &pack_brgemm_weight);
  m.impl("brgemm_linear", &brgemm_linear);
  m.impl("brgemm_gate_up_silu", &brgemm_gate_up_silu);
}
