// What the two packed bf16 linears (csrc/brgemm_linear_cpu.cpp, csrc/vnni_linear_cpu.cpp) share:
// the weight's outer layout, [ceil(N / 64), K * 64] (64 output columns a panel, each kernel with
// its own order inside), and the checks of a call's tensors against it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace kvfleet_cpu {

constexpr int64_t kPackedColumns = 64;  // output columns per panel of a packed weight

// x [M, K] and a weight packed by `pack_op` for it: bf16 rows read in place, on the CPU.
inline void check_packed_input(const at::Tensor& x, const at::Tensor& packed, const char* pack_op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x must be [M, K] bf16, rows dense");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(1) == x.size(1) * kPackedColumns, "packed must come from ", pack_op, " for x's K");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "CPU tensors only");
}

// out [M, N] = x [M, K] @ weight^T + bias, the weight packed by `pack_op`: bf16 rows read in
// place, out N within the packed weight's last panel, an fp32 bias of N or none.
inline void check_packed_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                                const std::optional<at::Tensor>& bias, const char* pack_op) {
  check_packed_input(x, packed, pack_op);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kBFloat16 && out.stride(1) == 1 && out.size(0) == x.size(0) &&
                  out.size(1) <= packed.size(0) * kPackedColumns && out.size(1) > (packed.size(0) - 1) * kPackedColumns &&
                  out.device().is_cpu(), "out must be [M, N] bf16 on the CPU, rows dense, N the packed weight's");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out.size(1)),
              "bias must be [N] fp32");
}

// out [M, I] = SiLU(gate) * up for [gate, up] = x [M, K] @ weight^T + bias, the weight [2I, K]
// packed by `pack_op`: I a multiple of the panel width, so gate panel c pairs with up panel
// c + I / 64; an fp32 bias of 2I or none.
inline void check_gate_up_silu(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                               const std::optional<at::Tensor>& bias, const char* pack_op) {
  check_packed_input(x, packed, pack_op);
  const int64_t width = out.size(1);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.size(0) == x.size(0) &&
                  width % kPackedColumns == 0 && packed.size(0) == 2 * (width / kPackedColumns) && out.device().is_cpu(),
              "out must be [M, I] bf16 on the CPU, I a multiple of 64 and half the packed weight's N");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == 2 * width),
              "bias must be [2 * I] fp32");
}

}  // namespace kvfleet_cpu
