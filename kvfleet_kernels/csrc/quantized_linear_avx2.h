// The integer dot products of csrc/quantized_linear_cpu.cpp on AVX2 CPUs without avx512_vnni
// (Zen 2/3, Haswell to Alder Lake): vpmaddubsw on the activations' two int8 digits, and the panel
// pass on __m256 halves. The packed layout and the sums: csrc/quantized_linear_cpu.cpp's header.
#pragma once

#include "quantized_weight.h"

#if defined(__AVX2__) && !defined(__AVX512VNNI__)
#include <immintrin.h>

namespace kvfleet_cpu::quantized::avx2 {

// 4-bit codes take vpmaddubsw (u8 x s8 pair sums into int16) on each digit,
// summed in int16 over a unit (8 steps x 2 x 15 x 128 fits) and widened once with vpmaddwd; 6-bit
// codes too, widened every two steps (2 x 2 x 63 x 128 fits). 8-bit codes would saturate a single
// vpmaddubsw (2 x 255 x 128), so they are widened to int16 and multiplied by the whole int16
// activation with vpmaddwd (255 x 32512 x 2 fits int32). All exact, as the digits are.
// 3 rows a pass: 4 accumulators a row and the codes overfill the 16 registers by a few, yet on a
// 2-core Zen 3 at 64 and 256 rows 3 rows ran ~8% faster than 2 (38 against 35 GMAC/s). That is
// ~60% of what two digits can reach there: a core's peak, measured with independent vpmaddubsw
// and adds, is 2 G of them a second, 32 GMAC/s on two digits, against 43 GMAC/s of fp32 FMA; so on
// Zen 3 prefill stays on the dense path (engine/quantized_linear.py's DENSE_ROWS).
constexpr int kMaxRows = 3;

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// 4 digits of row r from feature f (its high ones, or its low ones), in every 32-bit lane.
inline __m256i digits4(const QuantArgs& a, int64_t row, int64_t f, bool low) {
  int32_t x4;
  std::memcpy(&x4, a.xq + row * 2 * a.k + (low ? a.k : 0) + f, sizeof x4);
  return _mm256_set1_epi32(x4);
}

template <int BITS, int UNIT, int R>
inline void unit_dots(const QuantArgs& a, int64_t row0, const uint8_t* weights, int64_t u, __m256i (&dot)[R][2])
  requires(BITS == 4)
{
  constexpr int kSteps = UNIT / 4;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m256i high[R][2], low[R][2];  // int16 pair sums of columns 0-7 and 8-15
  for (int r = 0; r < R; ++r) high[r][0] = high[r][1] = low[r][0] = low[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int s = 0; s < kSteps; ++s) {
    const uint8_t* pair = weights + (u * kSteps + (s & ~1)) * 32;  // steps 2j and 2j + 1 share 64 bytes
    __m256i codes[2] = {load256(pair), load256(pair + 32)};
    for (__m256i& c : codes) c = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(c, 4) : c, mask);
    for (int r = 0; r < R; ++r) {
      const int64_t f = u * UNIT + 4 * s;
      const __m256i x_high = digits4(a, row0 + r, f, false), x_low = digits4(a, row0 + r, f, true);
      for (int half = 0; half < 2; ++half) {
        high[r][half] = _mm256_add_epi16(high[r][half], _mm256_maddubs_epi16(codes[half], x_high));
        low[r][half] = _mm256_add_epi16(low[r][half], _mm256_maddubs_epi16(codes[half], x_low));
      }
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) {
    for (int half = 0; half < 2; ++half)
      dot[r][half] = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(high[r][half], ones), 8),
                                      _mm256_madd_epi16(low[r][half], ones));
  }
}

// Step q (0-3) of a 6-bit block's codes for one half panel (8 columns, 32 bytes): its low nibbles
// from the pair vector that holds them, its 2 top bits from the shared plane moved up 4 within their
// byte (16-bit shifts: AVX2 has no byte shift, and a top value of 3 or less never leaves its byte).
// csrc/quantized_weight.h's six_bit_step is the same on a whole step, in g++'s byte vectors.
inline __m256i six_bit_codes(const uint8_t* half_block, int q) {
  const __m256i mask = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
  const __m256i nibbles = load256(half_block + q / 2 * 64), top = load256(half_block + 128);
  const __m256i low = _mm256_and_si256(q % 2 ? _mm256_srli_epi16(nibbles, 4) : nibbles, mask);
  return _mm256_or_si256(low, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(top, 2 * q), three), 4));
}

// 6-bit codes (< 64) on the digits too, as 4-bit codes are: a pair sum reaches 2 x 63 x 128 =
// 16,128, so two steps add in int16 before each widening.
template <int BITS, int UNIT, int R>
inline void unit_dots(const QuantArgs& a, int64_t row0, const uint8_t* weights, int64_t u, __m256i (&dot)[R][2])
  requires(BITS == 6)
{
  constexpr int kSteps = UNIT / 4, kBlocks = kSteps / 4;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R][2];  // int32 dot products of columns 0-7 and 8-15
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  for (int b = 0; b < kBlocks; ++b) {
    const uint8_t* block = weights + (u * kBlocks + b) * 192;
    for (int half = 0; half < 2; ++half) {
      __m256i codes[4];
      for (int q = 0; q < 4; ++q) codes[q] = six_bit_codes(block + half * 32, q);
      for (int r = 0; r < R; ++r) {
        for (int pair = 0; pair < 2; ++pair) {
          const int64_t f = u * UNIT + 16 * b + 8 * pair;  // the pair's first feature
          const __m256i high = _mm256_add_epi16(
              _mm256_maddubs_epi16(codes[2 * pair], digits4(a, row0 + r, f, false)),
              _mm256_maddubs_epi16(codes[2 * pair + 1], digits4(a, row0 + r, f + 4, false)));
          const __m256i low = _mm256_add_epi16(
              _mm256_maddubs_epi16(codes[2 * pair], digits4(a, row0 + r, f, true)),
              _mm256_maddubs_epi16(codes[2 * pair + 1], digits4(a, row0 + r, f + 4, true)));
          acc[r][half] = _mm256_add_epi32(acc[r][half], _mm256_add_epi32(
              _mm256_slli_epi32(_mm256_madd_epi16(high, ones), 8), _mm256_madd_epi16(low, ones)));
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) dot[r][0] = acc[r][0], dot[r][1] = acc[r][1];
}

// The unit's int16 activations q = 256 h + l of one row (UNIT of them), rebuilt from the digits.
template <int UNIT>
inline void unit_activations(const QuantArgs& a, int64_t row, int64_t u, int16_t (&q)[UNIT]) {
  const int8_t* x = a.xq + row * 2 * a.k + u * UNIT;
  for (int i = 0; i < UNIT; i += 16) {
    const __m256i high = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
    const __m256i low = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + a.k + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_add_epi16(_mm256_slli_epi16(high, 8), low));
  }
}

// Each column's pair sums added: [c0p0 c0p1 .. c3p1] of columns 0-3 and 4-7 -> columns 0-7 in order.
inline __m256i join_pairs(__m256i first, __m256i second) {
  return _mm256_permute4x64_epi64(_mm256_hadd_epi32(first, second), 0xD8);
}

template <int BITS, int UNIT, int R>
inline void unit_dots(const QuantArgs& a, int64_t row0, const uint8_t* weights, int64_t u, __m256i (&dot)[R][2])
  requires(BITS == 8)
{
  constexpr int kSteps = UNIT / 4;
  int16_t q[R][UNIT];
  for (int r = 0; r < R; ++r) unit_activations<UNIT>(a, row0 + r, u, q[r]);
  __m256i acc[R][4];  // columns 4i .. 4i + 3, two pair sums each
  for (int r = 0; r < R; ++r) for (__m256i& v : acc[r]) v = _mm256_setzero_si256();
  for (int s = 0; s < kSteps; ++s) {
    const u8x64 codes64 = load_u8x64(weights + (u * kSteps + s) * 64);
    const __m128i* step = reinterpret_cast<const __m128i*>(&codes64);
    __m256i x[R];
    for (int r = 0; r < R; ++r) {
      int64_t x4;  // features 4s .. 4s + 3 of row r
      std::memcpy(&x4, q[r] + 4 * s, sizeof x4);
      x[r] = _mm256_set1_epi64x(x4);
    }
    for (int i = 0; i < 4; ++i) {
      const __m256i codes = _mm256_cvtepu8_epi16(_mm_loadu_si128(step + i));
      for (int r = 0; r < R; ++r) acc[r][i] = _mm256_add_epi32(acc[r][i], _mm256_madd_epi16(codes, x[r]));
    }
  }
  for (int r = 0; r < R; ++r) dot[r][0] = join_pairs(acc[r][0], acc[r][1]), dot[r][1] = join_pairs(acc[r][2], acc[r][3]);
}

inline __m256 fused_multiply_add(__m256 x, __m256 y, __m256 z) {  // x * y + z
#if defined(__FMA__)
  return _mm256_fmadd_ps(x, y, z);
#else
  return _mm256_add_ps(_mm256_mul_ps(x, y), z);
#endif
}

// 8 fp16 scales widened (vcvtph2ps, F16C: every AVX2 CPU has it).
inline __m256 load_scales8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// panel_pass on AVX2 (the same sums, in the same order): its 16 columns as two __m256 halves. The
// 64-byte g++ vectors of the generic pass went through the stack and general registers every unit
// here, which with a division a unit (the group test) cost more than the dot products themselves.
template <int BITS, int UNIT, int R>
void panel_pass(const QuantArgs& a, int64_t row0, int64_t panel) {
  const PanelReads<BITS, UNIT> reads(a, panel);
  const __m256 zero_point = _mm256_set1_ps(static_cast<float>(a.zero_point));
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0, u = 0; g < a.k / a.group; ++g) {
    const at::Half* group = reads.group_scales(g);
    __m256 scale_a[2], scale_b[2];
    for (int half = 0; half < 2; ++half) {
      scale_a[half] = load_scales8(group + 8 * half);
      scale_b[half] = a.zero_point >= 0 ? _mm256_mul_ps(scale_a[half], zero_point) : load_scales8(group + kColumns + 8 * half);
    }
    for (const int64_t end = u + reads.units_per_group; u < end; ++u) {
      __m256i dot[R][2];
      unit_dots<BITS, UNIT, R>(a, row0, reads.weights, u, dot);
      for (int r = 0; r < R; ++r) {
        const float* xm = a.xmeta + (row0 + r) * reads.meta;
        const __m256 s = _mm256_set1_ps(xm[u * UNIT / 32]), minus_c = _mm256_set1_ps(-xm[reads.sums + u]);
        for (int half = 0; half < 2; ++half)
          acc[r][half] = fused_multiply_add(_mm256_cvtepi32_ps(dot[r][half]), _mm256_mul_ps(scale_a[half], s),
                                            fused_multiply_add(scale_b[half], minus_c, acc[r][half]));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float row[kColumns];
    _mm256_storeu_ps(row, acc[r][0]), _mm256_storeu_ps(row + 8, acc[r][1]);
    store_panel_row(a, row0 + r, panel, row);
  }
}

}  // namespace kvfleet_cpu::quantized::avx2
#endif
