// Helpers shared by the native CPU kernels (paged_decode_cpu.cpp, varlen_attention_cpu.cpp,
// prefill_attention_cpu.cpp, lora_cpu.cpp, cpu_layers.cpp): 16 fp32 lanes through g++'s vector
// extensions, so one source lowers to AVX-512, AVX2 or NEON, with loads and stores that widen
// and round bf16/fp16; the row tiling of their register-blocked loops; and the cost-balanced
// split of work items over threads.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512BW__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace kvfleet_cpu {

// 16 fp32 lanes: one AVX-512 register, or two AVX2 / four NEON ones, as g++ lowers it.
using vfloat = float __attribute__((vector_size(64)));
constexpr int kLanes = 16;

// How many vfloats fit the vector registers at once: 32 on AVX-512 (32 registers of 16
// lanes), 8 on AVX2 (16 of 8 lanes) and on NEON (32 of 4 lanes). Register-blocked loops
// size their tiles by it: a tile built for AVX-512's 32 spills to the stack on the others.
#if defined(__AVX512F__)
constexpr int kVfloatRegisters = 32;
#elif defined(__AVX__)
constexpr int kVfloatRegisters = 8;
#else
constexpr int kVfloatRegisters = 8;
#endif

// Whether this build has avx512_bf16's pair dot product (vdpbf16ps): the bf16 paths of the
// decode and prefill attention kernels and the vnni linear need it.
#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;
#else
constexpr bool kHasBf16Dot = false;
#endif

// 16 consecutive elements widened to fp32 (memcpy: unaligned, no aliasing assumptions).
inline vfloat load16(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vfloat load16(const at::BFloat16* p) {  // bf16 is the top half of an fp32
  using u16x16 = uint16_t __attribute__((vector_size(32)));
  using u32x16 = uint32_t __attribute__((vector_size(64)));
  u16x16 raw;
  std::memcpy(&raw, p, sizeof raw);
  const u32x16 wide = __builtin_convertvector(raw, u32x16) << 16;
  vfloat v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}
inline vfloat load16(const at::Half* p) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)  // g++ lowers its own conversion to 16 scalar ones without AVX-512
  const __m128i* raw = reinterpret_cast<const __m128i*>(p);
  const __m256 halves[2] = {_mm256_cvtph_ps(_mm_loadu_si128(raw)), _mm256_cvtph_ps(_mm_loadu_si128(raw + 1))};
  vfloat v;
  std::memcpy(&v, halves, sizeof v);
  return v;
#else
  using f16x16 = _Float16 __attribute__((vector_size(32)));
  f16x16 raw;
  std::memcpy(&raw, p, sizeof raw);
  return __builtin_convertvector(raw, vfloat);
#endif
}
// fp8, the elements of an fp8 KV cache (engine/kv_quant.py). Its pairs (dimensions d and d + 1 of
// a key, positions 2j and 2j + 1 of a value) are stored as bf16's are, two bytes for four.
template <typename T>
constexpr bool kIsFp8 = std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;

// fp8 bytes (one per 16-bit lane) -> fp32, through fp16, whose conversion every x86-64-v3 CPU has
// (F16C). e5m2 is the top byte of an fp16. e4m3's sign, exponent and mantissa moved into fp16's
// places as they are read 2^-8 of its value: fp16's exponent bias is 8 more, and e4m3's subnormals
// land on fp16 subnormals of the same 2^-8 (its NaN, 0x7F, is never stored).
using u16x16 = uint16_t __attribute__((vector_size(32)));
template <typename fp8_t>
inline vfloat fp8_bytes_to_float(u16x16 bytes) {
  using f16x16 = _Float16 __attribute__((vector_size(32)));
  const u16x16 bits = std::is_same_v<fp8_t, c10::Float8_e5m2> ? u16x16(bytes << 8)
                                                               : u16x16(((bytes & 0x80) << 8) | ((bytes & 0x7F) << 7));
  f16x16 halves;
  std::memcpy(&halves, &bits, sizeof halves);
  const vfloat v = __builtin_convertvector(halves, vfloat);
  return std::is_same_v<fp8_t, c10::Float8_e5m2> ? v : v * 256.f;
}
// 16 words of fp8 pairs -> their even and odd elements in fp32.
template <typename fp8_t>
inline void load_fp8_pairs(const fp8_t* words, vfloat& even, vfloat& odd) {
  u16x16 w;
  std::memcpy(&w, words, sizeof w);
  even = fp8_bytes_to_float<fp8_t>(w & 0xFF);
  odd = fp8_bytes_to_float<fp8_t>(w >> 8);
}

#if defined(__AVX512BW__)
// The bf16 bits of fp8 subnormal i (i times 2^-step_exponent), a normal bf16 number.
constexpr uint16_t fp8_subnormal_bf16(int i, int step_exponent) {
  if (i == 0) return 0;
  const int e = i >= 4 ? 2 : i >= 2 ? 1 : 0;  // floor(log2 i)
  return static_cast<uint16_t>(((127 - step_exponent + e) << 7) | ((i << (7 - e)) & 0x7F));
}
// 32 bf16 (one __m512i) from 32 elements: bf16's as they are, fp8's widened exactly. A normal fp8
// number's exponent and mantissa shift into bf16's places, the exponent rebased (bias 7 or 15 to
// 127); subnormals (e4m3's magnitudes below 8, e5m2's below 4) are looked up, as bf16 reads its
// own subnormals as zero in the dot product.
template <typename cache_t>
inline __m512i bf16_words32(const cache_t* p) {
  if constexpr (!kIsFp8<cache_t>) {
    return _mm512_loadu_si512(p);
  } else {
    constexpr bool e4m3 = std::is_same_v<cache_t, c10::Float8_e4m3fn>;
    constexpr int mantissa_bits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15, step = bias - 1 + mantissa_bits;
    alignas(64) static constexpr uint16_t subnormals[32] = {
        fp8_subnormal_bf16(0, step), fp8_subnormal_bf16(1, step), fp8_subnormal_bf16(2, step),
        fp8_subnormal_bf16(3, step), fp8_subnormal_bf16(4, step), fp8_subnormal_bf16(5, step),
        fp8_subnormal_bf16(6, step), fp8_subnormal_bf16(7, step)};
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i magnitude = _mm512_and_si512(bytes, _mm512_set1_epi16(0x7F));
    __m512i words = _mm512_add_epi16(_mm512_slli_epi16(magnitude, 7 - mantissa_bits),
                                     _mm512_set1_epi16(static_cast<int16_t>((127 - bias) << 7)));
    const __mmask32 subnormal = _mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(1 << mantissa_bits));
    words = _mm512_mask_permutexvar_epi16(words, subnormal, magnitude, _mm512_load_si512(subnormals));
    const __m512i sign = _mm512_and_si512(_mm512_slli_epi16(bytes, 8), _mm512_set1_epi16(static_cast<int16_t>(0x8000)));
    return _mm512_or_si512(words, sign);
  }
}
#endif

inline void store16(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }
inline float reduce_add(vfloat v) {  // a tree of halves: log2(16) dependent adds, not 15
  using v8 = float __attribute__((vector_size(32)));
  using v4 = float __attribute__((vector_size(16)));
  v8 low, high;
  std::memcpy(&low, &v, sizeof low);
  std::memcpy(&high, reinterpret_cast<const char*>(&v) + sizeof low, sizeof high);
  low += high;
  v4 a, b;
  std::memcpy(&a, &low, sizeof a);
  std::memcpy(&b, reinterpret_cast<const char*>(&low) + sizeof a, sizeof b);
  a += b;
  return (a[0] + a[2]) + (a[1] + a[3]);
}

inline float reduce_max(vfloat v) {  // a tree of halves, as reduce_add: 15 dependent maxes took ~60 cycles
  using v8 = float __attribute__((vector_size(32)));
  using v4 = float __attribute__((vector_size(16)));
  v8 low, high;
  std::memcpy(&low, &v, sizeof low);
  std::memcpy(&high, reinterpret_cast<const char*>(&v) + sizeof low, sizeof high);
  low = low > high ? low : high;
  v4 a, b;
  std::memcpy(&a, &low, sizeof a);
  std::memcpy(&b, reinterpret_cast<const char*>(&low) + sizeof a, sizeof b);
  a = a > b ? a : b;
  return std::max(std::max(a[0], a[2]), std::max(a[1], a[3]));
}

// The largest of x[0:n], n >= 1: 16 lanes at a time, then the tail.
inline float max_of(const float* x, int64_t n) {
  vfloat best16 = vfloat{} - std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vfloat v = load16(x + i);
    best16 = v > best16 ? v : best16;
  }
  float best = reduce_max(best16);
  for (; i < n; ++i) best = std::max(best, x[i]);
  return best;
}

// e^x for x <= 0 (scores minus their row max), 16 lanes at once: x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error < 2e-7), 2^n
// through the exponent bits. Scalar std::exp was a third of the kernel's compute time.
inline vfloat exp16(vfloat x) {
  const vfloat floor_x = vfloat{} - 87.0f;  // e^-87 ~ 1.6e-38: n stays above -126, a normal float
  x = x < floor_x ? floor_x : x;
  using i32x16 = int32_t __attribute__((vector_size(64)));
  const i32x16 n = __builtin_convertvector(x * 1.44269504f - 0.5f, i32x16);  // round(x / ln2), x <= 0
  const vfloat nf = __builtin_convertvector(n, vfloat);
  const vfloat r = (x - nf * 0.693145752f) - nf * 1.42860677e-6f;  // ln2 split in two for precision
  vfloat poly = 1.f / 720 + r * 0.f;
  poly = poly * r + 1.f / 120;
  poly = poly * r + 1.f / 24;
  poly = poly * r + 1.f / 6;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.f;
  poly = poly * r + 1.f;
  const i32x16 bits = (n + 127) << 23;
  vfloat two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return poly * two_n;
}


// 16 lanes rounded to nearest even (bf16: the top half of the fp32 bits; fp16: the ISA's convert).
inline void store16(at::BFloat16* p, vfloat v) {
  using u32x16 = uint32_t __attribute__((vector_size(64)));
  using u16x16 = uint16_t __attribute__((vector_size(32)));
  u32x16 bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits += 0x7fffu + ((bits >> 16) & 1u);  // finite values only: attention outputs are never NaN
  const u16x16 top = __builtin_convertvector(bits >> 16, u16x16);
  std::memcpy(p, &top, sizeof top);
}
inline void store16(at::Half* p, vfloat v) {
  using f16x16 = _Float16 __attribute__((vector_size(32)));
  const f16x16 narrow = __builtin_convertvector(v, f16x16);
  std::memcpy(p, &narrow, sizeof narrow);
}

// An optimization barrier: v is materialized here as computed, and g++ cannot fold the
// operations before and after it into one reordered expression. A no-op without AVX-512, where
// a 16-lane value spans several registers (nothing that needs it runs there).
inline void pin(vfloat& v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

// 16 fp32 lanes rounded to scalar_t and widened back: where a torch op on bf16/fp16 tensors
// would round its result before the next op reads it.
template <typename scalar_t>
inline vfloat round16(vfloat v) {
  scalar_t narrow[kLanes];
  store16(narrow, v);
  return load16(narrow);
}

// bf16 in registers: the same rounding as store16's (to nearest even, finite values), with the low
// half cleared instead of a store and a load through the stack. On a 2-core Xeon with AMX, 8,192
// rows of SmolLM2: rotary 2.1 -> 1.2 ms (four roundings per 16 lanes), silu_and_mul 4.8 -> 3.7.
template <>
inline vfloat round16<float>(vfloat v) {  // fp32 rounds nothing further
  return v;
}
template <>
inline vfloat round16<at::BFloat16>(vfloat v) {
  using u32x16 = uint32_t __attribute__((vector_size(64)));
  u32x16 bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// SiLU(gate) * up on 16 lanes of gate and up already in scalar_t, rounded where transformers'
// act(gate) * up rounds: the SiLU to scalar_t before the product (the caller's store rounds the
// product). sigmoid(g) through exp16 on -|g| (relative error < 2e-7), so a result can differ
// from torch's in its last bit when the fp32 value sits within that of a rounding boundary.
// silu_and_mul and the fused gate_up products (brgemm_linear_cpu.cpp, vnni_linear_cpu.cpp) must
// agree bit for bit, yet -funsafe-math-optimizations lets g++ reorder the products around an
// inlined call differently in each (a reciprocal form of this differed in 0.05% of outputs): the sigmoid is
// pinned, so the ops on each side of it stay as written.
template <typename scalar_t>
inline vfloat silu_mul16(vfloat gate, vfloat up) {
  const vfloat zero{}, one = zero + 1.f;
  const vfloat t = exp16(gate < zero ? gate : -gate);  // e^-|g|
  vfloat sigmoid = (gate < zero ? t : one) / (one + t);
  pin(sigmoid);
  return round16<scalar_t>(gate * sigmoid) * up;
}

// tile(std::integral_constant<int, T>{}, r) for rows [r, r + T) of [0, count): tiles of kTile
// rows, then the last count % kTile rows as one tile. The kernels keep a tile's accumulators
// in registers, which needs its row count fixed at compile time.
template <int kTile, typename Tile>
inline void for_each_tile(int64_t count, Tile&& tile) {
  static_assert(kTile >= 1 && kTile <= 4, "the remainder switch covers tiles of up to 4 rows");
  int64_t r = 0;
  for (; r + kTile <= count; r += kTile) tile(std::integral_constant<int, kTile>{}, r);
  switch (count - r) {
    case 3: if constexpr (kTile > 3) tile(std::integral_constant<int, 3>{}, r); break;
    case 2: if constexpr (kTile > 2) tile(std::integral_constant<int, 2>{}, r); break;
    case 1: tile(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

// Runs body(begin, end) on each thread over one contiguous run of items [begin, end) holding an
// equal share of their total cost; cost_before [num_items + 1] is the prefix sum of the items'
// costs. Where items cost unequal amounts (contexts of different lengths, rows along a causal
// triangle), an even split of the item range left one thread idle at the end.
template <typename Body>
void parallel_for_by_cost(const std::vector<int64_t>& cost_before, Body&& body) {
  const int64_t num_items = static_cast<int64_t>(cost_before.size()) - 1;
  const int64_t num_shares = std::min<int64_t>(num_items, at::get_num_threads());
  auto share_start = [&](int64_t share) {  // the first item whose cost starts in this share
    const int64_t target = cost_before.back() * share / num_shares;
    return std::lower_bound(cost_before.begin(), cost_before.end(), target) - cost_before.begin();
  };
  at::parallel_for(0, num_shares, 1, [&](int64_t first_share, int64_t end_share) {
    body(share_start(first_share), share_start(end_share));
  });
}

// Asks for `rows` rows of `row_elements` elements, `row_stride` apart, to be brought to the
// cache level `kLocality` names (__builtin_prefetch's). The prefetch helpers are always inlined:
// g++ (12) counts a function whose only work is prefetching as free of effects and drops every
// call to one it has not inlined. A first build of the decode kernel's ItemDecoder lost its K
// pass's value prefetch that way (objdump showed 2 prefetch sites of 3), and ran ~1.05 ms a
// layer against ~0.6.
#define KVFLEET_PREFETCH_HELPER __attribute__((always_inline)) inline
template <int kLocality = 3, typename scalar_t>
KVFLEET_PREFETCH_HELPER void prefetch_block(const scalar_t* block, int64_t rows, int64_t row_stride,
                                            int64_t row_elements) {
  constexpr int64_t kLine = 64 / sizeof(scalar_t);  // elements per cache line
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t e = 0; e < row_elements; e += kLine) __builtin_prefetch(block + row * row_stride + e, 0, kLocality);
}

}  // namespace kvfleet_cpu
