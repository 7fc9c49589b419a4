// What paged attention's sums multiply: a unit is an fp32 value, or for bf16 a Word, two bf16
// values side by side (element 2i in its low half, 2i + 1 in its high one). A Word's product
// with another adds the high halves' product, then the low halves', each an FMA: what
// AVX512-BF16's vdpbf16ps does in one lane, and the other builds in two FMAs. bf16 x bf16 is
// exact in fp32, and no packed value is below 2^-55 in magnitude (zeroed when packed), so every
// product and partial sum is 0 or a multiple of 2^-124, never subnormal: vdpbf16ps's flushing
// never shows and every build computes the same bits.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#include "vec.h"

namespace tandem_vec {

struct Word {
  uint32_t bits;
};

constexpr uint16_t kTinyBf16 = 0x2400;  // 2^-55's bf16 bits: smaller magnitudes are packed as 0

inline uint32_t kept_bits(c10::BFloat16 v) { return (v.x & 0x7fff) < kTinyBf16 ? 0u : v.x; }

#if defined(__AVX512BW__)
// 32 bf16 values (the first n < 32 where n is given, the rest zero) with those below 2^-55 zeroed.
inline __m512i kept_values(const c10::BFloat16* from, int n = 32) {
  const __m512i x = _mm512_maskz_loadu_epi16(n >= 32 ? ~0u : (1u << n) - 1, from);
  const __mmask32 tiny = _mm512_cmplt_epu16_mask(_mm512_and_si512(x, _mm512_set1_epi16(0x7fff)),
                                                 _mm512_set1_epi16(static_cast<short>(kTinyBf16)));
  return _mm512_maskz_mov_epi16(~tiny, x);
}
#endif

// n bf16 values as words: the values below 2^-55 zeroed, an odd n's last word and words past
// (n + 1) / 2 up to `words` (whole 16-word vectors) zero; a null row is all zero.
inline void pack_words(const c10::BFloat16* from, int64_t n, Word* to, int64_t words) {
  if (!from) n = 0;
  int64_t i = 0;
#if defined(__AVX512BW__)
  for (; 2 * i + 32 <= n; i += 16) _mm512_storeu_si512(to + i, kept_values(from + 2 * i));
  if (2 * i < n) {
    _mm512_storeu_si512(to + i, kept_values(from + 2 * i, static_cast<int>(n - 2 * i)));  // `words` holds it
    i += 16;
  }
#endif
  uint16_t* half = reinterpret_cast<uint16_t*>(to);
  for (int64_t e = 2 * i; e < 2 * words; ++e) half[e] = e < n ? static_cast<uint16_t>(kept_bits(from[e])) : 0;
}

// Two rows of n bf16 values (a pair of keys' values; a null row: zero) as n words, word e their
// values e, the even row's low.
inline void pack_pair_words(const c10::BFloat16* even, const c10::BFloat16* odd, int64_t n, Word* to) {
  int64_t e = 0;
#if defined(__AVX512BW__)
  if (even && odd)
    for (; e + 32 <= n; e += 32) {
      const __m512i a = kept_values(even + e), b = kept_values(odd + e);
      // unpack pairs values within 128-bit lanes: dims 0-3, 8-11, ... then 4-7, 12-15, ...; the
      // permutes put words back in dim order
      const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
      _mm512_storeu_si512(to + e, _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), hi));
      _mm512_storeu_si512(to + e + 16,
                          _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15), hi));
    }
#endif
  for (; e < n; ++e) to[e].bits = (even ? kept_bits(even[e]) : 0u) | (odd ? kept_bits(odd[e]) : 0u) << 16;
}

inline float word_high(Word w) {
  const uint32_t bits = w.bits & 0xffff0000u;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float word_low(Word w) {
  const uint32_t bits = w.bits << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// acc + a * b for one unit of each.
inline float smac(float acc, float a, float b) { return std::fma(a, b, acc); }
inline float smac(float acc, Word a, Word b) {
  return std::fma(word_low(a), word_low(b), std::fma(word_high(a), word_high(b), acc));
}

// kLanes units loaded (or one broadcast), and acc + a * b lane by lane.
inline vec uload(const float* p) { return vload(p); }
inline vec ubroadcast(float v) { return vbroadcast(v); }
inline vec vmac(vec acc, vec a, vec b) { return vfma(a, b, acc); }
#if defined(__AVX512BF16__)
struct WordVec {
  __m512i w;
};
inline WordVec uload(const Word* p) { return {_mm512_loadu_si512(p)}; }
inline WordVec ubroadcast(Word v) { return {_mm512_set1_epi32(static_cast<int>(v.bits))}; }
inline vec vmac(vec acc, WordVec a, WordVec b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a.w), reinterpret_cast<__m512bh>(b.w));
}
// acc + a * (the word at b, broadcast), the broadcast in the instruction's memory operand (GCC
// otherwise broadcasts in an instruction of its own)
inline vec vmac(vec acc, WordVec a, const Word* b) {
  asm("vdpbf16ps %[b]%{1to16%}, %[a], %[acc]" : [acc] "+v"(acc) : [a] "v"(a.w), [b] "m"(*b));
  return acc;
}
#else
struct WordVec {
  vec high, low;
};
inline WordVec uload(const Word* p) {
  const int32_t* w = reinterpret_cast<const int32_t*>(p);
  return {vpair_high(w), vpair_low(w)};
}
inline WordVec ubroadcast(Word v) { return {vbroadcast(word_high(v)), vbroadcast(word_low(v))}; }
inline vec vmac(vec acc, WordVec a, WordVec b) { return vfma(a.low, b.low, vfma(a.high, b.high, acc)); }
inline vec vmac(vec acc, WordVec a, const Word* b) { return vmac(acc, a, ubroadcast(*b)); }
#endif
inline vec vmac(vec acc, vec a, const float* b) { return vfma(a, vbroadcast(*b), acc); }
template <typename U>
using UnitVec = decltype(uload(static_cast<const U*>(nullptr)));

// Softmax numerators as units: fp32 as they are; for bf16 rounded to bf16 and those below 2^-55
// zeroed, even and odd keys' (or rows') paired into words.
inline vec kept_bf16(vec p) { return vselect_below(p, kTiny, vzero(), vround_bf16(p)); }
inline void store_words(Word* to, vec even, vec odd) {  // both already bf16 values
#if defined(__AVX512F__)
  const __m512i w = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(even), 16), _mm512_castps_si512(odd));
  _mm512_storeu_si512(to, w);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256i w = _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(even), 16), _mm256_castps_si256(odd));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), w);
#else
  uint32_t e, o;
  std::memcpy(&e, &even, 4);
  std::memcpy(&o, &odd, 4);
  to->bits = e >> 16 | o;
#endif
}

}  // namespace tandem_vec
