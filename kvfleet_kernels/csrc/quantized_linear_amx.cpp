// The linear on quantized weights on AMX tiles (kvfleet_kernels/cpu_quantized_linear.py): each
// thread dequantizes one panel of 16 output columns at a time into bf16, in the VNNI pairs a B tile
// holds ([K / 2][16 columns][2], 32 * K bytes: in L2), and multiplies every row of x by it, 16 rows
// and 32 features a tile product, the sums in fp32 over the whole K. The weight is never whole in
// memory as bf16, and x stays bf16 (no activation rounding): the values are those of the weight
// dequantized to bf16, bit for bit (w = a * code - b rounded once to bf16, as a bf16 model
// dequantized at load holds it).
//
// Why beside the integer dot products (csrc/quantized_linear_cpu.cpp): those cost the same a row.
// A 1B model's four linears of a layer on a 2-core Xeon, Q4 weights: 0.8 ms at 1 row there, 4.8 at
// 16 and 19 at 64; here 3.6 at 1 to 16 rows (most of it the dequantization, bound by its
// conversions and permutes) and 6.0 at 64, since a tile product takes 16 rows for the price of one.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include "decode_amx.h"
#include "quantized_weight.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using kvfleet_cpu::vfloat;
using namespace kvfleet_cpu::quantized;  // NOLINT: the packed layout's names

constexpr int64_t kTileRows = 16;  // rows of x a tile product takes
constexpr int64_t kTileFeatures = 32;  // bf16 features a tile row holds

bool quantized_amx_available() {
#if defined(KVFLEET_DECODE_AMX) && defined(__AVX512BF16__)
  return kvfleet_cpu::amx_permitted();
#else
  return false;
#endif
}

// Declared on every host: quantized_linear_amx_parts builds them wherever it compiles.
struct AmxArgs {
  const at::BFloat16* x;  // [rows, K]
  const uint8_t* packed;
  const at::Half* scales;
  const float* bias;  // [N] or nullptr
  void* out;  // [rows, N], row stride out_stride
  bool out_bf16;
  int64_t rows, k, n, group, bits, out_stride;
  int64_t zero_point;  // B = zero_point * A, or -1: B stored
};

#if defined(KVFLEET_DECODE_AMX) && defined(__AVX512BF16__)
using u32x16 = uint32_t __attribute__((vector_size(64)));

// A group's scales spread over the lanes of a step's four code vectors (spread: 4 permutes each),
// once a group rather than once a step.
struct SpreadScales {
  vfloat a[4], b[4];
  void load(const at::Half* ab, int64_t zero_point) {
    vfloat a16, b16;
    load_group(ab, zero_point, a16, b16);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) a[i] = spread(a16, i), b[i] = spread(b16, i);
  }
};

// Step s's dequantized values, as 4 vectors of 16 (vector i: columns 4i .. 4i + 3, features t0 .. t3
// each), to bf16 into word rows 2s and 2s + 1 of the panel's VNNI buffer (16 columns of (feature 2p,
// 2p + 1) a row).
inline void store_step_pairs(uint32_t* pairs, int64_t s, const __m512 (&values)[4]) {
  // Two vectors to one of 32 bf16 (the second argument's lanes first), to nearest even as torch's
  // cast: columns 0-7 and 8-15, a column's (t0 t1) then (t2 t3) as words.
  const u32x16 low = (u32x16)_mm512_cvtne2ps_pbh(values[1], values[0]);
  const u32x16 high = (u32x16)_mm512_cvtne2ps_pbh(values[3], values[2]);
  const u32x16 even = __builtin_shufflevector(low, high, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const u32x16 odd = __builtin_shufflevector(low, high, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  std::memcpy(pairs + 2 * s * kColumns, &even, sizeof even);
  std::memcpy(pairs + (2 * s + 1) * kColumns, &odd, sizeof odd);
}

// One panel's weight as bf16 VNNI pairs, [K / 2][16] words. Codes are read 16 bytes at a time
// straight into the lanes they widen to: splitting a 64-byte vector into quarters cost a shuffle each.
template <int BITS>
void dequantize_panel(uint32_t* pairs, const uint8_t* panel, const at::Half* scales, int64_t k, int64_t group,
                      int64_t zero_point) {
  SpreadScales g;
  const int64_t planes = scale_planes(zero_point);
  for (int64_t s = 0; s < k / 4; s += 2) {  // K is a multiple of 32: steps come in pairs
    if (s * 4 % group == 0 || group == 16) g.load(scales + (s * 4 / group) * planes * kColumns, zero_point);  // a pair never spans two
    __m512 first[4], second[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      __m128i codes_first, codes_second;
      if constexpr (BITS == 8) {
        codes_first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + s * 64 + 16 * i));
        codes_second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + (s + 1) * 64 + 16 * i));
      } else if constexpr (BITS == 6) {  // steps s and s + 1 of a block of 4: their nibbles, then top 2 bits
        const uint8_t* block = panel + s / 4 * 192;
        const int q = s % 4;  // 0 or 2
        const __m128i nibbles = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + q / 2 * 64 + 16 * i));
        const __m128i top = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 128 + 16 * i));
        const __m128i mask = _mm_set1_epi8(0x0F), three = _mm_set1_epi8(3);
        const __m128i top_first = _mm_and_si128(_mm_srl_epi16(top, _mm_cvtsi32_si128(2 * q)), three);
        const __m128i top_second = _mm_and_si128(_mm_srl_epi16(top, _mm_cvtsi32_si128(2 * q + 2)), three);
        codes_first = _mm_or_si128(_mm_and_si128(nibbles, mask), _mm_slli_epi16(top_first, 4));
        codes_second = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(nibbles, 4), mask), _mm_slli_epi16(top_second, 4));
      } else {  // steps s and s + 1 share 64 bytes: low nibbles, then high
        const __m128i both = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + s * 32 + 16 * i));
        codes_first = _mm_and_si128(both, _mm_set1_epi8(0x0F));
        codes_second = _mm_and_si128(_mm_srli_epi16(both, 4), _mm_set1_epi8(0x0F));
      }
      first[i] = (__m512)(g.a[i] * (vfloat)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes_first)) - g.b[i]);
      second[i] = (__m512)(g.a[i] * (vfloat)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes_second)) - g.b[i]);
    }
    store_step_pairs(pairs, s, first);
    store_step_pairs(pairs, s + 1, second);
  }
}

// One C tile's sums (+ bias) into out's rows [row0, row0 + rows) and the panel's columns.
void store_sums(const AmxArgs& a, int tile, int64_t row0, int64_t rows, int64_t col0, int64_t cols) {
  float sums[kTileRows][kColumns];
  if (tile == KVFLEET_TILE_C0) _tile_stored(KVFLEET_TILE_C0, sums, 64);
  else _tile_stored(KVFLEET_TILE_C1, sums, 64);
  for (int64_t r = 0; r < rows; ++r) store_columns(a.out, a.out_bf16, (row0 + r) * a.out_stride + col0, sums[r], col0, cols, a.bias);
}

// Every row of x against one panel, dequantized into `pairs` first: 32 rows a pass where there
// are, two C tiles sharing each B tile (one tile product's result feeding the next alone left the
// unit waiting on it: 64 rows took 3.9 ms beyond the dequantization on a 1B layer, 16 took ~1),
// then what is left 16 rows or fewer at a time.
void panel_rows_amx(const AmxArgs& a, int64_t panel, uint32_t* pairs, int64_t& configured_rows) {
  const uint8_t* weights = a.packed + panel * a.k * kColumns * a.bits / 8;
  const at::Half* scales = a.scales + panel * (a.k / a.group) * scale_planes(a.zero_point) * kColumns;
  if (a.bits == 8) dequantize_panel<8>(pairs, weights, scales, a.k, a.group, a.zero_point);
  else if (a.bits == 6) dequantize_panel<6>(pairs, weights, scales, a.k, a.group, a.zero_point);
  else dequantize_panel<4>(pairs, weights, scales, a.k, a.group, a.zero_point);
  const int64_t col0 = panel * kColumns, cols = std::min<int64_t>(kColumns, a.n - col0);
  int64_t row0 = 0;
  for (; row0 + 2 * kTileRows <= a.rows; row0 += 2 * kTileRows) {  // tiles 0-4 alike: C0, C1, A1 (2), A0 (4)
    if (configured_rows != kTileRows) kvfleet_cpu::configure_tiles(kTileRows, 64, 16), configured_rows = kTileRows;
    _tile_zero(KVFLEET_TILE_C0);
    _tile_zero(KVFLEET_TILE_C1);
    for (int64_t f = 0; f < a.k; f += kTileFeatures) {
      _tile_loadd(KVFLEET_TILE_B0, pairs + (f / 2) * kColumns, 64);
      _tile_loadd(KVFLEET_TILE_A, a.x + row0 * a.k + f, a.k * 2);
      _tile_loadd(KVFLEET_TILE_C2, a.x + (row0 + kTileRows) * a.k + f, a.k * 2);
      _tile_dpbf16ps(KVFLEET_TILE_C0, KVFLEET_TILE_A, KVFLEET_TILE_B0);
      _tile_dpbf16ps(KVFLEET_TILE_C1, KVFLEET_TILE_C2, KVFLEET_TILE_B0);
    }
    store_sums(a, KVFLEET_TILE_C0, row0, kTileRows, col0, cols);
    store_sums(a, KVFLEET_TILE_C1, row0 + kTileRows, kTileRows, col0, cols);
  }
  for (; row0 < a.rows; row0 += kTileRows) {
    const int64_t rows = std::min(kTileRows, a.rows - row0);
    if (rows != configured_rows) kvfleet_cpu::configure_tiles(rows, 64, 16), configured_rows = rows;
    _tile_zero(KVFLEET_TILE_C0);
    for (int64_t f = 0; f < a.k; f += kTileFeatures) {
      _tile_loadd(KVFLEET_TILE_A, a.x + row0 * a.k + f, a.k * 2);
      _tile_loadd(KVFLEET_TILE_B0, pairs + (f / 2) * kColumns, 64);
      _tile_dpbf16ps(KVFLEET_TILE_C0, KVFLEET_TILE_A, KVFLEET_TILE_B0);
    }
    store_sums(a, KVFLEET_TILE_C0, row0, rows, col0, cols);
  }
}
#endif

// Every part's panels (their columns side by side in out) in one parallel region, threads taking
// whole panels: a merged projection's q, k and v, or gate and up, in one call and one fork and join
// rather than one each over panels too few to share out well (SmolLM2's k: 4 panels of 16).
void run_parts_amx(const std::vector<AmxArgs>& parts) {
#if defined(KVFLEET_DECODE_AMX) && defined(__AVX512BF16__)
  PartPanels panels_of;
  for (const AmxArgs& a : parts) panels_of.add(a.n);
  at::parallel_for(0, panels_of.total(), 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> pairs(parts.front().k / 2 * kColumns);
    int64_t configured_rows = 0;
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t part = panels_of.part_of(panel);
      panel_rows_amx(parts[part], panel - panels_of.first[part], pairs.data(), configured_rows);
    }
    at::native::cpublas::brgemm_release();  // this thread's tiles, as torch's brgemm callers end
  });
#endif
}

// out [M, sum N_p] (bf16 or fp32, rows dense) = x [M, K] bf16 @ [W_0; W_1; ...]^T + bias, each W_p
// as pack_quantized_weight packed it (bits, group, zero_point and N_p its own); an fp32 bias of
// sum N_p or none.
void quantized_linear_amx_parts(const at::Tensor& out, const at::Tensor& x, at::TensorList packed,
                                at::TensorList scales, at::IntArrayRef bits, at::IntArrayRef group,
                                at::IntArrayRef zero_point, at::IntArrayRef out_features,
                                const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(quantized_amx_available(), "quantized_linear_amx needs a CPU with amx_bf16 (and the kernel's permission)");
  const int64_t count = static_cast<int64_t>(packed.size()), k = x.size(1);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x must be [M, K] bf16, contiguous");
  check_parts(packed, scales, bits, group, zero_point, out_features, k, out, x.size(0), bias);
  std::vector<AmxArgs> parts;
  int64_t start = 0;
  for (int64_t p = 0; p < count; ++p) {
    void* part_out = static_cast<char*>(out.data_ptr()) + start * out.element_size();
    parts.push_back({x.const_data_ptr<at::BFloat16>(), packed[p].const_data_ptr<uint8_t>(),
                     scales[p].const_data_ptr<at::Half>(), bias ? bias->const_data_ptr<float>() + start : nullptr,
                     part_out, out.scalar_type() == at::kBFloat16, x.size(0), k, out_features[p], group[p], bits[p],
                     out.stride(0), zero_point[p]});
    start += out_features[p];
  }
  run_parts_amx(parts);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("quantized_linear_amx_parts(Tensor(a!) out, Tensor x, Tensor[] packed, Tensor[] scales, int[] bits, "
        "int[] group, int[] zero_point, int[] out_features, Tensor? bias=None) -> ()");
  m.def("quantized_amx_available() -> bool", &quantized_amx_available);
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) { m.impl("quantized_linear_amx_parts", &quantized_linear_amx_parts); }
