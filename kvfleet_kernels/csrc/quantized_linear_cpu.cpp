// Linear layers computed on quantized weights, never dequantized as a whole: GGUF's Q4_0 ... Q8_0
// and K-quants (kvfleet_kernels/cpu_quantized_linear.py). Every such format is, per output column c
// and group g of G input features, w = A[c, g] * u - B[c, g] with an unsigned code u of 4 or 8 bits
// (engine/quantized_weights.py writes each format so). Activations are quantized per 32 features
// to int16 (scale s), and
//
//   y[r, c] = sum_g sum_{k in g} (A u - B) x  ~=  sum_units  A s (u . xq)  -  B s (sum xq)
//
// where (u . xq) is an integer dot product of word pairs (avx512_vnni's vpdpwssd, int16 x int16
// into int32; elsewhere g++'s vector extensions), scaled in fp32 once per unit of 32 features (16
// for G = 16: Q6_K). A decode step reads 4 or 8 bits a weight plus 2 fp16 a group.
//
// Why int16 activations and not llama.cpp's int8 (vpdpbusd, twice the products an instruction):
// SmolLM2-135M's Q4_1 file, its activations rounded to int8 per 32 (s = max|x| / 127), answered
// "What is the capital of France?" with "L'Étoile, la Marseillaise, ..." where its dequantized
// weights answer "The capital of France is Paris."; int16's rounding (1 / 65534 of a block's
// largest value) sits below bf16's own.
//
// Packed weight, per panel of 16 output columns (kColumns), K/4 steps of 4 features:
//   8 bits: step s is 64 bytes, byte (c, t) = u[c, 4s + t];
//   4 bits: steps 2j and 2j+1 share 64 bytes, byte (c, t) = u[c, 8j + t] | u[c, 8j + 4 + t] << 4.
// Scales: fp16 [panels, K / G, 2, 16], A then B of the panel's columns (zeros past N).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

#if defined(__AVX512VNNI__)
#include <immintrin.h>
#define KVFLEET_NATIVE_DOT true
#else
#define KVFLEET_NATIVE_DOT false
#endif

namespace {

using kvfleet_cpu::vfloat;
using i32x16 = int32_t __attribute__((vector_size(64)));
using i16x32 = int16_t __attribute__((vector_size(64)));
using u8x64 = uint8_t __attribute__((vector_size(64)));
using u8x32 = uint8_t __attribute__((vector_size(32)));

constexpr int64_t kColumns = 16;  // output columns a panel: two vectors of (column, pair) sums
constexpr int kMaxRows = 6;  // rows sharing each unpacked weight vector (4 accumulators each)
constexpr int64_t kBlockRows = 64;  // rows an item: a panel read from cache by each further pass

bool native_dot() { return KVFLEET_NATIVE_DOT; }

// Lane 2c + h of acc += w[c, 2h] x[2h] + w[c, 2h + 1] x[2h + 1]: 8 columns' products of 4 features
// (words 4c .. 4c + 3 of w), in pairs, int16 x int16 into int32; x4 the 4 features' int16s.
inline i32x16 dot2(i32x16 acc, i16x32 w, int64_t x4) {
#if defined(__AVX512VNNI__)
  return (i32x16)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi64(x4));
#else
  int16_t x[4];
  std::memcpy(x, &x4, sizeof x);
  for (int j = 0; j < 16; ++j) acc[j] += w[2 * j] * x[2 * (j % 2)] + w[2 * j + 1] * x[2 * (j % 2) + 1];
  return acc;
#endif
}

struct QuantArgs {
  const int16_t* xq;  // [rows, K]
  const float* xmeta;  // [rows, K / 8]: s per 32 | s * sum(xq) per 32 | s * sum(xq) per 16
  const uint8_t* packed;  // [panels, K * 16 * bits / 8]
  const at::Half* scales;  // [panels, K / G, 2, 16]
  const float* bias;  // [N] or nullptr
  void* out;  // [rows, N] bf16 or fp32, row stride out_stride
  bool out_bf16;
  int64_t rows, k, n, group, out_stride;
};

inline u8x64 load_u8x64(const uint8_t* p) {
  u8x64 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The weight vectors of `steps` steps from step s0 of a panel: 8 bits one load each, 4 bits one
// load a pair, split into its low and high nibbles.
template <int BITS, int STEPS>
inline void load_steps(const uint8_t* panel, int64_t s0, u8x64 (&w)[STEPS]) {
  if constexpr (BITS == 8) {
    for (int s = 0; s < STEPS; ++s) w[s] = load_u8x64(panel + (s0 + s) * 64);
  } else {
    for (int s = 0; s < STEPS; s += 2) {
      const u8x64 both = load_u8x64(panel + (s0 + s) * 32);
      w[s] = both & 0x0F;
      w[s + 1] = (both >> 4) & 0x0F;
    }
  }
}

// 32 codes as words (zero-extended): one load-and-widen on AVX-512 (g++ splits its own
// conversion of a 64-byte vector into 256-bit halves there).
inline i16x32 widen(const uint8_t* p) {
#if defined(__AVX512BW__)
  return (i16x32)_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  u8x32 part;
  std::memcpy(&part, p, sizeof part);
  return __builtin_convertvector(part, i16x32);
#endif
}

// Steps s and s + 1 (s even) of a panel, columns 0-7 (`half` 0) or 8-15 (1), as words: 4 features
// of each column. 8 bits: a load each; 4 bits: one load for both, low and high nibbles.
template <int BITS>
inline void load_pair(const uint8_t* panel, int64_t s, int half, i16x32& first, i16x32& second) {
  if constexpr (BITS == 8) {
    first = widen(panel + s * 64 + 32 * half), second = widen(panel + (s + 1) * 64 + 32 * half);
  } else {
    const i16x32 both = widen(panel + s * 32 + 32 * half);
    first = both & 0x0F, second = both >> 4;
  }
}

// A group's scales in the sums' lane order (2c + h): a for both pairs of a column, b on the first only
// (the pairs are added at the end, and b must count once).
struct GroupScales {
  vfloat a[2], b[2];
  explicit GroupScales(const at::Half* ab) {
    const vfloat a16 = kvfleet_cpu::load16(ab), b16 = kvfleet_cpu::load16(ab + kColumns);
    const vfloat first = {1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0};
    a[0] = __builtin_shufflevector(a16, a16, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    a[1] = __builtin_shufflevector(a16, a16, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    b[0] = __builtin_shufflevector(b16, b16, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7) * first;
    b[1] = __builtin_shufflevector(b16, b16, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15) * first;
  }
};

// Output columns of one panel for R rows from row0: units of UNIT features (32, or 16 for
// groups of 16), each an integer dot product scaled once into the fp32 sums.
template <int BITS, int UNIT, int R>
void panel_pass(const QuantArgs& a, int64_t row0, int64_t panel) {
  constexpr int kSteps = UNIT / 4;
  // Independent sums a row and half: a dot product's latency is ~5 of its issue slots, and one
  // chain of 8 a unit left a single row waiting on it (2.6 ms at 1 row where 2 rows took 2.7).
  constexpr int kChains = R >= 3 ? 1 : 4 / R;
  const uint8_t* weights = a.packed + panel * a.k * kColumns * BITS / 8;
  const at::Half* scales = a.scales + panel * (a.k / a.group) * 2 * kColumns;
  const int64_t meta = a.k / 8, units = a.k / UNIT, units_per_group = a.group / UNIT;
  const int64_t sums = UNIT == 32 ? a.k / 32 : 2 * (a.k / 32);  // where xmeta's s * sum(xq) per unit start
  vfloat acc[R][2] = {};
  GroupScales g(scales);
  for (int64_t u = 0; u < units; ++u) {
    if (u % units_per_group == 0) g = GroupScales(scales + (u / units_per_group) * 2 * kColumns);
    i32x16 dot[R][2][kChains] = {};
    for (int s = 0; s < kSteps; s += 2) {
      i16x32 w[2][2];  // [step s, s + 1][half]
      load_pair<BITS>(weights, u * kSteps + s, 0, w[0][0], w[1][0]);
      load_pair<BITS>(weights, u * kSteps + s, 1, w[0][1], w[1][1]);
      for (int r = 0; r < R; ++r) {
        int64_t x8[2];  // the 8 features of steps s and s + 1, 4 int16 each
        std::memcpy(x8, a.xq + (row0 + r) * a.k + u * UNIT + 4 * s, sizeof x8);
        for (int step = 0; step < 2; ++step) {
          const int chain = (s + step) % kChains;
          for (int h = 0; h < 2; ++h) dot[r][h][chain] = dot2(dot[r][h][chain], w[step][h], x8[step]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const float* xm = a.xmeta + (row0 + r) * meta;
      const float s = xm[u * UNIT / 32], c = xm[sums + u];
      for (int h = 0; h < 2; ++h) {
        i32x16 sum = dot[r][h][0];
        for (int chain = 1; chain < kChains; ++chain) sum += dot[r][h][chain];
        acc[r][h] += __builtin_convertvector(sum, vfloat) * (g.a[h] * s) - g.b[h] * c;
      }
    }
  }
  const int64_t col0 = panel * kColumns, cols = std::min<int64_t>(kColumns, a.n - col0);
  for (int r = 0; r < R; ++r) {
    float lanes[2 * kColumns];
    kvfleet_cpu::store16(lanes, acc[r][0]), kvfleet_cpu::store16(lanes + kColumns, acc[r][1]);
    for (int64_t c = 0; c < cols; ++c) {
      const float value = lanes[2 * c] + lanes[2 * c + 1] + (a.bias ? a.bias[col0 + c] : 0.0f);
      const int64_t at = (row0 + r) * a.out_stride + col0 + c;
      if (a.out_bf16) static_cast<at::BFloat16*>(a.out)[at] = value;
      else static_cast<float*>(a.out)[at] = value;
    }
  }
}

// Rows [row0, row0 + count) against one panel, in passes of as even a size as may be.
template <int BITS, int UNIT>
void panel_rows(const QuantArgs& a, int64_t row0, int64_t count, int64_t panel) {
  const int64_t passes = (count + kMaxRows - 1) / kMaxRows;
  for (int64_t pass = 0; pass < passes; ++pass) {
    const int64_t begin = count * pass / passes, rows = count * (pass + 1) / passes - begin, r = row0 + begin;
    switch (rows) {
      case 6: panel_pass<BITS, UNIT, 6>(a, r, panel); break;
      case 5: panel_pass<BITS, UNIT, 5>(a, r, panel); break;
      case 4: panel_pass<BITS, UNIT, 4>(a, r, panel); break;
      case 3: panel_pass<BITS, UNIT, 3>(a, r, panel); break;
      case 2: panel_pass<BITS, UNIT, 2>(a, r, panel); break;
      default: panel_pass<BITS, UNIT, 1>(a, r, panel); break;
    }
  }
}

template <int BITS, int UNIT>
void run_linear(const QuantArgs& a, int64_t panels) {
  const int64_t row_blocks = (a.rows + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, row_blocks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row0 = item / panels * kBlockRows;
      panel_rows<BITS, UNIT>(a, row0, std::min(kBlockRows, a.rows - row0), item % panels);
    }
  });
}

// x [M, K] bf16 or fp32 (K a multiple of 32) -> (xq int16 [M, K], xmeta fp32 [M, K / 8]): per 32
// features s = max|x| / 32767 and xq = round(x / s); xmeta holds s per 32, then s * sum(xq) per 32,
// then s * sum(xq) per 16 (the units of groups of 16).
std::tuple<at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.size(1) % 32 == 0, "x must be [M, K] on the CPU, K a multiple of 32");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t rows = xf.size(0), k = xf.size(1), blocks = k / 32;
  at::Tensor xq = at::empty({rows, k}, x.options().dtype(at::kShort));
  at::Tensor xmeta = at::empty({rows, k / 8}, x.options().dtype(at::kFloat));
  const float* src = xf.const_data_ptr<float>();
  int16_t* q = xq.data_ptr<int16_t>();
  float* meta = xmeta.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* m = meta + r * (k / 8);
      for (int64_t b = 0; b < blocks; ++b) {
        const float* v = src + r * k + 32 * b;
        float amax = 0.0f;
        for (int t = 0; t < 32; ++t) amax = std::max(amax, std::fabs(v[t]));
        const float s = amax / 32767.0f, inverse = amax > 0.0f ? 32767.0f / amax : 0.0f;
        int32_t half_sums[2] = {0, 0};
        for (int t = 0; t < 32; ++t) {
          const int32_t value = static_cast<int32_t>(std::nearbyint(v[t] * inverse));
          q[r * k + 32 * b + t] = static_cast<int16_t>(value);
          half_sums[t / 16] += value;
        }
        m[b] = s;
        m[blocks + b] = s * static_cast<float>(half_sums[0] + half_sums[1]);
        m[2 * blocks + 2 * b] = s * static_cast<float>(half_sums[0]);
        m[2 * blocks + 2 * b + 1] = s * static_cast<float>(half_sums[1]);
      }
    }
  });
  return {xq, xmeta};
}

void check_weight(const at::Tensor& packed, const at::Tensor& scales, int64_t bits, int64_t group, int64_t n, int64_t k) {
  const int64_t panels = (n + kColumns - 1) / kColumns;
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(k % 32 == 0 && (group == 16 || (group % 32 == 0 && group > 0)) && k % group == 0,
              "K must be a multiple of 32 and of the group size (16, or a multiple of 32)");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == panels * k * kColumns * bits / 8,
              "packed must come from pack_quantized_weight for N, K and bits");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == panels * (k / group) * 2 * kColumns,
              "scales must come from pack_quantized_weight for N, K and the group size");
}

// out [M, N] (bf16 or fp32, rows dense) = x @ W^T + bias, x given as quantize_activations left it
// and W as pack_quantized_weight packed it; an fp32 bias of N or none.
void quantized_linear(const at::Tensor& out, const at::Tensor& xq, const at::Tensor& xmeta, const at::Tensor& packed,
                      const at::Tensor& scales, int64_t bits, int64_t group, const std::optional<at::Tensor>& bias) {
  const int64_t n = out.size(1), k = xq.size(1);
  check_weight(packed, scales, bits, group, n, k);
  TORCH_CHECK(xq.scalar_type() == at::kShort && xq.is_contiguous() && xmeta.scalar_type() == at::kFloat &&
                  xmeta.is_contiguous() && xmeta.size(0) == xq.size(0) && xmeta.size(1) == k / 8,
              "xq and xmeta must come from quantize_activations");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == xq.size(0) && out.stride(1) == 1 && out.device().is_cpu() &&
                  (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat),
              "out must be [M, N] bf16 or fp32 on the CPU, rows dense");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n), "bias must be [N] fp32");
  const QuantArgs a{xq.const_data_ptr<int16_t>(), xmeta.const_data_ptr<float>(), packed.const_data_ptr<uint8_t>(),
                    scales.const_data_ptr<at::Half>(), bias ? bias->const_data_ptr<float>() : nullptr, out.data_ptr(),
                    out.scalar_type() == at::kBFloat16, xq.size(0), k, n, group, out.stride(0)};
  const int64_t panels = (n + kColumns - 1) / kColumns;
  if (bits == 4 && group == 16) run_linear<4, 16>(a, panels);
  else if (bits == 4) run_linear<4, 32>(a, panels);
  else if (group == 16) run_linear<8, 16>(a, panels);
  else run_linear<8, 32>(a, panels);
}

// codes uint8 [N, K] (each < 2^bits), a and b fp16 [N, K / G] -> (packed, scales) in the layout above.
std::tuple<at::Tensor, at::Tensor> pack_quantized_weight(const at::Tensor& codes, const at::Tensor& a, const at::Tensor& b,
                                                         int64_t bits) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.device().is_cpu(), "codes must be [N, K] uint8");
  TORCH_CHECK(a.dim() == 2 && a.sizes() == b.sizes() && a.size(0) == codes.size(0) && a.scalar_type() == at::kHalf &&
                  b.scalar_type() == at::kHalf && a.size(1) > 0 && codes.size(1) % a.size(1) == 0,
              "a and b must be [N, K / G] fp16");
  const int64_t n = codes.size(0), k = codes.size(1), groups = a.size(1), panels = (n + kColumns - 1) / kColumns;
  check_weight(at::empty({panels * k * kColumns * bits / 8}, codes.options()),
               at::empty({panels * groups * 2 * kColumns}, a.options()), bits, k / groups, n, k);
  at::Tensor padded = at::zeros({panels * kColumns, k}, codes.options());
  padded.narrow(0, 0, n).copy_(codes);
  // [panels, 16, K/4, 4] -> [panels, K/4, 16, 4]: step s of a panel is 64 contiguous bytes
  at::Tensor steps = padded.view({panels, kColumns, k / 4, 4}).permute({0, 2, 1, 3}).contiguous();
  at::Tensor packed = steps;
  if (bits == 4) {  // steps 2j (low nibble) and 2j + 1 (high nibble) into one 64-byte vector
    at::Tensor pairs = steps.view({panels, k / 8, 2, kColumns * 4});
    packed = pairs.select(2, 0).bitwise_or(pairs.select(2, 1).bitwise_left_shift(4)).contiguous();
  }
  at::Tensor ab = at::zeros({panels * kColumns, groups, 2}, a.options());
  ab.narrow(0, 0, n).select(2, 0).copy_(a);
  ab.narrow(0, 0, n).select(2, 1).copy_(b);
  // [panels, 16, groups, 2] -> [panels, groups, 2, 16]
  at::Tensor scales = ab.view({panels, kColumns, groups, 2}).permute({0, 2, 3, 1}).contiguous();
  return {packed.view({-1}), scales.view({-1})};
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

// One step's 64 codes (16 columns x 4 features) dequantized into row[c][f .. f + 4), with the
// group's scales g (A then B of the 16 columns).
inline void store_step(float (&row)[kColumns][64], int64_t f, u8x64 codes, const at::Half* g) {
  using u8x16 = uint8_t __attribute__((vector_size(16)));
  const vfloat a = kvfleet_cpu::load16(g), b = kvfleet_cpu::load16(g + kColumns);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    u8x16 part;
    std::memcpy(&part, reinterpret_cast<const uint8_t*>(&codes) + 16 * i, sizeof part);
    const vfloat values = spread(a, i) * __builtin_convertvector(part, vfloat) - spread(b, i);
    for (int j = 0; j < 4; ++j) std::memcpy(&row[4 * i + j][f], reinterpret_cast<const float*>(&values) + 4 * j, 16);
  }
}

// The whole weight dequantized into out [N, K] (bf16 or fp32): for steps of many rows, where a
// dense matmul (oneDNN's, on AMX or avx512_bf16) outruns the integer dot products by more than the
// dequantization costs. Each thread writes whole panels; the codes are read once, in order.
void dequantize_quantized_weight(const at::Tensor& out, const at::Tensor& packed, const at::Tensor& scales, int64_t bits,
                                 int64_t group) {
  const int64_t n = out.size(0), k = out.size(1), panels = (n + kColumns - 1) / kColumns, groups = k / group;
  check_weight(packed, scales, bits, group, n, k);
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
        for (int64_t s = f0 / 4; s < (f0 + width) / 4; s += 2) {  // K is a multiple of 32: steps come in pairs
          u8x64 codes[2];
          if (bits == 8) load_steps<8, 2>(pw, s, codes);
          else load_steps<4, 2>(pw, s, codes);
          const at::Half* g = ab + (panel * groups + s * 4 / group) * 2 * kColumns;
          for (int half = 0; half < 2; ++half) store_step(row, s * 4 + 4 * half - f0, codes[half], g);
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor)");
  m.def("pack_quantized_weight(Tensor codes, Tensor a, Tensor b, int bits) -> (Tensor, Tensor)");
  m.def("quantized_linear(Tensor(a!) out, Tensor xq, Tensor xmeta, Tensor packed, Tensor scales, int bits, int group, "
        "Tensor? bias=None) -> ()");
  m.def("dequantize_quantized_weight(Tensor(a!) out, Tensor packed, Tensor scales, int bits, int group) -> ()");
  m.def("quantized_dot_native() -> bool", &native_dot);
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) {
  m.impl("quantize_activations", &quantize_activations);
  m.impl("pack_quantized_weight", &pack_quantized_weight);
  m.impl("quantized_linear", &quantized_linear);
  m.impl("dequantize_quantized_weight", &dequantize_quantized_weight);
}
