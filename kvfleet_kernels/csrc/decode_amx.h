// The decode kernel's two products on AMX tiles (kvfleet_kernels/csrc/paged_decode_cpu.cpp): bf16
// caches of head size 64 or 128, GQA groups of up to 16 query heads, blocks of a multiple of 16
// positions, on CPUs with amx_bf16.
//
// Why: on AMX hosts the avx512_bf16 passes were bound by their own instructions: with the cache
// in L2 a 2-core Xeon with AMX read ~30 GB/s, ~190 ns a core for each 16 positions of one KV
// head, while one tile product for a GQA group (up to 8 rows) takes ~3 ns there however few its
// rows. The K pass does 32 dimensions of 16 positions in one product where the dot product took
// 96 instructions for a group of 3.
//
// Both caches' CPU layouts are the VNNI form a B tile holds, so tiles load straight from them.
// K pass: [head_dim / 2, block_size, 2] per block and KV head (csrc/decode_keys.h): 16 word rows
// of 16 positions are one tile; the queries, [group, head_dim] rows of the step's query tensor,
// are the A tile as they lie. V pass: [block_size / 2, head_dim, 2] per block and KV head
// (csrc/decode_values.h): each pair of positions is a word row, 16 dimensions a tile; their
// probabilities, bf16 rows of the softmax, the A tile. Four C tiles hold a group's 64 output
// dimensions over the whole context. Pairs with a position outside the context (the edges
// of a window and of the last block) go through a buffer with that half zeroed.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KVFLEET_DECODE_AMX 1
#endif

namespace kvfleet_cpu {

// Dimensions per V pass sweep: four C tiles of 16.
constexpr int64_t kAmxValueDims = 64;

// Positions per V pass product: a block's, up to 32 (an A tile row of bf16 probabilities).
inline int64_t amx_value_positions(int64_t block_size) { return block_size < 32 ? block_size : 32; }

#if defined(KVFLEET_DECODE_AMX)
constexpr bool kHasAmxBf16 = true;

// Linux hands a process the tile registers' state only once asked (arch_prctl, idempotent); a
// kernel that refuses (before 5.16) leaves the decode kernel on avx512_bf16.
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

// The tiles: C 0-3 (a K pass's 16 scores, or 16 output dimensions of the V pass) and A 4 have
// one row per query row; B 5 and 6 one per word row. Macros, not constants: the _tile_*
// intrinsics paste their tile numbers into assembly text.
#define KVFLEET_TILE_C0 0
#define KVFLEET_TILE_C1 1
#define KVFLEET_TILE_C2 2
#define KVFLEET_TILE_C3 3
#define KVFLEET_TILE_A 4
#define KVFLEET_TILE_B0 5
#define KVFLEET_TILE_B1 6

// Loads a palette on this thread: `rows` query rows (1 to 16), A tiles of `a_bytes` a row and B
// tiles of `b_rows` word rows; tiles past B1, up to `last_tile`, as B tiles. The K pass's and the
// V pass's differ where blocks hold 16 positions (a V product then takes 8 pairs), so each pass
// loads its own. Tile state is per thread, and torch's brgemm keeps its own: the decoder ends with
// cpublas::brgemm_release().
inline void configure_tiles(int64_t rows, int64_t a_bytes, int64_t b_rows, int last_tile = KVFLEET_TILE_B1) {
  struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } config{};
  config.palette = 1;
  for (int t = KVFLEET_TILE_C0; t <= last_tile; ++t) {
    config.colsb[t] = t == KVFLEET_TILE_A ? static_cast<uint16_t>(a_bytes) : 64;
    config.rows[t] = static_cast<uint8_t>(t <= KVFLEET_TILE_A ? rows : b_rows);
  }
  _tile_loadconfig(&config);
}
inline void configure_key_tiles(int64_t rows) { configure_tiles(rows, 64, 16); }
inline void configure_value_tiles(int64_t rows, int64_t positions) { configure_tiles(rows, 2 * positions, positions / 2); }

// s[t * s_stride + i] = q_t . k_i, unscaled, for the configured query rows t (bf16, q_stride
// apart) and the 16 positions i whose word row starts at `keys` (word_row elements from one
// pair of dimensions to the next).
template <int HEAD_DIM>
inline void amx_key_scores16(float* s, int64_t s_stride, const at::BFloat16* q, int64_t q_stride,
                             const at::BFloat16* keys, int64_t word_row) {
  _tile_zero(KVFLEET_TILE_C0);
#pragma GCC unroll 4
  for (int d = 0; d < HEAD_DIM; d += 64) {  // two A tiles of 32 dimensions a step, B tiles alternating
    _tile_loadd(KVFLEET_TILE_A, q + d, q_stride * 2);
    _tile_loadd(KVFLEET_TILE_B0, keys + (d / 2) * word_row, word_row * 2);
    _tile_dpbf16ps(KVFLEET_TILE_C0, KVFLEET_TILE_A, KVFLEET_TILE_B0);
    _tile_loadd(KVFLEET_TILE_A, q + d + 32, q_stride * 2);
    _tile_loadd(KVFLEET_TILE_B1, keys + (d / 2 + 16) * word_row, word_row * 2);
    _tile_dpbf16ps(KVFLEET_TILE_C0, KVFLEET_TILE_A, KVFLEET_TILE_B1);
  }
  _tile_stored(KVFLEET_TILE_C0, s, s_stride * 4);
}

// C tiles 0-3 += probabilities [rows, positions] (bf16, p_stride apart) x 64 dimensions of the
// configured number of pair rows, `pairs` at the first row's dimension 0 of the 64, pair rows
// pair_stride elements apart.
inline void amx_weighted_values(const at::BFloat16* probs, int64_t p_stride, const at::BFloat16* pairs,
                                int64_t pair_stride) {
  _tile_loadd(KVFLEET_TILE_A, probs, p_stride * 2);
  _tile_loadd(KVFLEET_TILE_B0, pairs, pair_stride * 2);
  _tile_dpbf16ps(KVFLEET_TILE_C0, KVFLEET_TILE_A, KVFLEET_TILE_B0);
  _tile_loadd(KVFLEET_TILE_B1, pairs + 32, pair_stride * 2);
  _tile_dpbf16ps(KVFLEET_TILE_C1, KVFLEET_TILE_A, KVFLEET_TILE_B1);
  _tile_loadd(KVFLEET_TILE_B0, pairs + 64, pair_stride * 2);
  _tile_dpbf16ps(KVFLEET_TILE_C2, KVFLEET_TILE_A, KVFLEET_TILE_B0);
  _tile_loadd(KVFLEET_TILE_B1, pairs + 96, pair_stride * 2);
  _tile_dpbf16ps(KVFLEET_TILE_C3, KVFLEET_TILE_A, KVFLEET_TILE_B1);
}

// The pair rows [0, num_pairs) of 64 dimensions into `dst` ([num_pairs, 64 x 2], dense), positions
// outside [lo, hi) (counted from the first pair's first) zeroed.
inline void copy_pairs_masked(at::BFloat16* dst, const at::BFloat16* pairs, int64_t pair_stride, int64_t num_pairs,
                              int64_t lo, int64_t hi) {
  for (int64_t j = 0; j < num_pairs; ++j) {
    const __mmask32 keep = (2 * j >= lo && 2 * j < hi ? 0x55555555u : 0u) |
                           (2 * j + 1 >= lo && 2 * j + 1 < hi ? 0xAAAAAAAAu : 0u);
    for (int c = 0; c < 4; ++c)
      _mm512_storeu_si512(dst + j * 128 + 32 * c, _mm512_maskz_loadu_epi16(keep, pairs + j * pair_stride + 32 * c));
  }
}

inline void zero_value_tiles() {
  _tile_zero(KVFLEET_TILE_C0);
  _tile_zero(KVFLEET_TILE_C1);
  _tile_zero(KVFLEET_TILE_C2);
  _tile_zero(KVFLEET_TILE_C3);
}

// Every tile 16 rows of 64 bytes, all eight: the shape of both products of the paged prefill
// kernel (csrc/paged_prefill_amx.cpp), whose scores take tiles 6 and 7.
inline void configure_square_tiles() { configure_tiles(16, 64, 16, 7); }

// C tiles 0-3 from 64 sums of each configured row of acc (row stride acc_stride floats).
inline void load_value_tiles(const float* acc, int64_t acc_stride) {
  _tile_loadd(KVFLEET_TILE_C0, acc, acc_stride * 4);
  _tile_loadd(KVFLEET_TILE_C1, acc + 16, acc_stride * 4);
  _tile_loadd(KVFLEET_TILE_C2, acc + 32, acc_stride * 4);
  _tile_loadd(KVFLEET_TILE_C3, acc + 48, acc_stride * 4);
}

// The V pass's 64 sums of each configured row into acc (row stride acc_stride floats).
inline void store_value_tiles(float* acc, int64_t acc_stride) {
  _tile_stored(KVFLEET_TILE_C0, acc, acc_stride * 4);
  _tile_stored(KVFLEET_TILE_C1, acc + 16, acc_stride * 4);
  _tile_stored(KVFLEET_TILE_C2, acc + 32, acc_stride * 4);
  _tile_stored(KVFLEET_TILE_C3, acc + 48, acc_stride * 4);
}
#else  // never called: kHasAmxBf16 guards each call
constexpr bool kHasAmxBf16 = false;
inline bool amx_permitted() { return false; }
inline void configure_key_tiles(int64_t) {}
inline void configure_square_tiles() {}
inline void load_value_tiles(const float*, int64_t) {}
inline void configure_value_tiles(int64_t, int64_t) {}
template <int HEAD_DIM>
inline void amx_key_scores16(float*, int64_t, const at::BFloat16*, int64_t, const at::BFloat16*, int64_t) {}
inline void amx_weighted_values(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t) {}
inline void copy_pairs_masked(at::BFloat16*, const at::BFloat16*, int64_t, int64_t, int64_t, int64_t) {}
inline void zero_value_tiles() {}
inline void store_value_tiles(float*, int64_t) {}
#endif

}  // namespace kvfleet_cpu
