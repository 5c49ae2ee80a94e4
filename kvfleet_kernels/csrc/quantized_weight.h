// What the two linears on quantized weights share (csrc/quantized_linear_cpu.cpp: integer dot
// products; csrc/quantized_linear_amx.cpp: AMX tiles over panels dequantized to bf16): the packed
// layout's constants, its reads and its checks. The layout: csrc/quantized_linear_cpu.cpp's header.
#pragma once

#include <ATen/core/Tensor.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvfleet_cpu::quantized {

using u8x64 = uint8_t __attribute__((vector_size(64)));
using i32x16 = int32_t __attribute__((vector_size(64)));

constexpr int64_t kColumns = 16;  // output columns a panel

using u8x16 = uint8_t __attribute__((vector_size(16)));

// 16 fp16 scales widened (vcvtph2ps: cpu_vec.h).
inline vfloat load_scales(const at::Half* p) { return kvfleet_cpu::load16(p); }

// 16 codes as fp32 (zero-extended, then converted: two instructions, not g++'s 16 scalar ones).
inline vfloat codes_to_float(u8x16 codes) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)codes));
#elif defined(__AVX2__)
  const __m256 halves[2] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32((__m128i)codes)),
                            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128((__m128i)codes, 8)))};
  vfloat v;
  std::memcpy(&v, halves, sizeof v);
  return v;
#else
  return __builtin_convertvector(codes, vfloat);
#endif
}

inline u8x64 load_u8x64(const uint8_t* p) {
  u8x64 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Step q (0-3) of a 6-bit block of 4 steps (192 bytes: csrc/quantized_linear_cpu.cpp's header):
// its low nibbles, from the pair vector that holds them, with its top 2 bits from the shared plane.
inline u8x64 six_bit_step(const uint8_t* block, int64_t q) {
  const u8x64 nibbles = load_u8x64(block + q / 2 * 64), top = load_u8x64(block + 128);
  return ((q % 2 ? nibbles >> 4 : nibbles) & 0x0F) | (((top >> (2 * q)) & 3) << 4);
}

// The weight vectors of `steps` steps from step s0 of a panel: 8 bits one load each, 4 bits one
// load a pair, split into its low and high nibbles; 6 bits (s0 and STEPS multiples of 4) a block of
// 4 steps, each step's low nibbles as 4 bits hold them and their top 2 bits from a shared plane.
template <int BITS, int STEPS>
inline void load_steps(const uint8_t* panel, int64_t s0, u8x64 (&w)[STEPS]) {
  if constexpr (BITS == 8) {
    for (int s = 0; s < STEPS; ++s) w[s] = load_u8x64(panel + (s0 + s) * 64);
  } else if constexpr (BITS == 6) {
    static_assert(STEPS % 4 == 0);
    for (int s = 0; s < STEPS; ++s) w[s] = six_bit_step(panel + (s0 + s) / 4 * 192, s % 4);
  } else {
    for (int s = 0; s < STEPS; s += 2) {
      const u8x64 both = load_u8x64(panel + (s0 + s) * 32);
      w[s] = both & 0x0F;
      w[s + 1] = (both >> 4) & 0x0F;
    }
  }
}

// Lanes 4i..4i+3 of a scale vector, each repeated 4 times: the scales of vector i of a step's codes.
inline vfloat spread(vfloat v, int i) {
  switch (i) {
    case 0: return __builtin_shufflevector(v, v, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    case 1: return __builtin_shufflevector(v, v, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7);
    case 2: return __builtin_shufflevector(v, v, 8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11);
    default: return __builtin_shufflevector(v, v, 12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15);
  }
}

// The packed layout's own limits: 4, 6 or 8 bits, K a multiple of 32 and of G, G 16 or a multiple of 32.
inline void check_layout(int64_t bits, int64_t group, int64_t k) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "bits must be 4, 6 or 8");
  TORCH_CHECK(k % 32 == 0 && (group == 16 || (group % 32 == 0 && group > 0)) && k % group == 0,
              "K must be a multiple of 32 and of the group size (16, or a multiple of 32)");
}

// How many fp16 vectors of 16 a group's scales take: A and B, or A alone where every B is
// zero_point * A (symmetric formats: GGUF's Q4_0, Q5_0, Q8_0 and Q6_K, GPTQ's sym), B then implied.
inline int64_t scale_planes(int64_t zero_point) { return zero_point >= 0 ? 1 : 2; }

inline void check_weight(const at::Tensor& packed, const at::Tensor& scales, int64_t bits, int64_t group, int64_t n, int64_t k,
                         int64_t zero_point) {
  const int64_t panels = (n + kColumns - 1) / kColumns;
  check_layout(bits, group, k);
  TORCH_CHECK(zero_point < (int64_t{1} << bits), "zero_point must be a code (below 2^bits), or -1 for stored offsets");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == panels * k * kColumns * bits / 8,
              "packed must come from pack_quantized_weight for N, K and bits");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.numel() == panels * (k / group) * scale_planes(zero_point) * kColumns,
              "scales must come from pack_quantized_weight for N, K, the group size and zero_point");
}

// A group's A and B of a panel's 16 columns, from its scales (B implied where zero_point >= 0: fp16 A
// times a power of two is the fp16 B pack_quantized_weight checked it equals).
inline void load_group(const at::Half* g, int64_t zero_point, vfloat& a, vfloat& b) {
  a = load_scales(g);
  b = zero_point >= 0 ? a * static_cast<float>(zero_point) : load_scales(g + kColumns);
}

// The integer path's arguments (csrc/quantized_linear_cpu.cpp, csrc/quantized_linear_avx2.h): x as
// quantize_activations left it, one part's packed weight, and where its columns go.
struct QuantArgs {
  const int8_t* xq;  // [rows, 2, K]: the high digits of each row's int16s, then the low ones
  const float* xmeta;  // [rows, K / 8]: s per 32 | s * sum(xq) per 32 | s * sum(xq) per 16
  const uint8_t* packed;  // [panels, K * 16 * bits / 8]
  const at::Half* scales;  // [panels, K / G, 2, 16]
  const float* bias;  // [N] or nullptr
  void* out;  // [rows, N] bf16 or fp32, row stride out_stride
  bool out_bf16;
  int64_t rows, k, n, group, out_stride;
  int64_t zero_point;  // B = zero_point * A, or -1: B stored
};

// Where an integer panel pass reads: one panel's codes and per-group scales, and where xmeta's
// s * sum(xq) of its units of UNIT features start (csrc/quantized_linear_cpu.cpp's generic pass and
// csrc/quantized_linear_avx2.h's).
template <int BITS, int UNIT>
struct PanelReads {
  int64_t planes, meta, units_per_group, sums;
  const uint8_t* weights;
  const at::Half* scales;
  PanelReads(const QuantArgs& a, int64_t panel)
      : planes(scale_planes(a.zero_point)),
        meta(a.k / 8),
        units_per_group(a.group / UNIT),
        sums(UNIT == 32 ? a.k / 32 : 2 * (a.k / 32)),
        weights(a.packed + panel * a.k * kColumns * BITS / 8),
        scales(a.scales + panel * (a.k / a.group) * planes * kColumns) {}
  const at::Half* group_scales(int64_t g) const { return scales + g * planes * kColumns; }
};

// out [rows, N] of a linear (bf16 or fp32 on the CPU, rows dense) and its fp32 bias of N or none.
inline void check_output(const at::Tensor& out, int64_t rows, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.stride(1) == 1 && out.device().is_cpu() &&
                  (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat),
              "out must be [M, N] bf16 or fp32 on the CPU, rows dense");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out.size(1)),
              "bias must be [N] fp32");
}

// A merged projection's parts side by side in out (csrc/quantized_linear_cpu.cpp and
// csrc/quantized_linear_amx.cpp): one packed, scales, bits, group, zero_point and out_features a part,
// each part's weight as check_weight wants it for K features, and out [rows, sum N_p] with its bias.
inline void check_parts(at::TensorList packed, at::TensorList scales, at::IntArrayRef bits, at::IntArrayRef group,
                        at::IntArrayRef zero_point, at::IntArrayRef out_features, int64_t k, const at::Tensor& out,
                        int64_t rows, const std::optional<at::Tensor>& bias) {
  const int64_t count = static_cast<int64_t>(packed.size());
  TORCH_CHECK(count > 0 && static_cast<int64_t>(scales.size()) == count && static_cast<int64_t>(bits.size()) == count &&
                  static_cast<int64_t>(group.size()) == count && static_cast<int64_t>(zero_point.size()) == count &&
                  static_cast<int64_t>(out_features.size()) == count, "one packed, scales, bits, group, zero_point "
              "and out_features a part");
  int64_t total = 0;
  for (int64_t n : out_features) {
    TORCH_CHECK(n > 0, "out_features must be positive");
    total += n;
  }
  TORCH_CHECK(out.dim() == 2 && out.size(1) == total, "out must have the parts' ", total, " columns");
  check_output(out, rows, bias);
  for (int64_t p = 0; p < count; ++p) check_weight(packed[p], scales[p], bits[p], group[p], out_features[p], k, zero_point[p]);
}

// The panels of parts side by side: part p's are [first[p], first[p + 1]) of them all.
struct PartPanels {
  std::vector<int64_t> first{0};
  void add(int64_t n) { first.push_back(first.back() + (n + kColumns - 1) / kColumns); }
  int64_t total() const { return first.back(); }
  int64_t part_of(int64_t panel) const {
    return std::upper_bound(first.begin() + 1, first.end(), panel) - first.begin() - 1;
  }
};

// cols sums of one row (+ bias from column col0) into out at element `at` (bf16, rounded once, or fp32).
inline void store_columns(void* out, bool out_bf16, int64_t at, const float* sums, int64_t col0, int64_t cols,
                          const float* bias) {
  for (int64_t c = 0; c < cols; ++c) {
    const float value = sums[c] + (bias ? bias[col0 + c] : 0.0f);
    if (out_bf16) static_cast<at::BFloat16*>(out)[at + c] = value;
    else static_cast<float*>(out)[at + c] = value;
  }
}

// A panel's 16 sums of row `row` into an integer pass's out (its columns past N left out).
inline void store_panel_row(const QuantArgs& a, int64_t row, int64_t panel, const float* sums) {
  const int64_t col0 = panel * kColumns, cols = std::min<int64_t>(kColumns, a.n - col0);
  store_columns(a.out, a.out_bf16, row * a.out_stride + col0, sums, col0, cols, a.bias);
}

}  // namespace kvfleet_cpu::quantized
