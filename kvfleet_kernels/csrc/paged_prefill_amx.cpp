// Causal prefill attention for bf16 models on CPUs with AMX, reading the paged cache in place
// (the caches in the decode kernel's layouts): the CPU peer of the Triton prefill kernel
// (kvfleet_kernels/prefill_attention.py), one sequence's chunk of queries per call.
//
// Why: prefill_attention_brgemm.cpp, the AMX hosts' kernel before this, ran ~420-600 GFLOP/s on a
// 2-core Xeon whose bf16 matmul probe reads ~2,300. Its profile split evenly between oneDNN's
// brgemm calls (two shapes alternating, so each call reloads the tile palette) with the K/V
// gathers and packing that fed them, and a softmax of ~20 instructions for 16 scores. Here:
// - Both caches already lie as the B tiles of the two products load them (csrc/decode_amx.h):
//   K tiles are read from their blocks; values from a per-call copy in chunks of 64 positions
//   (a V product takes 16 pairs, a block of 16 positions holds 8), whose positions past the
//   context are zeroed (stale slots may hold NaN, and 0 x NaN is NaN). One palette, no gathers.
// - A work item is one KV head and 16 query positions, its group's row tiles (16 positions of
//   one query head each) one after another. A row tile walks the keys 64 at a time; the next chunk's
//   scores are asked of the tiles before this chunk's softmax, so that the tile unit and the
//   vector units overlap. A head of 64 keeps its output in four C tiles over the whole walk;
//   larger heads take theirs through memory once a chunk (64 keys, not 32: 16/8 heads of 128,
//   1,200 x 1,456, went from ~8.1 to ~6.7 ms).
// - The softmax raises a row's running max only when a chunk's scores pass it by more than
//   2^kLazyRescale (FlashAttention-4's lazy rescaling): most chunks need one compare, not the
//   row's max, and probabilities of at most 2^8 stay well inside bf16 and fp32. Its exp2 is a
//   degree-3 polynomial on the fraction (vreduceps) scaled by the integer part (vscalefps),
//   within 7.5e-5 of 2^x, under the bf16 rounding (3.9e-3) the probabilities then get, as
//   torch's flash kernel rounds them.
// NOTE: each row tile reads its head's whole K/V; past ~2 MB of them a head (8,192 positions of
// 64, ~4,000 of 128) they come from L3 for every row tile, and 2,048 new tokens after 6,144
// cached (16/8 heads of 128) ran ~224 ms against brgemm's ~220. Walking several row tiles per
// chunk would keep each chunk in L2 for all of them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "decode_amx.h"
#include "prefill_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

namespace {

using namespace kvfleet_cpu;  // NOLINT: the vector helpers and tiles are this kernel's vocabulary

constexpr int64_t kTileRows = 16;    // query positions per work item: the rows of each of its tiles
constexpr int64_t kChunkKeys = 64;   // keys per step: four K tiles of 16 positions, two V products
constexpr float kLazyRescale = 8.f;  // log2 units a row's scores may pass its running max unrescaled

struct PagedPrefill : CausalSpan {  // the queries, the context and the window: which keys each query sees
  at::BFloat16* out;
  const at::BFloat16 *query, *key_cache, *value_cache;
  const int64_t* block_table;
  int64_t num_kv_heads, head_dim, group, block_size;
  int64_t q_row, q_head, out_row, out_head, k_block, k_head, v_block, v_head;
  float scale_log2;  // the softmax scale times log2(e): scores become log2 units in one multiply

  int64_t num_chunks() const { return (context_len + kChunkKeys - 1) / kChunkKeys; }
  int64_t chunk_elements() const { return kChunkKeys * head_dim; }
};

#if defined(KVFLEET_DECODE_AMX)
// 2^t for t <= kLazyRescale, zero in the lanes `keep` leaves out (whatever they hold).
inline __m512 exp2_masked(__mmask16 keep, __m512 t) {
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // t - floor(t), [0, 1)
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(7.80242831e-2f), f, _mm512_set1_ps(2.26067275e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.95833623e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.99925196e-1f));
  return _mm512_maskz_scalef_ps(keep, p, t);  // p * 2^floor(t)
}

// One head's values as the V products read them: [num_chunks][kChunkKeys / 2 pairs][D][2], the
// positions past the context zero.
void stage_values(at::BFloat16* staged, const PagedPrefill& s, int64_t h, int64_t chunk) {
  const int64_t d = s.head_dim, k0 = chunk * kChunkKeys;
  at::BFloat16* dst = staged + (h * s.num_chunks() + chunk) * s.chunk_elements();
  for (int64_t pair = 0; pair < kChunkKeys / 2; ++pair, dst += 2 * d) {
    const int64_t position = k0 + 2 * pair, visible = std::clamp<int64_t>(s.context_len - position, 0, 2);
    if (visible == 0) {
      std::fill(dst, dst + 2 * d, at::BFloat16(0.f));
      continue;
    }
    const at::BFloat16* src = s.value_cache + s.block_table[position / s.block_size] * s.v_block + h * s.v_head +
                              (position % s.block_size) * d;  // pair (position / 2) of its block: 2d elements
    const __mmask32 keep = visible == 2 ? 0xFFFFFFFFu : 0x55555555u;  // the pair's second position past the end
    for (int64_t i = 0; i < 2 * d; i += 32)
      _mm512_storeu_si512(dst + i, _mm512_maskz_loadu_epi16(keep, src + i));
  }
}

// Tiles, every one 16 rows of 64 bytes: 0-3 a row tile's output sums, 64 dimensions (all of
// them kept there over the keys when D is 64; otherwise each sweep of 64 goes through memory),
// 4 the A operand (queries, then probabilities), 5 the B operand (keys, then values), 6-7 a
// chunk's 32 scores.
#define KVFLEET_TILE_S0 6
#define KVFLEET_TILE_S1 7

// Per-thread state of one row tile: query head h * group + g at positions p0 + i, i < 16.
struct TileState {
  alignas(64) float scores[2][kTileRows * kChunkKeys];      // [16, 64] raw, this chunk's and the next's
  alignas(64) at::BFloat16 probs[kTileRows * kChunkKeys];  // [16, 64], zero in rows past the queries
  alignas(64) float sums[kTileRows * kLanes];              // each row's running sum, lane-wise
  float max_log2[kTileRows], limit[kTileRows], correction[kTileRows];
  bool rescaled = false;  // some row's max rose this chunk: its output takes `correction`
  std::vector<at::BFloat16> q;  // [16, D], zero past the queries
  std::vector<float> acc;       // [16, D]: the output sums, where they are not in tiles
  explicit TileState(int64_t d) : q(kTileRows * d), acc(kTileRows * d) {}
};

// scores[i][n] = q_i . k_(k0 + n), raw, into `scores` ([16, 64]), for the first `quarters` K
// tiles of 16 positions (no row sees the others: their lanes are masked later); each pair of K
// tiles shares its A tiles.
void tile_scores(float* scores, const TileState& w, const PagedPrefill& s, int64_t h, int64_t k0, int64_t quarters) {
  const int64_t word_row = s.block_size * 2, d = s.head_dim;  // elements from one pair of dimensions to the next
  auto keys_at = [&](int64_t position) {  // 16 positions of word row 0
    return s.key_cache + s.block_table[position / s.block_size] * s.k_block + h * s.k_head +
           (position % s.block_size) * 2;
  };
  for (int64_t quarter = 0; quarter < quarters; quarter += 2) {
    const bool both = quarter + 1 < quarters;
    const at::BFloat16 *keys0 = keys_at(k0 + quarter * 16), *keys1 = both ? keys_at(k0 + quarter * 16 + 16) : keys0;
    _tile_zero(KVFLEET_TILE_S0);
    _tile_zero(KVFLEET_TILE_S1);
    for (int64_t i = 0; i < d; i += 32) {
      _tile_loadd(KVFLEET_TILE_A, w.q.data() + i, d * 2);
      _tile_loadd(KVFLEET_TILE_B0, keys0 + (i / 2) * word_row, word_row * 2);
      _tile_dpbf16ps(KVFLEET_TILE_S0, KVFLEET_TILE_A, KVFLEET_TILE_B0);
      if (!both) continue;
      _tile_loadd(KVFLEET_TILE_B0, keys1 + (i / 2) * word_row, word_row * 2);
      _tile_dpbf16ps(KVFLEET_TILE_S1, KVFLEET_TILE_A, KVFLEET_TILE_B0);
    }
    _tile_stored(KVFLEET_TILE_S0, scores + quarter * 16, kChunkKeys * 4);
    if (both) _tile_stored(KVFLEET_TILE_S1, scores + quarter * 16 + 16, kChunkKeys * 4);
  }
}

// Row i's running max moves up to `new_max_log2`: its sum shrinks by the change now, its output
// sums once the chunk's rows are done (rescale_output).
void raise_max(TileState& w, int64_t i, float new_max_log2, float scale_log2) {
  const float correction = std::exp2(w.max_log2[i] - new_max_log2);  // 0 on the row's first keys
  w.max_log2[i] = new_max_log2;
  w.limit[i] = (new_max_log2 + kLazyRescale) / scale_log2;
  w.correction[i] = correction;
  w.rescaled = true;
  float* sum = w.sums + i * kLanes;
  _mm512_store_ps(sum, _mm512_mul_ps(_mm512_load_ps(sum), _mm512_set1_ps(correction)));
}

// Row i's 64 scores -> bf16 probabilities, zero outside the lanes `visible` keeps. kFull: the row
// sees every key of the chunk (most chunks), and `visible` is not read.
template <bool kFull>
void softmax_row(TileState& w, const float* scores, int64_t i, uint64_t visible, float scale_log2) {
  at::BFloat16* probs = w.probs + i * kChunkKeys;
  if (!kFull && visible == 0) {
    _mm512_store_si512(probs, _mm512_setzero_si512());
    _mm512_store_si512(probs + 32, _mm512_setzero_si512());
    return;
  }
  const float* row = scores + i * kChunkKeys;
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 keep[4];
  __m512 s[4], best = lowest;
  for (int v = 0; v < 4; ++v) {
    keep[v] = kFull ? 0xFFFF : static_cast<__mmask16>(visible >> (16 * v));
    s[v] = _mm512_load_ps(row + 16 * v);
    best = _mm512_max_ps(best, kFull ? s[v] : _mm512_mask_mov_ps(lowest, keep[v], s[v]));
  }
  if (_mm512_cmp_ps_mask(best, _mm512_set1_ps(w.limit[i]), _CMP_GT_OQ))
    raise_max(w, i, _mm512_reduce_max_ps(best) * scale_log2, scale_log2);
  const __m512 scale = _mm512_set1_ps(scale_log2), shift = _mm512_set1_ps(-w.max_log2[i]);
  __m512 p[4];
  for (int v = 0; v < 4; ++v) p[v] = exp2_masked(keep[v], _mm512_fmadd_ps(s[v], scale, shift));
  float* sum = w.sums + i * kLanes;
  const __m512 total = _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3]));
  _mm512_store_ps(sum, _mm512_add_ps(_mm512_load_ps(sum), total));
  _mm512_store_si512(probs, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p[1], p[0])));  // p[0] in the low half
  _mm512_store_si512(probs + 32, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p[3], p[2])));
}

// The rows whose max rose this chunk: their output sums so far times their correction.
void rescale_output(TileState& w, int64_t d, bool in_tiles) {
  if (in_tiles) store_value_tiles(w.acc.data(), d);
  for (int64_t i = 0; i < kTileRows; ++i) {
    if (w.correction[i] == 1.f) continue;
    const __m512 c = _mm512_set1_ps(w.correction[i]);
    float* acc = w.acc.data() + i * d;
    for (int64_t n = 0; n < d; n += kLanes) _mm512_storeu_ps(acc + n, _mm512_mul_ps(_mm512_loadu_ps(acc + n), c));
    w.correction[i] = 1.f;
  }
  if (in_tiles) load_value_tiles(w.acc.data(), d);
  w.rescaled = false;
}

// Output sums += probs [16, 64] x the chunk's values (pairs: [32][D][2]), 64 dimensions a sweep;
// `halves`: the 32-key halves any row sees (the second may lie past every row's keys).
void tile_values(TileState& w, const at::BFloat16* pairs, int64_t d, bool in_tiles, int64_t halves) {
  for (int64_t i = 0; i < d; i += kAmxValueDims) {
    if (!in_tiles) load_value_tiles(w.acc.data() + i, d);
    for (int64_t half = 0; half < halves; ++half)
      amx_weighted_values(w.probs + half * 32, kChunkKeys, pairs + half * 32 * d + 2 * i, 2 * d);
    if (!in_tiles) store_value_tiles(w.acc.data() + i, d);
  }
}

// The lanes of a 64-key chunk at k0 that a row seeing keys [first, end) keeps.
inline uint64_t visible_lanes(int64_t first, int64_t end, int64_t k0) {
  const int64_t lo = std::clamp<int64_t>(first - k0, 0, kChunkKeys), hi = std::clamp<int64_t>(end - k0, 0, kChunkKeys);
  auto below = [](int64_t n) { return n >= 64 ? ~uint64_t{0} : (uint64_t{1} << n) - 1; };  // no 1 << 64
  return below(hi) & ~below(lo);
}

// Query head h * group + g at positions [p0, p0 + 16) (fewer at the end), over every chunk they see.
void attend_tile(const PagedPrefill& s, const at::BFloat16* staged, int64_t h, int64_t g, int64_t p0, TileState& w) {
  const int64_t d = s.head_dim, positions = std::min(kTileRows, s.num_queries - p0);
  const bool in_tiles = d == kAmxValueDims;
  std::fill(w.q.begin(), w.q.end(), at::BFloat16(0.f));
  for (int64_t i = 0; i < positions; ++i)
    std::memcpy(w.q.data() + i * d, s.query + (p0 + i) * s.q_row + (h * s.group + g) * s.q_head, d * 2);
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  std::fill(std::begin(w.sums), std::end(w.sums), 0.f);
  std::fill(std::begin(w.probs), std::end(w.probs), at::BFloat16(0.f));
  std::fill(std::begin(w.max_log2), std::end(w.max_log2), -std::numeric_limits<float>::infinity());
  std::fill(std::begin(w.limit), std::end(w.limit), -std::numeric_limits<float>::infinity());
  std::fill(std::begin(w.correction), std::end(w.correction), 1.f);
  if (in_tiles) zero_value_tiles();
  const int64_t last_end = s.end_key(p0 + positions - 1);  // the furthest key any row sees, plus one
  const int64_t first_chunk = s.first_key(p0) / kChunkKeys, end_chunk = (last_end - 1) / kChunkKeys + 1;
  // The next chunk's scores are asked of the tiles before this chunk's softmax: the vector units
  // work while the tile products and stores complete.
  // The K tiles of the chunk at k0 any row sees (the rest lie past every row's last key).
  auto quarters_seen = [&](int64_t k0) { return std::min<int64_t>(4, (last_end - k0 + 15) / 16); };
  tile_scores(w.scores[first_chunk & 1], w, s, h, first_chunk * kChunkKeys, quarters_seen(first_chunk * kChunkKeys));
  for (int64_t chunk = first_chunk; chunk < end_chunk; ++chunk) {
    const int64_t k0 = chunk * kChunkKeys, next = k0 + kChunkKeys;
    if (chunk + 1 < end_chunk) tile_scores(w.scores[(chunk + 1) & 1], w, s, h, next, quarters_seen(next));
    const float* scores = w.scores[chunk & 1];
    if (k0 >= s.first_key(p0 + positions - 1) && next <= s.end_key(p0)) {  // every row sees every key
      for (int64_t i = 0; i < positions; ++i) softmax_row<true>(w, scores, i, 0, s.scale_log2);
    } else {
      for (int64_t i = 0; i < positions; ++i)
        softmax_row<false>(w, scores, i, visible_lanes(s.first_key(p0 + i), s.end_key(p0 + i), k0), s.scale_log2);
    }
    if (w.rescaled) rescale_output(w, d, in_tiles && chunk > first_chunk);
    tile_values(w, staged + (h * s.num_chunks() + chunk) * s.chunk_elements(), d, in_tiles,
                k0 + 32 < last_end ? 2 : 1);
  }
  if (in_tiles) store_value_tiles(w.acc.data(), d);
  for (int64_t i = 0; i < positions; ++i) {
    at::BFloat16* o = s.out + (p0 + i) * s.out_row + (h * s.group + g) * s.out_head;
    const vfloat inv_sum = vfloat{} + 1.f / reduce_add(load16(w.sums + i * kLanes));
    for (int64_t n = 0; n < d; n += kLanes) store16(o + n, load16(w.acc.data() + i * d + n) * inv_sum);
  }
}

void paged_prefill_kernel(const PagedPrefill& s) {
  const int64_t num_chunks = s.num_chunks();
  // [Hkv, chunks, 32, D, 2], every element written by stage_values (no zero fill: at a long
  // context this is tens of MB a call)
  const std::unique_ptr<at::BFloat16[]> staged(new at::BFloat16[s.num_kv_heads * num_chunks * s.chunk_elements()]);
  at::parallel_for(0, s.num_kv_heads * num_chunks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) stage_values(staged.get(), s, item / num_chunks, item % num_chunks);
  });
  // Items cost about the chunks their rows see, which grow along the causal triangle.
  const int64_t blocks = (s.num_queries + kTileRows - 1) / kTileRows, num_items = s.num_kv_heads * blocks;
  std::vector<int64_t> cost_before(num_items + 1, 0);
  for (int64_t item = 0; item < num_items; ++item) {
    const int64_t p0 = item % blocks * kTileRows, last = std::min(p0 + kTileRows, s.num_queries) - 1;
    cost_before[item + 1] = cost_before[item] + (s.end_key(last) - s.first_key(p0)) / kChunkKeys + 1;
  }
  parallel_for_by_cost(cost_before, [&](int64_t begin, int64_t end) {
    if (begin >= end) return;
    configure_square_tiles();  // every tile 16 rows of 64 bytes (csrc/decode_amx.h)
    TileState state(s.head_dim);
    for (int64_t item = begin; item < end; ++item)
      for (int64_t g = 0; g < s.group; ++g)
        attend_tile(s, staged.get(), item / blocks, g, item % blocks * kTileRows, state);
    at::native::cpublas::brgemm_release();  // this thread's tiles, as torch's brgemm callers end
  });
}
#endif

bool paged_prefill_amx_available() { return kHasAmxBf16 && amx_permitted(); }

// out, query: [Q, Hq, D] bf16, rows of any stride, D dense: the sequence's last Q positions, whose
// K/V are already in the caches; key_cache: [num_blocks, Hkv, D / 2, block_size, 2] and
// value_cache: [num_blocks, Hkv, block_size / 2, D, 2] bf16 (csrc/decode_keys.h, decode_values.h);
// block_table: [max_blocks] int64, the sequence's; D a multiple of 64 up to 256, block_size a
// multiple of 16; sliding_window 0: none. Block ids must be valid rows of the caches.
void paged_prefill_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_table, int64_t context_len,
                             double scale, int64_t sliding_window) {
  TORCH_CHECK(paged_prefill_amx_available(), "paged_prefill_attention needs AMX (amx_bf16) and Linux's leave to use it");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes() && query.stride(2) == 1 && out.stride(2) == 1,
              "query and out must be [Q, Hq, D], D dense");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                  key_cache.scalar_type() == at::kBFloat16 && value_cache.scalar_type() == at::kBFloat16,
              "bf16 tensors only");
  const int64_t head_dim = query.size(2);
  TORCH_CHECK(head_dim % 64 == 0 && head_dim <= 256, "head_dim must be a multiple of 64 up to 256");
  TORCH_CHECK(value_cache.dim() == 5 && value_cache.size(3) == head_dim && value_cache.size(4) == 2 &&
                  value_cache.stride(4) == 1 && value_cache.stride(3) == 2 && value_cache.stride(2) == 2 * head_dim,
              "value_cache must be [num_blocks, Hkv, block_size / 2, D, 2], each block and head dense");
  const int64_t block_size = value_cache.size(2) * 2;
  TORCH_CHECK(key_cache.dim() == 5 && key_cache.sizes() == at::IntArrayRef({value_cache.size(0), value_cache.size(1),
                                                                          head_dim / 2, block_size, 2}) &&
                  key_cache.stride(4) == 1 && key_cache.stride(3) == 2 && key_cache.stride(2) == 2 * block_size,
              "key_cache must be [num_blocks, Hkv, D / 2, block_size, 2] for the value cache's sizes, each block "
              "and head dense");
  TORCH_CHECK(block_size % 16 == 0, "block_size must be a multiple of 16");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(context_len >= query.size(0) && query.size(0) >= 1, "the context must hold the queries");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 1 && block_table.stride(0) == 1 &&
                  block_table.size(0) * block_size >= context_len,
              "block_table must be [max_blocks] int64, dense, covering context_len");
  TORCH_CHECK(scale > 0, "scale must be positive");
#if defined(KVFLEET_DECODE_AMX)
  const PagedPrefill s{{query.size(0), context_len, sliding_window > 0 ? sliding_window : 0},
                       out.data_ptr<at::BFloat16>(), query.const_data_ptr<at::BFloat16>(),
                       key_cache.const_data_ptr<at::BFloat16>(), value_cache.const_data_ptr<at::BFloat16>(),
                       block_table.const_data_ptr<int64_t>(), key_cache.size(1), head_dim,
                       query.size(1) / key_cache.size(1), block_size, query.stride(0), query.stride(1), out.stride(0),
                       out.stride(1), key_cache.stride(0), key_cache.stride(1), value_cache.stride(0),
                       value_cache.stride(1), static_cast<float>(scale * M_LOG2E)};
  paged_prefill_kernel(s);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvfleet_cpu, m) {
  m.def("paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_table, int context_len, float scale, int sliding_window) -> ()");
  m.def("paged_prefill_amx_available() -> bool", &paged_prefill_amx_available);
}

TORCH_LIBRARY_IMPL(kvfleet_cpu, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }
