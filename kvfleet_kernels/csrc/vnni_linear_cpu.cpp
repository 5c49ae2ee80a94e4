// bf16 linear layers on avx512_bf16's pair dot product (vdpbf16ps) over a weight packed once
// into 64-column VNNI panels: the CPU linear of bf16 models on CPUs with avx512_bf16 and no AMX
// (engine/models/layers.py: PackedBf16Linear, kernel "vnni"). On AMX CPUs the brgemm microkernel does this job
// (csrc/brgemm_linear_cpu.cpp); torch's brgemm packs no bf16 on the others.
//
// Why not oneDNN's matmul primitive over a reordered weight, as fp32 linears use: on a 2-core
// AMD EPYC (avx512_bf16, no AMX, 32 GB/s read probe), SmolLM2's 120 decoder linears took 14.4 ms
// at 1 row (weights streamed at 15 GB/s) and 48 ms at 64 rows (280 GFLOP/s against a 400
// GFLOP/s probe). A decode step is those linears plus attention; at a few rows it is bound by
// reading the weights, at tens of rows by the dot products, and the primitive met neither bound.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "packed_linear.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

// Output columns per panel: four vectors of 16 fp32 sums. A panel of K/2 pairs is one
// contiguous stream of K * 128 bytes, which the hardware prefetcher follows.
constexpr int64_t kPanelColumns = kvfleet_cpu::kPackedColumns;
constexpr int kPanelVectors = kPanelColumns / 16;
// Rows whose sums share the registers (kTileRows * 4 accumulators of the 32): each weight
// vector loaded serves that many rows. Rows per work item: a block of activations that stays
// in L2 while every panel passes over it.
constexpr int kTileRows = 6;  // panel_rows dispatches passes of 1 to 6 rows
constexpr int64_t kBlockRows = 128;

bool vnni_linear_supported() { return kvfleet_cpu::kHasBf16Dot; }

#if defined(__AVX512BF16__)

// What a tile's epilogue writes: the rounded sums (a plain linear, and the gate half of a fused
// gate_up), or SiLU(gate) * up from the up half's sums and the gate the first pass left in out.
enum class Epilogue { kStore, kSiluMulGate };

struct LinearArgs {
  const at::BFloat16* x;  // [rows, K], row stride x_stride
  const at::BFloat16* packed;  // [panels, K * 64]
  const float* bias;  // [N] or nullptr
  at::BFloat16* out;  // [rows, N], row stride out_stride
  int64_t rows, k, n, panels, x_stride, out_stride;
};

// Cache lines of the next panel to bring into L2 while a tile pass computes on this one, spread
// evenly over the pass: the passes over a panel after the first read it from L2, and without
// this the first pass waits on memory while the others leave it idle.
struct NextPanel {
  const char* lines = nullptr;  // the first line this pass asks for; nullptr: none
  int64_t count = 0;
};

// out[r, c] for TILE rows from row0 and the VECTORS x 16 columns of panel `panel` from its vector
// `first`: sum over pairs p of x[r, 2p:2p+2] . W^T[2p:2p+2, c], each row's pair broadcast
// against the vectors.
template <int TILE, int VECTORS, Epilogue EPILOGUE>
void panel_tile(const LinearArgs& args, int64_t row0, int64_t panel, int first, NextPanel next) {
  const at::BFloat16* weights = args.packed + panel * args.k * kPanelColumns + 32 * first;
  const at::BFloat16* x = args.x + row0 * args.x_stride;
  __m512 acc[TILE][VECTORS];
  for (int t = 0; t < TILE; ++t)
    for (int v = 0; v < VECTORS; ++v) acc[t][v] = _mm512_setzero_ps();
  const int64_t pairs = args.k / 2;
  int64_t owed = 0;  // next.count lines over `pairs` steps: Bresenham's running remainder
  for (int64_t p = 0; p < pairs; ++p) {
    for (owed += next.count; next.lines && owed >= pairs; owed -= pairs, next.lines += 64)
      __builtin_prefetch(next.lines, 0, 2);
    const at::BFloat16* w = weights + p * 2 * kPanelColumns;  // [64 columns, 2] for pair p
    __m512bh wv[VECTORS];
    for (int v = 0; v < VECTORS; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + 32 * v);
    for (int t = 0; t < TILE; ++t) {
      int32_t pair;
      std::memcpy(&pair, x + t * args.x_stride + 2 * p, sizeof pair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < VECTORS; ++v) acc[t][v] = _mm512_dpbf16_ps(acc[t][v], xv, wv[v]);
    }
  }
  const int64_t col0 = panel * kPanelColumns + 16 * first, cols = std::min<int64_t>(16 * VECTORS, args.n - col0);
  for (int t = 0; t < TILE; ++t) {
    at::BFloat16* out = args.out + (row0 + t) * args.out_stride + col0;
    for (int v = 0; v < VECTORS && 16 * v < cols; ++v) {
      __m512 sum = acc[t][v];
      const int64_t lanes = std::min<int64_t>(16, cols - 16 * v);
      const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
      if (args.bias) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, args.bias + col0 + 16 * v));
      if constexpr (EPILOGUE == Epilogue::kStore) {
        _mm256_mask_storeu_epi16(out + 16 * v, mask, (__m256i)_mm512_cvtneps_pbh(sum));  // round to nearest even
      } else {  // full panels only (gate_up_silu checks I): silu_and_mul's rounding, bit for bit
        const kvfleet_cpu::vfloat up = kvfleet_cpu::round16<at::BFloat16>(sum);
        kvfleet_cpu::store16(out + 16 * v, kvfleet_cpu::silu_mul16<at::BFloat16>(kvfleet_cpu::load16(out + 16 * v), up));
      }
    }
  }
}

// Rows [row0, row0 + count) against VECTORS vectors of one panel from its vector `first`, in
// passes of as even a size as may be (8 rows: 4 + 4, not 6 + 2: a pass of few rows loads as many
// weight vectors for fewer products). With two passes or more, each prefetches its share of
// `next_panel` (nullptr: none): the later passes read this panel from L2, and memory would idle
// through them. A single pass (up to 6 rows) streams its panel as it computes, which the hardware
// prefetcher follows alone: on a 2-core EPYC, SmolLM2's decoder linears ran 3-15% faster at 2-6
// rows without asking for the next panel there too (in-process rounds interleaved, 15 a side).
template <int VECTORS, Epilogue EPILOGUE = Epilogue::kStore>
void panel_rows(const LinearArgs& args, int64_t row0, int64_t count, int64_t panel, int first,
                const at::BFloat16* next_panel) {
  if (panel * kPanelColumns + 16 * first >= args.n) return;  // a slice wholly in the padding
  const int64_t passes = (count + kTileRows - 1) / kTileRows, panel_lines = args.k * kPanelColumns * 2 / 64;
  for (int64_t pass = 0; pass < passes; ++pass) {
    const int64_t begin = count * pass / passes, rows = count * (pass + 1) / passes - begin, r = row0 + begin;
    NextPanel next;
    if (next_panel && passes > 1) {
      const int64_t first_line = panel_lines * pass / passes;
      next = {reinterpret_cast<const char*>(next_panel) + 64 * first_line, panel_lines * (pass + 1) / passes - first_line};
    }
    switch (rows) {
      case 6: panel_tile<6, VECTORS, EPILOGUE>(args, r, panel, first, next); break;
      case 5: panel_tile<5, VECTORS, EPILOGUE>(args, r, panel, first, next); break;
      case 4: panel_tile<4, VECTORS, EPILOGUE>(args, r, panel, first, next); break;
      case 3: panel_tile<3, VECTORS, EPILOGUE>(args, r, panel, first, next); break;
      case 2: panel_tile<2, VECTORS, EPILOGUE>(args, r, panel, first, next); break;
      default: panel_tile<1, VECTORS, EPILOGUE>(args, r, panel, first, next); break;
    }
  }
}

// Work item `item` of row_blocks x panels x slices, row-block major: a block of rows against one
// slice (4 / slices vectors, from vector `first`) of one panel.
struct Item {
  int64_t row0, rows, panel;
  int first;
};
Item item_at(const LinearArgs& args, int64_t item, int slices) {
  const int64_t per_block = args.panels * slices, row0 = item / per_block * kBlockRows;
  return {row0, std::min(kBlockRows, args.rows - row0), item % per_block / slices,
          static_cast<int>(item % slices) * (kPanelVectors / slices)};
}

// The item's rows against its slice; a whole panel also asks for `next` (nullptr: none).
template <Epilogue EPILOGUE = Epilogue::kStore>
void run_item(const LinearArgs& args, const Item& it, int slices, const at::BFloat16* next) {
  if (slices == 1) {
    panel_rows<kPanelVectors, EPILOGUE>(args, it.row0, it.rows, it.panel, 0, next);
  } else if (slices == 2) {
    panel_rows<2, EPILOGUE>(args, it.row0, it.rows, it.panel, it.first, nullptr);
  } else {
    panel_rows<1, EPILOGUE>(args, it.row0, it.rows, it.panel, it.first, nullptr);
  }
}

const at::BFloat16* panel_at(const LinearArgs& args, int64_t panel) { return args.packed + panel * args.k * kPanelColumns; }

// A plain linear's item; a whole panel asks for the thread's next one.
void linear_item(const LinearArgs& args, int64_t item, int64_t end, int slices) {
  const at::BFloat16* next = item + 1 < end ? panel_at(args, (item + 1) % args.panels) : nullptr;
  run_item(args, item_at(args, item, slices), slices, next);
}

// A fused gate_up item: gate panel c into out as bf16, then up panel c (`up` is `gate` moved on
// by I columns of weight and bias) combined with it. The gate pass asks for its up panel, the up
// pass for the thread's next gate panel.
void gate_up_item(const LinearArgs& gate, const LinearArgs& up, int64_t item, int64_t end, int slices) {
  const Item it = item_at(gate, item, slices);
  run_item(gate, it, slices, panel_at(up, it.panel));
  const at::BFloat16* next = item + 1 < end ? panel_at(gate, (item + 1) % gate.panels) : nullptr;
  run_item<Epilogue::kSiluMulGate>(up, it, slices, next);
}

// Fewer (row block, panel) items than threads (a narrow layer at decode sizes on a many-core
// CPU): panels split into slices of 2 or 1 vectors, a thread then reading 2 or 1 of the 4
// cache lines of each pair. A column's sum is the same whichever slice computes it.
int slices_for(int64_t items) {
  int slices = 1;
  while (slices < kPanelVectors && items * slices < at::get_num_threads()) slices *= 2;
  return slices;
}

#endif  // __AVX512BF16__

// weight [N, K] bf16 (K even) -> [ceil(N / 64), K * 64]: panel b holds output columns
// [64b, 64b + 64) (zeros past N) as K/2 pairs, each 64 columns of (W[c, 2p], W[c, 2p + 1]).
at::Tensor pack_vnni_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "weight must be [N, K] bf16 on the CPU");
  TORCH_CHECK(weight.size(1) % 2 == 0, "K must be even (bf16 pairs)");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanelColumns - 1) / kPanelColumns;
  at::Tensor padded = at::zeros({panels * kPanelColumns, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  // [panels, 64, K/2, 2] -> [panels, K/2, 64, 2]
  return padded.view({panels, kPanelColumns, k / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({panels, k * kPanelColumns});
}

// out [M, N] = x [M, K] @ weight^T + bias, weight as pack_vnni_weight left it, sums in fp32 and
// rounded once to bf16. Work items are (row block, panel) pairs (linear_item), row-block major,
// split evenly over the threads: at decode sizes (one row block) each thread streams its share of the
// weight from memory once, and every further tile of rows reads its panel from cache.
void vnni_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                 const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(vnni_linear_supported(), "vnni_linear needs a CPU with avx512_bf16 (and this library built for it)");
  kvfleet_cpu::check_packed_linear(out, x, packed, bias, "pack_vnni_weight");
#if defined(__AVX512BF16__)
  const LinearArgs args{x.const_data_ptr<at::BFloat16>(), packed.const_data_ptr<at::BFloat16>(),
                        bias ? bias->const_data_ptr<float>() : nullptr, out.data_ptr<at::BFloat16>(),
                        x.size(0), x.size(1), out.size(1), packed.size(0), x.stride(0), out.stride(0)};
  const int64_t row_blocks = (args.rows + kBlockRows - 1) / kBlockRows;
  const int slices = slices_for(row_blocks * args.panels);
  at::parallel_for(0, row_blocks * args.panels * slices, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) linear_item(args, item, end, slices);
  });
#endif
}

// out [M, I] = SiLU(gate) * up for [gate, up] = x [M, K] @ weight^T + bias: a gated MLP's gate_up
// projection and silu_and_mul in one pass, bit for bit the two ops (as brgemm_gate_up_silu on AMX
// hosts), so that the [M, 2I] product never goes to memory and back. weight [2I, K] as
// pack_vnni_weight left it, I a multiple of 64: gate panel c pairs with up panel c + I / 64.
void vnni_gate_up_silu(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(vnni_linear_supported(), "vnni_gate_up_silu needs a CPU with avx512_bf16 (and this library built for it)");
  kvfleet_cpu::check_gate_up_silu(out, x, packed, bias, "pack_vnni_weight");
  const int64_t width = out.size(1), gate_panels = width / kPanelColumns;
#if defined(__AVX512BF16__)
  const LinearArgs gate{x.const_data_ptr<at::BFloat16>(), packed.const_data_ptr<at::BFloat16>(),
                        bias ? bias->const_data_ptr<float>() : nullptr, out.data_ptr<at::BFloat16>(),
                        x.size(0), x.size(1), width, gate_panels, x.stride(0), width};
  LinearArgs up = gate;
  up.packed += gate_panels * gate.k * kPanelColumns;
  if (up.bias) up.bias += width;
  const int64_t row_blocks = (gate.rows + kBlockRows - 1) / kBlockRows;
  const int slices = slices_for(row_blocks * gate_panels);
  at::parallel_for(0, row_blocks * gate_panels * slices, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) gate_up_item(gate, up, item, end, slices);
  });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("pack_vnni_weight(Tensor weight) -> Tensor");
  m.def("vnni_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias=None) -> ()");
  m.def("vnni_gate_up_silu(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias=None) -> ()");
  m.def("vnni_linear_supported() -> bool", &vnni_linear_supported);
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) {
  m.impl("pack_vnni_weight", &pack_vnni_weight);
  m.impl("vnni_linear", &vnni_linear);
  m.impl("vnni_gate_up_silu", &vnni_gate_up_silu);
}
