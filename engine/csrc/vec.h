// Vectors for the batch-invariant kernels: the widest this build targets (AVX-512, AVX2 + FMA,
// or one scalar lane), with the same lane-wise operations everywhere. A kernel that keeps each
// output's sums within one lane, in a fixed order, computes the same bits with any of them
// (std::fma rounds as the vector FMA does).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#ifndef TANDEM_OPS_NAMESPACE
#define TANDEM_OPS_NAMESPACE tandem
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace tandem_vec {

// For a function whose only effect is __builtin_prefetch: GCC 12 finds such a function pure,
// then removes its calls as dead code unless it is inlined before that analysis.
#define TANDEM_PREFETCH __attribute__((always_inline)) inline
constexpr int64_t kLine = 64;  // bytes a prefetch brings in
// bf16 values below it count as zero where bf16 pairs are summed (vdpbf16ps never meets a subnormal)
constexpr float kTiny = 0x1p-55f;

// An FP8 (e4m3fn) byte. vload gives its value times 2^-120: sign, then the 7 exponent and
// mantissa bits moved under fp32's (e4m3's exponent bias is 7, fp32's 127), subnormals too;
// the caller multiplies by 2^120 (folded into the block scale).
struct Fp8 {
  uint8_t bits;
};

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vbroadcast(float v) { return _mm512_set1_ps(v); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload(const uint8_t* p) {  // 16 bytes as floats, exactly
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vec vload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vec vload(const c10::BFloat16* p) {  // 16 bf16 -> fp32 exactly: the bits shifted up 16
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// The byte sign-extended and shifted up 20 (bits 20-26 its exponent and mantissa, 27-31 copies
// of its sign), then bits 27-30 cleared.
inline vec vload(const Fp8* p) {
  const __m512i b = _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 20);
  return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(static_cast<int>(0x87F00000u))));
}
// Nibble i of each of 16 words (two's complement, bits 4i..4i+3) as a float: a permute of the
// 16 values by its low 4 bits. (i is a constant once the caller's loop is unrolled.)
inline vec vnibble(const int32_t* p, int i) {
  const __m512i w = _mm512_loadu_si512(p);
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  return _mm512_permutexvar_ps(i == 0 ? w : _mm512_srli_epi32(w, 4 * i), values);
}
// A pair of bf16 weights a 32-bit word (k in the high half, k + 1 in the low one) as fp32: the
// high halves, then the low ones, of kLanes words.
inline vec vpair_high(const int32_t* p) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline vec vpair_low(const int32_t* p) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(p), 16)); }
#if defined(__AVX512BF16__)
// INT4 and bf16 weights against bf16 activations, two weights a lane an instruction: vdpbf16ps adds to each lane
// the product of its odd bf16 pair, rounded, then of its even one, rounded (Intel's definition;
// AMD's Zen 5 computes the same bits), which is two fused multiply-adds in that order wherever
// no input or partial sum is subnormal (it flushes those). Lane j's pair from word j: nibble p
// as its even bf16 and nibble p + 4 as its odd one (vpermw reads 5 index bits a 16-bit lane,
// hence the table twice).
constexpr bool kDotPairs = true;
using words = __m512i;
inline words vload_words(const int32_t* p) { return _mm512_loadu_si512(p); }
inline words vnibble_pairs(words w, int p) {
  const __m512i table = _mm512_set_epi16(
      -16512, -16384, -16320, -16256, -16224, -16192, -16160, -16128, 16608, 16576, 16544, 16512, 16448, 16384, 16256, 0,
      -16512, -16384, -16320, -16256, -16224, -16192, -16160, -16128, 16608, 16576, 16544, 16512, 16448, 16384, 16256, 0);
  return _mm512_permutexvar_epi16(p == 0 ? w : _mm512_srli_epi32(w, 4 * p), table);
}
// acc + x_odd * odd + x_even * even, lane by lane; pair: the bf16 bits of x_even | x_odd << 16.
inline vec vdot_pairs(vec acc, uint32_t pair, words q) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)), (__m512bh)q);
}
#else
constexpr bool kDotPairs = false;
#endif
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
// v rounded to bf16 (to nearest even, NaN to 0x7fc0: c10::BFloat16's rounding), as fp32; a bf16
// store keeps its high halves.
inline vec vround_bf16(vec v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void vstore(c10::BFloat16* p, vec v) {
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(vround_bf16(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(high));
}
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec vfloor(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
// 2^n for integral n in [-126, 127]: n + 127 in the exponent bits.
inline vec vexp2i(vec n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline vec vselect_below(vec a, float limit, vec yes, vec no) {  // a < limit ? yes : no
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(limit), _CMP_LT_OQ), no, yes);
}
inline vec vmin(vec a, vec b) { return _mm512_min_ps(a, b); }
// MXFP4 (engine/layers/quantized/mxfp4.py): kLanes bytes, each two e2m1 values (the low nibble
// first), as twice their values (bit 3 the sign: -0 too), by a permute of the 16; and kLanes
// e8m0 scale bytes s as 2^(s - 128) (2^-128 and 2^-127 subnormal), exact, so that the product
// is ldexp(value, s - 127) for every s, 255 included.
inline void vfp4_doubled(const uint8_t* p, vec& low, vec& high) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, -0.f, -1, -2, -3, -4, -6, -8, -12);
  low = _mm512_permutexvar_ps(b, values);  // a lane's low 4 bits pick
  high = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), values);
}
inline vec ve8m0_halved(const uint8_t* p) {
  const __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(s, _mm512_set1_epi32(1)), 23);
  const __m512i subnormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), s);
  const __mmask16 small = _mm512_cmplt_epi32_mask(s, _mm512_set1_epi32(2));
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, subnormal));
}
// Matmul tile (invariant_linear.cpp): rows x blocks of accumulators that fit the registers.
constexpr int kMaxRows = 6;   // 6 rows x 4 blocks = 24 accumulators of the 32 registers
constexpr int kPanel = 4;
// One or two rows on 8 blocks (16 chains of FMAs, where 4 would wait on their latency): for
// INT4, which computes long enough a byte to need it; dense and FP8 weights read at the
// memory's speed on 4 blocks and lose some of it to 8 streams a thread.
constexpr int kWideRows = 2;
constexpr int kWidePanel = 8;
constexpr bool kWideDense = false;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vbroadcast(float v) { return _mm256_set1_ps(v); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vec vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vec vload(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vec vload(const Fp8* p) {
  const __m256i b = _mm256_slli_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 20);
  return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(0x87F00000u))));
}
// Nibble i of each of 8 words, sign-extended: moved to the top, shifted down arithmetically.
inline vec vnibble(const int32_t* p, int i) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(i == 7 ? w : _mm256_slli_epi32(w, 28 - 4 * i), 28));
}
constexpr bool kDotPairs = false;
inline vec vpair_high(const int32_t* p) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline vec vpair_low(const int32_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), 16));
}
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vround_bf16(vec v) {  // as the AVX-512 one
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void vstore(c10::BFloat16* p, vec v) {
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(vround_bf16(v)), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1)));
}
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec vfloor(vec a) { return _mm256_floor_ps(a); }
inline vec vexp2i(vec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline vec vselect_below(vec a, float limit, vec yes, vec no) {
  return _mm256_blendv_ps(no, yes, _mm256_cmp_ps(a, _mm256_set1_ps(limit), _CMP_LT_OQ));
}
inline vec vmin(vec a, vec b) { return _mm256_min_ps(a, b); }
// As the AVX-512 ones: the magnitude by a permute of 8 (its low 3 bits), bit 3 the sign.
inline void vfp4_doubled(const uint8_t* p, vec& low, vec& high) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256 magnitudes = _mm256_setr_ps(0, 1, 2, 3, 4, 6, 8, 12);
  auto value = [&](__m256i n) {
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(n, _mm256_set1_epi32(8)), 28);
    return _mm256_xor_ps(_mm256_permutevar8x32_ps(magnitudes, n), _mm256_castsi256_ps(sign));
  };
  low = value(b);
  high = value(_mm256_srli_epi32(b, 4));
}
inline vec ve8m0_halved(const uint8_t* p) {
  const __m256i s = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(s, _mm256_set1_epi32(1)), 23);
  const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), s);
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), s);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, small));
}
constexpr int kMaxRows = 6;   // 6 rows x 1 block (2 vectors) = 12 accumulators of the 16 registers
constexpr int kPanel = 1;
// One row on 4 blocks (8 chains of FMAs, where 2 wait on their latency), every kind of weight.
constexpr int kWideRows = 1;
constexpr int kWidePanel = 4;
constexpr bool kWideDense = true;
#else
constexpr int kLanes = 1;
using vec = float;
inline vec vzero() { return 0.f; }
inline vec vbroadcast(float v) { return v; }
inline vec vfma(vec a, vec b, vec c) { return std::fma(a, b, c); }
inline vec vadd(vec a, vec b) { return a + b; }
inline vec vload(const float* p) { return *p; }
inline vec vload(const uint8_t* p) { return static_cast<float>(*p); }
inline vec vload(const int8_t* p) { return static_cast<float>(*p); }
inline vec vload(const c10::BFloat16* p) { return static_cast<float>(*p); }
inline vec vload(const Fp8* p) {
  const uint32_t bits = (static_cast<uint32_t>(p->bits & 0x80) << 24) | (static_cast<uint32_t>(p->bits & 0x7f) << 20);
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
inline vec vnibble(const int32_t* p, int i) {
  return static_cast<float>(static_cast<int32_t>(static_cast<uint32_t>(*p) << (28 - 4 * i)) >> 28);
}
constexpr bool kDotPairs = false;
inline vec vpair_high(const int32_t* p) {
  const uint32_t bits = static_cast<uint32_t>(*p) & 0xffff0000u;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
inline vec vpair_low(const int32_t* p) {
  const uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
inline void vstore(float* p, vec v) { *p = v; }
inline void vstore(c10::BFloat16* p, vec v) { *p = c10::BFloat16(v); }
inline vec vround_bf16(vec v) { return static_cast<float>(c10::BFloat16(v)); }
inline vec vmul(vec a, vec b) { return a * b; }
inline vec vsub(vec a, vec b) { return a - b; }
inline vec vdiv(vec a, vec b) { return a / b; }
inline vec vmax(vec a, vec b) { return a > b ? a : b; }
inline vec vfloor(vec a) { return std::floor(a); }
inline vec vexp2i(vec n) {
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
inline vec vselect_below(vec a, float limit, vec yes, vec no) { return a < limit ? yes : no; }
inline vec vmin(vec a, vec b) { return a < b ? a : b; }
inline void vfp4_doubled(const uint8_t* p, vec& low, vec& high) {
  static constexpr float kValues[16] = {0, 1, 2, 3, 4, 6, 8, 12, -0.f, -1, -2, -3, -4, -6, -8, -12};
  low = kValues[*p & 0xF];
  high = kValues[*p >> 4];
}
inline vec ve8m0_halved(const uint8_t* p) {
  const uint32_t s = *p, bits = s < 2 ? 0x00200000u << s : (s - 1) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
constexpr int kMaxRows = 4;
constexpr int kPanel = 1;
constexpr int kWideRows = 1;
constexpr int kWidePanel = 1;
constexpr bool kWideDense = false;
#endif

// Keeps v in a register from here on (no instruction: an empty asm that may have changed it).
// Otherwise GCC folds the load of a vector that several FMAs use into each of them, loading it
// again for every use: a 4 x 4 tile then loads 20 vectors a step where 8 suffice.
inline void in_register(vec& v) { asm("" : "+v"(v)); }

constexpr int kBlock = 16;            // lanes of one virtual 16-wide vector
constexpr int kVecs = kBlock / kLanes;  // native vectors per virtual one

// The 16 lanes of one virtual vector (acc[0..kVecs)) summed as one fixed tree on every build:
// s8[i] = l[i] + l[i+8], s4[i] = s8[i] + s8[i+4], then (s4[0] + s4[2]) + (s4[1] + s4[3]).
// Of any 16 values with an add (invariant_attention.cpp adds vectors of 16 rows' lanes).
template <typename V, typename Add>
inline V tree_sum16(const V* l, Add&& add) {
  V s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = add(l[i], l[i + 8]);
  for (int i = 0; i < 4; ++i) s4[i] = add(s8[i], s8[i + 4]);
  return add(add(s4[0], s4[2]), add(s4[1], s4[3]));
}
inline float tree_sum16(const float* l) {
  return tree_sum16(l, [](float a, float b) { return a + b; });
}
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
inline float tree_sum8(__m256 s8) {  // the tree from s8 on, in SSE: the same adds as tree_sum16
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));  // (s4[0] + s4[2]), (s4[1] + s4[3])
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif
#if defined(__AVX512F__)
inline float vtree_sum(const vec* acc) {
  return tree_sum8(_mm256_add_ps(_mm512_castps512_ps256(acc[0]),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[0]), 1))));
}
// tree_sum16 of 16 accumulators (one a key, or an output) at once: the same adds, paired across keys by
// shuffles instead of within each (16 sums in 15 adds and 31 shuffles, not 16 x 8). Returns
// the sums in key order.
__attribute__((always_inline)) inline __m512 tree_sum16_x16(const __m512* a) {
  __m512 s8[8], s4[4], s2[2];
  for (int j = 0; j < 8; ++j)  // l[i] + l[i+8]: key 2j in lanes 0-7, key 2j+1 in lanes 8-15
    s8[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x44),
                          _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xEE));
  for (int j = 0; j < 4; ++j)  // s8[i] + s8[i+4]: 128-bit chunk c holds key 4j + c
    s4[j] = _mm512_add_ps(_mm512_shuffle_f32x4(s8[2 * j], s8[2 * j + 1], 0x88),
                          _mm512_shuffle_f32x4(s8[2 * j], s8[2 * j + 1], 0xDD));
  for (int j = 0; j < 2; ++j)  // (s4[0] + s4[2]), (s4[1] + s4[3]): chunk c holds keys 8j + c, 8j + 4 + c
    s2[j] = _mm512_add_ps(_mm512_shuffle_ps(s4[2 * j], s4[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(s4[2 * j], s4[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // s2[0] + s2[1]: lane 4c + j holds key 4j + c
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}
// The same for 8 accumulators: their sums in lanes 0-7, in order (the upper lanes repeat them).
__attribute__((always_inline)) inline __m512 tree_sum16_x8(const __m512* a) {
  __m512 s8[4], s4[2];
  for (int j = 0; j < 4; ++j)
    s8[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x44),
                          _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xEE));
  for (int j = 0; j < 2; ++j)
    s4[j] = _mm512_add_ps(_mm512_shuffle_f32x4(s8[2 * j], s8[2 * j + 1], 0x88),
                          _mm512_shuffle_f32x4(s8[2 * j], s8[2 * j + 1], 0xDD));
  // chunk c: lanes 0, 1 key c's (s4[0] + s4[2]), (s4[1] + s4[3]); lanes 2, 3 key 4 + c's
  const __m512 s2 = _mm512_add_ps(_mm512_shuffle_ps(s4[0], s4[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_ps(s4[0], s4[1], _MM_SHUFFLE(3, 2, 3, 2)));
  // lane 4c holds key c, lane 4c + 1 key 4 + c
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(s2, s2, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(s2, s2, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 4, 8, 12, 1, 5, 9, 13), sums);
}
#elif defined(__AVX2__) && defined(__FMA__)
inline float vtree_sum(const vec* acc) { return tree_sum8(_mm256_add_ps(acc[0], acc[1])); }
#else
inline float vtree_sum(const vec* acc) { return tree_sum16(acc); }
#endif

// vtree_sum of n accumulators (one virtual vector each) into out[0, n): with AVX-512 16, then 8,
// at a time, paired by shuffles (a 6 x 4 matmul tile's 24 trees in ~70 instructions, not ~190),
// the same adds either way.
__attribute__((always_inline)) inline void vtree_sums(const vec* a, int n, float* out) {
  int i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) vstore(out + i, tree_sum16_x16(a + i));
  if (i + 8 <= n) {
    float sums[16];
    vstore(sums, tree_sum16_x8(a + i));
    for (int j = 0; j < 8; ++j) out[i + j] = sums[j];
    i += 8;
  }
#endif
  for (; i < n; ++i) out[i] = vtree_sum(a + i * kVecs);
}

// exp(x) for x <= 0 (softmax's shifted scores), lane by lane in the same operations on every
// build: x = n ln2 + r, a degree-6 polynomial in r (Cephes' expf), times 2^n; 0 below -87.
inline vec vexp_nonpositive(vec x) {
  const vec n = vfloor(vfma(x, vbroadcast(1.44269504088896341f), vbroadcast(0.5f)));
  vec r = vfma(n, vbroadcast(-0.693359375f), x);
  r = vfma(n, vbroadcast(2.12194440e-4f), r);
  vec p = vbroadcast(1.9875691500e-4f);
  p = vfma(p, r, vbroadcast(1.3981999507e-3f));
  p = vfma(p, r, vbroadcast(8.3334519073e-3f));
  p = vfma(p, r, vbroadcast(4.1665795894e-2f));
  p = vfma(p, r, vbroadcast(1.6666665459e-1f));
  p = vfma(p, r, vbroadcast(5.0000001201e-1f));
  p = vadd(vfma(p, vmul(r, r), r), vbroadcast(1.f));
  const vec safe_n = vselect_below(x, -87.f, vbroadcast(0.f), n);
  return vselect_below(x, -87.f, vzero(), vmul(p, vexp2i(safe_n)));
}

// sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(-|g|) (vec.h's exp, for
// arguments <= 0): the same operations in every lane and on every build.
inline vec vsigmoid(vec g) {
  const vec e = vexp_nonpositive(vsub(vzero(), vmax(g, vsub(vzero(), g))));
  return vdiv(vselect_below(g, 0.f, e, vbroadcast(1.f)), vadd(vbroadcast(1.f), e));
}

// silu(g) * u = g * sigmoid(g) * u in fp32; for a bf16 output silu is rounded to bf16 before the
// product too, as eager torch's SiLU then mul do.
template <typename T>
inline vec vsilu_times(vec g, vec u) {
  const vec silu = vmul(g, vsigmoid(g));
  return vmul(std::is_same_v<T, float> ? silu : vround_bf16(silu), u);
}

// out[j] = f(a[j], b[j]) for j < n in whole vectors, then one zero-padded vector for the rest: a
// value's bits never depend on where it falls (eager torch computes a scalar tail, and where a
// thread's share ends, with another exp than its vectors').
template <typename T, typename F>
inline void each_vector(const T* a, const T* b, T* out, int64_t n, F f) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) vstore(out + j, f(vload(a + j), vload(b + j)));
  if (j < n) {
    T pa[kLanes] = {}, pb[kLanes] = {}, po[kLanes];
    std::copy(a + j, a + n, pa);
    std::copy(b + j, b + n, pb);
    vstore(po, f(vload(pa), vload(pb)));
    std::copy(po, po + (n - j), out + j);
  }
}

}  // namespace tandem_vec
