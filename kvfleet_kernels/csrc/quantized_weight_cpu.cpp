// The packed form of a quantized weight (layout: csrc/quantized_linear_cpu.cpp's header): packing
// codes and scales into it once at load, and dequantizing it whole, for steps of many rows, where a
// dense matmul outruns the integer dot products (kvfleet_kernels/cpu_quantized_linear.py); and the
// activations' side of those products, rounded to int16 digits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "quantized_weight.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

using kvfleet_cpu::vfloat;
using namespace kvfleet_cpu::quantized;  // NOLINT: the packed layout's names

// codes uint8 [N, K] (each < 2^bits: 4, 6 or 8), a and b fp16 [N, K / G] -> (packed, scales), the layout
// csrc/quantized_linear_cpu.cpp's header draws.
std::tuple<at::Tensor, at::Tensor> pack_quantized_weight(const at::Tensor& codes, const at::Tensor& a, const at::Tensor& b,
                                                         int64_t bits, int64_t zero_point) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.device().is_cpu(), "codes must be [N, K] uint8");
  TORCH_CHECK(a.dim() == 2 && a.sizes() == b.sizes() && a.size(0) == codes.size(0) && a.scalar_type() == at::kHalf &&
                  b.scalar_type() == at::kHalf && a.size(1) > 0 && codes.size(1) % a.size(1) == 0,
              "a and b must be [N, K / G] fp16");
  const int64_t n = codes.size(0), k = codes.size(1), groups = a.size(1), panels = (n + kColumns - 1) / kColumns;
  check_layout(bits, k / groups, k);
  TORCH_CHECK(codes.numel() == 0 || codes.max().item<uint8_t>() < (1 << bits), "codes must be below 2^bits");
  TORCH_CHECK(zero_point < (int64_t{1} << bits), "zero_point must be a code (below 2^bits), or -1 for stored offsets");
  TORCH_CHECK(zero_point < 0 || at::equal(b.to(at::kFloat), a.to(at::kFloat).mul(static_cast<double>(zero_point))),
              "b must be zero_point * a exactly where zero_point is given");
  at::Tensor padded = at::zeros({panels * kColumns, k}, codes.options());
  padded.narrow(0, 0, n).copy_(codes);
  // [panels, 16, K/4, 4] -> [panels, K/4, 16, 4]: step s of a panel is 64 contiguous bytes
  at::Tensor steps = padded.view({panels, kColumns, k / 4, 4}).permute({0, 2, 1, 3}).contiguous();
  at::Tensor packed = steps;
  if (bits == 4) {  // steps 2j (low nibble) and 2j + 1 (high nibble) into one 64-byte vector
    at::Tensor pairs = steps.view({panels, k / 8, 2, kColumns * 4});
    packed = pairs.select(2, 0).bitwise_or(pairs.select(2, 1).bitwise_left_shift(4)).contiguous();
  } else if (bits == 6) {  // blocks of 4 steps: two vectors of nibble pairs, then the top 2 bits' plane
    at::Tensor blocks = steps.view({panels, k / 16, 4, kColumns * 4});
    at::Tensor low = blocks.bitwise_and(0x0F), top = blocks.bitwise_right_shift(4);
    at::Tensor plane = top.select(2, 0);
    for (int64_t q = 1; q < 4; ++q) plane = plane.bitwise_or(top.select(2, q).bitwise_left_shift(2 * q));
    packed = at::cat({low.select(2, 0).bitwise_or(low.select(2, 1).bitwise_left_shift(4)),
                      low.select(2, 2).bitwise_or(low.select(2, 3).bitwise_left_shift(4)), plane}, 2).contiguous();
  }
  const int64_t planes = scale_planes(zero_point);
  at::Tensor ab = at::zeros({panels * kColumns, groups, planes}, a.options());
  ab.narrow(0, 0, n).select(2, 0).copy_(a);
  if (planes == 2) ab.narrow(0, 0, n).select(2, 1).copy_(b);
  // [panels, 16, groups, planes] -> [panels, groups, planes, 16]
  at::Tensor scales = ab.view({panels, kColumns, groups, planes}).permute({0, 2, 3, 1}).contiguous();
  return {packed.view({-1}), scales.view({-1})};
}

// One step's 64 codes (16 columns x 4 features) dequantized into row[c][f .. f + 4), with the
// group's A and B of the 16 columns.
inline void store_step(float (&row)[kColumns][64], int64_t f, u8x64 codes, vfloat a, vfloat b) {
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    u8x16 part;
    std::memcpy(&part, reinterpret_cast<const uint8_t*>(&codes) + 16 * i, sizeof part);
    const vfloat values = spread(a, i) * codes_to_float(part) - spread(b, i);
    for (int j = 0; j < 4; ++j) std::memcpy(&row[4 * i + j][f], reinterpret_cast<const float*>(&values) + 4 * j, 16);
  }
}

// The whole weight dequantized into out [N, K] (bf16 or fp32): for steps of many rows, where a
// dense matmul (oneDNN's, on AMX or avx512_bf16) outruns the integer dot products by more than the
// dequantization costs. Each thread writes whole panels; the codes are read once, in order.
void dequantize_quantized_weight(const at::Tensor& out, const at::Tensor& packed, const at::Tensor& scales, int64_t bits,
                                 int64_t group, int64_t zero_point) {
  const int64_t n = out.size(0), k = out.size(1), panels = (n + kColumns - 1) / kColumns, groups = k / group;
  const int64_t planes = scale_planes(zero_point);
  check_weight(packed, scales, bits, group, n, k, zero_point);
  const at::ScalarType dtype = out.scalar_type();
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && (dtype == at::kBFloat16 || dtype == at::kFloat),
              "out must be [N, K] bf16 or fp32, contiguous");
  at::BFloat16* out_bf16 = dtype == at::kBFloat16 ? out.data_ptr<at::BFloat16>() : nullptr;
  float* out_float = dtype == at::kFloat ? out.data_ptr<float>() : nullptr;
  const uint8_t* w = packed.const_data_ptr<uint8_t>();
  const at::Half* ab = scales.const_data_ptr<at::Half>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    float row[kColumns][64];  // one unit of 64 features of the panel's columns
    for (int64_t panel = begin; panel < end; ++panel) {
      const uint8_t* pw = w + panel * k * kColumns * bits / 8;
      const int64_t cols = std::min<int64_t>(kColumns, n - panel * kColumns);
      for (int64_t f0 = 0; f0 < k; f0 += 64) {
        const int64_t width = std::min<int64_t>(64, k - f0);
        for (int64_t s = f0 / 4; s < (f0 + width) / 4; s += 4) {  // 16 features: one group (16 or more)
          u8x64 codes[4];
          if (bits == 8) load_steps<8, 4>(pw, s, codes);
          else if (bits == 6) load_steps<6, 4>(pw, s, codes);
          else load_steps<4, 4>(pw, s, codes);
          vfloat scale_a, scale_b;
          load_group(ab + (panel * groups + s * 4 / group) * planes * kColumns, zero_point, scale_a, scale_b);
          for (int q = 0; q < 4; ++q) store_step(row, s * 4 + 4 * q - f0, codes[q], scale_a, scale_b);
        }
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t at = (panel * kColumns + c) * k + f0;
          if (out_bf16) {
            for (int64_t f = 0; f < width; f += 16) kvfleet_cpu::store16(out_bf16 + at + f, kvfleet_cpu::load16(&row[c][f]));
          } else {
            std::memcpy(out_float + at, row[c], width * sizeof(float));
          }
        }
      }
    }
  });
}

// 16 fp32 lanes rounded to the nearest integer, ties to even, as std::nearbyint does in the default
// rounding mode: cvtps2dq rounds so (g++'s own conversion truncates); elsewhere lane by lane.
inline i32x16 round_to_int(vfloat v) {
#if defined(__AVX512F__)
  return (i32x16)_mm512_cvtps_epi32((__m512)v);
#elif defined(__AVX2__)
  __m256 halves[2];
  std::memcpy(halves, &v, sizeof v);
  const __m256i rounded[2] = {_mm256_cvtps_epi32(halves[0]), _mm256_cvtps_epi32(halves[1])};
  i32x16 out;
  std::memcpy(&out, rounded, sizeof out);
  return out;
#else
  i32x16 out;
  for (int lane = 0; lane < kvfleet_cpu::kLanes; ++lane) out[lane] = static_cast<int32_t>(std::nearbyint(v[lane]));
  return out;
#endif
}

// 16 values' q = round(x / s) (|q| <= 32512) as their two digits h = floor((q + 128) / 256) and
// l = q - 256 h; returns sum(q).
inline int32_t store_digits(vfloat x, float inverse, int8_t* high, int8_t* low) {
  using i8x16 = int8_t __attribute__((vector_size(16)));
  const i32x16 value = round_to_int(x * inverse);
  const i32x16 h = (value + 128) >> 8;
  const i8x16 high_digits = __builtin_convertvector(h, i8x16), low_digits = __builtin_convertvector(value - (h << 8), i8x16);
  std::memcpy(high, &high_digits, sizeof high_digits);
  std::memcpy(low, &low_digits, sizeof low_digits);
  int32_t sum = 0;
  for (int lane = 0; lane < kvfleet_cpu::kLanes; ++lane) sum += value[lane];
  return sum;
}

// One row of quantize_activations: blocks of 32 features, 16 lanes at a time.
template <typename scalar_t>
void quantize_row(const scalar_t* x, int64_t k, int8_t* q, float* meta) {
  const int64_t blocks = k / 32;
  for (int64_t b = 0; b < blocks; ++b) {
    const vfloat first = kvfleet_cpu::load16(x + 32 * b), second = kvfleet_cpu::load16(x + 32 * b + 16);
    const vfloat magnitude_first = first < 0 ? -first : first, magnitude_second = second < 0 ? -second : second;
    const float amax = kvfleet_cpu::reduce_max(magnitude_first > magnitude_second ? magnitude_first : magnitude_second);
    const float s = amax / 32512.0f, inverse = amax > 0.0f ? 32512.0f / amax : 0.0f;
    const int32_t sums[2] = {store_digits(first, inverse, q + 32 * b, q + k + 32 * b),
                             store_digits(second, inverse, q + 32 * b + 16, q + k + 32 * b + 16)};
    meta[b] = s;
    meta[blocks + b] = s * static_cast<float>(sums[0] + sums[1]);
    meta[2 * blocks + 2 * b] = s * static_cast<float>(sums[0]);
    meta[2 * blocks + 2 * b + 1] = s * static_cast<float>(sums[1]);
  }
}

// x [M, K] bf16 or fp32 (K a multiple of 32), rows dense -> (xq int8 [M, 2K], xmeta fp32 [M, K / 8]):
// per 32 features s = max|x| / 32512 and q = round(x / s), an int16 written as two int8 digits,
// q = 256 h + l with h in [-127, 127] and l in [-128, 127] (xq row: every h, then every l): vpdpbusd
// then multiplies the unsigned codes by each digit. xmeta holds s per 32, then s * sum(q) per 32,
// then s * sum(q) per 16 (the units of groups of 16). One call a linear input: at a decode step's
// one row, 121 a SmolLM2 step, its scalar loop took 6-15 us each.
std::tuple<at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.size(1) % 32 == 0, "x must be [M, K] on the CPU, K a multiple of 32");
  const at::Tensor rows_dense = x.scalar_type() == at::kBFloat16 ? x : x.to(at::kFloat);
  const at::Tensor xs = rows_dense.stride(1) == 1 ? rows_dense : rows_dense.contiguous();
  const int64_t rows = xs.size(0), k = xs.size(1);
  at::Tensor xq = at::empty({rows, 2 * k}, x.options().dtype(at::kChar));
  at::Tensor xmeta = at::empty({rows, k / 8}, x.options().dtype(at::kFloat));
  int8_t* q = xq.data_ptr<int8_t>();
  float* meta = xmeta.data_ptr<float>();
  auto run = [&](const auto* data) {
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) quantize_row(data + r * xs.stride(0), k, q + r * 2 * k, meta + r * (k / 8));
    });
  };
  if (xs.scalar_type() == at::kBFloat16) run(xs.const_data_ptr<at::BFloat16>());
  else run(xs.const_data_ptr<float>());
  return {xq, xmeta};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor)");
  m.def("pack_quantized_weight(Tensor codes, Tensor a, Tensor b, int bits, int zero_point=-1) -> (Tensor, Tensor)");
  m.def("dequantize_quantized_weight(Tensor(a!) out, Tensor packed, Tensor scales, int bits, int group, "
        "int zero_point=-1) -> ()");
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) {
  m.impl("quantize_activations", &quantize_activations);
  m.impl("pack_quantized_weight", &pack_quantized_weight);
  m.impl("dequantize_quantized_weight", &dequantize_quantized_weight);
}
