// Linear layers computed on quantized weights, never dequantized as a whole: GGUF's Q4_0 ... Q8_0
// and K-quants (kvfleet_kernels/cpu_quantized_linear.py). Every such format is, per output column c
// and group g of G input features, w = A[c, g] * u - B[c, g] with an unsigned code u of 4 or 8 bits
// (engine/quantized_weights.py writes each format so). Activations are quantized per 32 features
// to int16 q (scale s; quantize_activations, csrc/quantized_weight_cpu.cpp), and
//
//   y[r, c] = sum_g sum_{k in g} (A u - B) x  ~=  sum_units  A s (u . q)  -  B s (sum q)
//
// where (u . q) = 256 (u . h) + (u . l), q's two int8 digits each an integer dot product of
// 4-byte pairs (avx512_vnni's vpdpbusd, u8 x s8 into int32; elsewhere a plain loop g++
// vectorises), scaled in fp32 once per unit of 32 features (16 for G = 16: Q6_K). A decode step
// reads 4 or 8 bits a weight plus 2 fp16 a group.
//
// Why int16 activations and not llama.cpp's int8 (one dot product a step, not two): SmolLM2-135M's
// Q4_1 file, its activations rounded to int8 per 32 (s = max|x| / 127), answered "What is the
// capital of France?" with "L'Étoile, la Marseillaise, ..." where its dequantized weights answer
// "The capital of France is Paris."; int16's rounding sits below bf16's own. Why two int8 digits
// and not vpdpwssd on words: the codes then stay bytes, with no widening to words (a shuffle-port
// op a vector) and no pairs of columns to add at the end: 1.15 against 2.2 ms for a 1B model's four
// linears at one row, on a 2-core Xeon.
//
// Packed weight, per panel of 16 output columns (kColumns), K/4 steps of 4 features:
//   8 bits: step s is 64 bytes, byte (c, t) = u[c, 4s + t];
//   4 bits: steps 2j and 2j+1 share 64 bytes, byte (c, t) = u[c, 8j + t] | u[c, 8j + 4 + t] << 4.
//   6 bits (codes < 64: GGUF's Q6_K and Q5 types): steps 4j .. 4j+3 share 192 bytes, their low
//   nibbles as 4 bits lays out steps 4j, 4j+1 and then 4j+2, 4j+3 (128 bytes), then 64 bytes of
//   their top 2 bits, byte (c, t) = sum_q (u[c, 16j + 4q + t] >> 4) << 2q.
// Scales: fp16 [panels, K / G, 2, 16], A then B of the panel's columns (zeros past N); [panels, K / G,
// 1, 16], A alone, where every B is zero_point * A (symmetric formats: B implied, a group's bytes halved).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "quantized_linear_avx2.h"
#include "quantized_weight.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX512VNNI__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__)
#define KVFLEET_NATIVE_DOT true
#else
#define KVFLEET_NATIVE_DOT false
#endif

namespace {

using kvfleet_cpu::vfloat;
using namespace kvfleet_cpu::quantized;  // NOLINT: the packed layout's names

constexpr int64_t kBlockRows = 64;  // rows an item: a panel read from cache by each further pass

bool native_dot() { return KVFLEET_NATIVE_DOT; }

inline vfloat to_float(i32x16 v) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_cvtepi32_ps((__m512i)v);
#else
  return __builtin_convertvector(v, vfloat);
#endif
}

// acc[c] += sum_t w[4c + t] * x4[t]: 16 columns' products of 4 features, u8 x s8 into int32.
inline i32x16 dot4(i32x16 acc, u8x64 w, int32_t x4) {
#if defined(__AVX512VNNI__)
  return (i32x16)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(x4));
#else
  int8_t x[4];
  std::memcpy(x, &x4, sizeof x);
  for (int c = 0; c < 16; ++c) acc[c] += w[4 * c] * x[0] + w[4 * c + 1] * x[1] + w[4 * c + 2] * x[2] + w[4 * c + 3] * x[3];
  return acc;
#endif
}

#if KVFLEET_NATIVE_DOT || !defined(__AVX2__)
// Rows sharing each unpacked weight vector (3 accumulators each).
constexpr int kMaxRows = 6;

// dot[r] = the 16 columns' integer products of unit u (UNIT features) with row row0 + r's
// activations: two dot products of bytes, one a digit, joined as 256 high + low.
template <int BITS, int UNIT, int R>
inline void unit_dots(const QuantArgs& a, int64_t row0, const uint8_t* weights, int64_t u, i32x16 (&dot)[R]) {
  constexpr int kSteps = UNIT / 4;
  // Independent sums a row and digit: a dot product's latency is several of its issue slots, and
  // one chain a unit leaves a single row waiting on it.
  constexpr int kChains = R >= 3 ? 1 : 4 / R;
  u8x64 w[kSteps];
  load_steps<BITS, kSteps>(weights, u * kSteps, w);
  i32x16 high[R][kChains] = {}, low[R][kChains] = {};
  for (int s = 0; s < kSteps; ++s) {
    for (int r = 0; r < R; ++r) {
      const int8_t* x = a.xq + (row0 + r) * 2 * a.k + u * UNIT + 4 * s;
      int32_t x_high, x_low;
      std::memcpy(&x_high, x, sizeof x_high), std::memcpy(&x_low, x + a.k, sizeof x_low);
      high[r][s % kChains] = dot4(high[r][s % kChains], w[s], x_high);
      low[r][s % kChains] = dot4(low[r][s % kChains], w[s], x_low);
    }
  }
  for (int r = 0; r < R; ++r) {
    dot[r] = (high[r][0] << 8) + low[r][0];
    for (int chain = 1; chain < kChains; ++chain) dot[r] += (high[r][chain] << 8) + low[r][chain];
  }
}
#else
using avx2::kMaxRows;
using avx2::panel_pass;
#endif

#if KVFLEET_NATIVE_DOT || !defined(__AVX2__)

// Output columns of one panel for R rows from row0: units of UNIT features (32, or 16 for
// groups of 16), each unit's integer dot products scaled once into the fp32 sums.
template <int BITS, int UNIT, int R>
void panel_pass(const QuantArgs& a, int64_t row0, int64_t panel) {
  const PanelReads<BITS, UNIT> reads(a, panel);
  vfloat acc[R] = {};
  vfloat scale_a{}, scale_b{};
  for (int64_t g = 0, u = 0; g < a.k / a.group; ++g) {
    load_group(reads.group_scales(g), a.zero_point, scale_a, scale_b);
    for (const int64_t end = u + reads.units_per_group; u < end; ++u) {
      i32x16 dot[R];
      unit_dots<BITS, UNIT, R>(a, row0, reads.weights, u, dot);
      for (int r = 0; r < R; ++r) {
        const float* xm = a.xmeta + (row0 + r) * reads.meta;
        const float s = xm[u * UNIT / 32], c = xm[reads.sums + u];
        acc[r] += to_float(dot[r]) * (scale_a * s) - scale_b * c;
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float row[kColumns];
    kvfleet_cpu::store16(row, acc[r]);
    store_panel_row(a, row0 + r, panel, row);
  }
}
#endif

// One pass of `rows` (1 .. R) rows against a panel, with the instance for that count.
template <int BITS, int UNIT, int R = kMaxRows>
void pass_of(const QuantArgs& a, int64_t row0, int64_t rows, int64_t panel) {
  if constexpr (R > 1) {
    if (rows < R) return pass_of<BITS, UNIT, R - 1>(a, row0, rows, panel);
  }
  panel_pass<BITS, UNIT, R>(a, row0, panel);
}

// Rows [row0, row0 + count) against one panel, in passes of as even a size as may be.
template <int BITS, int UNIT>
void panel_rows(const QuantArgs& a, int64_t row0, int64_t count, int64_t panel) {
  const int64_t passes = (count + kMaxRows - 1) / kMaxRows;
  for (int64_t pass = 0; pass < passes; ++pass) {
    const int64_t begin = count * pass / passes;
    pass_of<BITS, UNIT>(a, row0 + begin, count * (pass + 1) / passes - begin, panel);
  }
}

// Rows of one part against one of its panels: panel_rows for the part's bits and unit.
using PartRows = void (*)(const QuantArgs&, int64_t, int64_t, int64_t);

PartRows part_rows(int64_t bits, int64_t group) {
  if (bits == 4) return group == 16 ? &panel_rows<4, 16> : &panel_rows<4, 32>;
  if (bits == 6) return group == 16 ? &panel_rows<6, 16> : &panel_rows<6, 32>;
  return group == 16 ? &panel_rows<8, 16> : &panel_rows<8, 32>;
}

// Every part's panels (their columns side by side in the output) for every block of rows, in one
// parallel region: a merged projection's q, k and v, or gate and up, are one call, not three or
// two, each with its own fork and join over panels too few to share out well (SmolLM2's k: 12).
void run_parts(const std::vector<QuantArgs>& parts, const std::vector<PartRows>& rows_of) {
  PartPanels panels_of;
  for (const QuantArgs& a : parts) panels_of.add(a.n);
  const int64_t panels = panels_of.total(), rows = parts.front().rows;
  const int64_t row_blocks = (rows + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, row_blocks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row0 = item / panels * kBlockRows, panel = item % panels;
      const int64_t part = panels_of.part_of(panel);
      rows_of[part](parts[part], row0, std::min(kBlockRows, rows - row0), panel - panels_of.first[part]);
    }
  });
}

// out [M, sum N_p] (bf16 or fp32, rows dense) = x @ [W_0; W_1; ...]^T + bias: parts' columns side
// by side, x given as quantize_activations left it and each W_p as pack_quantized_weight packed it
// (bits, group, zero_point and N_p its own); an fp32 bias of sum N_p or none.
void quantized_linear_parts(const at::Tensor& out, const at::Tensor& xq, const at::Tensor& xmeta,
                            at::TensorList packed, at::TensorList scales, at::IntArrayRef bits, at::IntArrayRef group,
                            at::IntArrayRef zero_point, at::IntArrayRef out_features,
                            const std::optional<at::Tensor>& bias) {
  const int64_t count = static_cast<int64_t>(packed.size()), k = xq.size(1) / 2;
  TORCH_CHECK(xq.scalar_type() == at::kChar && xq.is_contiguous() && xmeta.scalar_type() == at::kFloat &&
                  xmeta.is_contiguous() && xmeta.size(0) == xq.size(0) && xmeta.size(1) == k / 8,
              "xq and xmeta must come from quantize_activations");
  check_parts(packed, scales, bits, group, zero_point, out_features, k, out, xq.size(0), bias);
  const bool out_bf16 = out.scalar_type() == at::kBFloat16;
  std::vector<QuantArgs> parts;
  std::vector<PartRows> rows_of;
  int64_t start = 0;
  for (int64_t p = 0; p < count; ++p) {
    void* part_out = static_cast<char*>(out.data_ptr()) + start * out.element_size();
    parts.push_back({xq.const_data_ptr<int8_t>(), xmeta.const_data_ptr<float>(), packed[p].const_data_ptr<uint8_t>(),
                     scales[p].const_data_ptr<at::Half>(), bias ? bias->const_data_ptr<float>() + start : nullptr,
                     part_out, out_bf16, xq.size(0), k, out_features[p], group[p], out.stride(0), zero_point[p]});
    rows_of.push_back(part_rows(bits[p], group[p]));
    start += out_features[p];
  }
  run_parts(parts, rows_of);
}

// Every group's parts in one parallel region, each group over rows of its own: an MoE layer's
// experts, each over the rows routed to it (decode: 8 experts of a few rows, 16 calls and their
// forks and joins before). Items (entry, block of rows, panel), entries group by group, so that a
// thread's share is a run of whole panels of few experts.
void run_groups(const std::vector<QuantArgs>& entries, const std::vector<PartRows>& rows_of) {
  struct Item {
    int64_t entry, row0, panel;
  };
  std::vector<Item> items;
  for (int64_t e = 0; e < static_cast<int64_t>(entries.size()); ++e) {
    const int64_t panels = (entries[e].n + kColumns - 1) / kColumns;
    for (int64_t row0 = 0; row0 < entries[e].rows; row0 += kBlockRows)
      for (int64_t panel = 0; panel < panels; ++panel) items.push_back({e, row0, panel});
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Item& item = items[i];
      const QuantArgs& a = entries[item.entry];
      rows_of[item.entry](a, item.row0, std::min(kBlockRows, a.rows - item.row0), item.panel);
    }
  });
}

// out [M, N] (bf16 or fp32, rows dense): rows [row_offsets[g], row_offsets[g + 1]) of x times group
// g's weight, whose P parts (packed and the rest listed group by group, P = len(packed) / G) lie
// side by side in N; x as quantize_activations left it. An MoE layer's experts in one call.
void quantized_linear_grouped(const at::Tensor& out, const at::Tensor& xq, const at::Tensor& xmeta,
                              at::IntArrayRef row_offsets, at::TensorList packed, at::TensorList scales,
                              at::IntArrayRef bits, at::IntArrayRef group, at::IntArrayRef zero_point,
                              at::IntArrayRef out_features) {
  const int64_t groups = static_cast<int64_t>(row_offsets.size()) - 1, k = xq.size(1) / 2, rows = xq.size(0);
  TORCH_CHECK(xq.scalar_type() == at::kChar && xq.is_contiguous() && xmeta.scalar_type() == at::kFloat &&
                  xmeta.is_contiguous() && xmeta.size(0) == rows && xmeta.size(1) == k / 8,
              "xq and xmeta must come from quantize_activations");
  TORCH_CHECK(groups > 0 && row_offsets.front() == 0 && row_offsets.back() == rows,
              "row_offsets must run from 0 to x's ", rows, " rows");
  const int64_t count = static_cast<int64_t>(packed.size()), per_group = count / groups;
  TORCH_CHECK(per_group > 0 && per_group * groups == count, "as many parts for every group");
  check_output(out, rows, std::nullopt);
  const bool out_bf16 = out.scalar_type() == at::kBFloat16;
  std::vector<QuantArgs> entries;
  std::vector<PartRows> rows_of;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t row0 = row_offsets[g], group_rows = row_offsets[g + 1] - row0;
    TORCH_CHECK(group_rows >= 0, "row_offsets must not decrease");
    int64_t start = 0;
    for (int64_t p = g * per_group; p < (g + 1) * per_group; ++p) {
      check_weight(packed[p], scales[p], bits[p], group[p], out_features[p], k, zero_point[p]);
      void* part_out = static_cast<char*>(out.data_ptr()) + (row0 * out.stride(0) + start) * out.element_size();
      if (group_rows > 0) {
        entries.push_back({xq.const_data_ptr<int8_t>() + row0 * 2 * k, xmeta.const_data_ptr<float>() + row0 * (k / 8),
                           packed[p].const_data_ptr<uint8_t>(), scales[p].const_data_ptr<at::Half>(), nullptr,
                           part_out, out_bf16, group_rows, k, out_features[p], group[p], out.stride(0),
                           zero_point[p]});
        rows_of.push_back(part_rows(bits[p], group[p]));
      }
      start += out_features[p];
    }
    TORCH_CHECK(start == out.size(1), "group ", g, "'s parts have ", start, " columns, out ", out.size(1));
  }
  run_groups(entries, rows_of);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("quantized_linear_grouped(Tensor(a!) out, Tensor xq, Tensor xmeta, int[] row_offsets, Tensor[] packed, "
        "Tensor[] scales, int[] bits, int[] group, int[] zero_point, int[] out_features) -> ()");
  m.def("quantized_linear_parts(Tensor(a!) out, Tensor xq, Tensor xmeta, Tensor[] packed, Tensor[] scales, int[] bits, "
        "int[] group, int[] zero_point, int[] out_features, Tensor? bias=None) -> ()");
  m.def("quantized_dot_native() -> bool", &native_dot);
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) {
  m.impl("quantized_linear_parts", &quantized_linear_parts);
  m.impl("quantized_linear_grouped", &quantized_linear_grouped);
}
