// How gguf_linear.cpp's chains take their products, a unit of k at a time: fp32 x against
// gguf-py's fp32 weights (Fp32Products), or bf16 x against the weights rounded to bf16
// (Bf16Products). Each names a unit's k (kStep) and bytes in memory, loads, stores and packs
// units, and adds a pair of them into an output's 16 chains (dot), in the order the kernel's
// header states on every build.
#pragma once

#include "gguf_blocks.h"
#include "vec.h"

namespace tandem_gguf __attribute__((visibility("hidden"))) {

// fp32 x and gguf-py's fp32 weights: a unit is 16 consecutive k, in order.
struct Fp32Products {
  static constexpr int kStep = 16;           // k a unit holds
  static constexpr int64_t kUnitBytes = 64;  // in memory: 16 floats
  struct Unit {
    vec v[kVecs];
  };
  static Unit load(const uint8_t* p) {
    Unit u;
    for (int v = 0; v < kVecs; ++v) u.v[v] = vload(reinterpret_cast<const float*>(p) + v * kLanes);
    return u;
  }
  static void store(uint8_t* p, const Unit& u) {
    for (int v = 0; v < kVecs; ++v) vstore(reinterpret_cast<float*>(p) + v * kLanes, u.v[v]);
  }
  static void keep(Unit& u) {
    for (int v = 0; v < kVecs; ++v) in_register(u.v[v]);
  }
  static void dot(vec* acc, const Unit& x, const Unit& w) {
    for (int v = 0; v < kVecs; ++v) acc[v] = vfma(x.v[v], w.v[v], acc[v]);
  }
  // A block's weights a unit at a time: use(e, unit of weights e..e + 15).
  template <int64_t K, typename Use>
  static void block_units(const uint8_t* b, Use&& use) {
    block_weights<K>(b, [&](int e, const vec* wv) {
      Unit u;
      for (int v = 0; v < kVecs; ++v) u.v[v] = wv[v];
      use(e, u);
    });
  }
};

// bf16 weights and activations: a unit is 32 consecutive k from k0, lane j the pair k0 + j and
// k0 + 16 + j. With AVX512-BF16 16 words, k0 + j in word j's low half and k0 + 16 + j in its high
// one (vdpbf16ps adds the high product first); elsewhere the two halves' bf16 values as fp32.
struct Bf16Products {
  static constexpr int kStep = 32;
#if defined(__AVX512BF16__)
  static constexpr int64_t kUnitBytes = 64;
  struct Unit {
    __m512i w;
  };
  // lo: 16 fp32 values of k0..k0 + 15, hi: of k0 + 16..k0 + 31, rounded to bf16 (to nearest even;
  // no value here is subnormal) and paired.
  static Unit pack(const vec* lo, const vec* hi) {
    const __m512i halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi[0], lo[0]));  // lo's 16, then hi's
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return {_mm512_permutexvar_epi16(pairs, halves)};
  }
  static Unit load(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
  static void store(uint8_t* p, const Unit& u) { _mm512_storeu_si512(p, u.w); }
  static void keep(Unit& u) { asm("" : "+v"(u.w)); }
  static void dot(vec* acc, const Unit& x, const Unit& w) {
    acc[0] = _mm512_dpbf16_ps(acc[0], reinterpret_cast<__m512bh>(x.w), reinterpret_cast<__m512bh>(w.w));
  }
#else
  static constexpr int64_t kUnitBytes = 128;
  struct Unit {
    vec lo[kVecs], hi[kVecs];
  };
  static Unit pack(const vec* lo, const vec* hi) {
    Unit u;
    for (int v = 0; v < kVecs; ++v) u.lo[v] = vround_bf16(lo[v]), u.hi[v] = vround_bf16(hi[v]);
    return u;
  }
  static Unit load(const uint8_t* p) {
    const float* f = reinterpret_cast<const float*>(p);
    Unit u;
    for (int v = 0; v < kVecs; ++v) u.lo[v] = vload(f + v * kLanes), u.hi[v] = vload(f + kBlock + v * kLanes);
    return u;
  }
  static void store(uint8_t* p, const Unit& u) {
    float* f = reinterpret_cast<float*>(p);
    for (int v = 0; v < kVecs; ++v) vstore(f + v * kLanes, u.lo[v]), vstore(f + kBlock + v * kLanes, u.hi[v]);
  }
  static void keep(Unit& u) {
    for (int v = 0; v < kVecs; ++v) in_register(u.lo[v]), in_register(u.hi[v]);
  }
  static void dot(vec* acc, const Unit& x, const Unit& w) {
    for (int v = 0; v < kVecs; ++v) acc[v] = vfma(x.lo[v], w.lo[v], vfma(x.hi[v], w.hi[v], acc[v]));
  }
#endif
  template <int64_t K, typename Use>
  static void block_units(const uint8_t* b, Use&& use) {
#if defined(__AVX512BF16__)
    // 4-bit weights: a vpermw of the 16 weights a scale gives, rounded (NibbleWeights' table),
    // picks both halves of the 16 pairs at once. Byte l of lo (hi) holds weight l (16 + l) at
    // bits shift.. (shift_hi..); vpermw reads an index's low 5 bits, hence the table twice.
    auto pairs = [](const auto& w, const uint8_t* lo, int shift, const uint8_t* hi, int shift_hi) {
      const __m512i table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w.table, w.table));
      const __m512i l = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)));
      const __m512i h = lo == hi ? l : _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)));
      // high half: h >> shift_hi; the low half's bits above 4 are not read
      const __m512i index = _mm512_or_si512(_mm512_srli_epi32(l, shift), _mm512_slli_epi32(h, 16 - shift_hi));
      return Unit{_mm512_permutexvar_epi16(index, table)};
    };
    if constexpr (K == Q4_0 || K == Q4_1 || K == Q4_K) {
      nibble_runs<K>(b, [&](int e, const auto& w, const uint8_t* lo, int lo_shift, const uint8_t* hi, int hi_shift) {
        use(e, pairs(w, lo, lo_shift, hi, hi_shift));
      });
      return;
    }
#endif
    vec lo[kVecs];
    block_weights<K>(b, [&](int e, const vec* wv) {  // every block is whole units: e = 0, 16, 32, ...
      if (e % kStep == 0)
        for (int v = 0; v < kVecs; ++v) lo[v] = wv[v];
      else
        use(e - kBlock, pack(lo, wv));
    });
  }
};

}  // namespace tandem_gguf
