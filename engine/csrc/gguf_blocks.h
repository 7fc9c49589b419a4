// GGUF's quantized blocks (llama.cpp's ggml types) dequantized as gguf-py's reference
// `dequantize` computes them: each product exact in fp32, then at most one rounding (d * q + m,
// or (d * scale) * q), so the weights are bit for bit gguf-py's on every build. For
// gguf_linear.cpp, which multiplies by them without storing them dequantized.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <cstring>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace tandem_gguf __attribute__((visibility("hidden"))) {

using namespace tandem_vec;

// ggml_type's numbers (gguf-py's GGMLQuantizationType).
enum Kind : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct BlockLayout {
  int64_t weights, bytes;  // a block's
};

inline BlockLayout layout_of(int64_t kind) {
  switch (kind) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
  }
  TORCH_CHECK(false, "tandem gguf: no kernel for ggml type ", kind);
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // exact, as the portable conversion
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// The K-quants' eight 6-bit scales and mins, packed in 12 bytes (ggml's get_scale_min_k4).
inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// 16 weights from their quantized values q (bytes), as gguf-py computes them: d * (q - zero),
// d * q + m or d * q - m. Each product is exact in fp32 (an fp16 scale, at most a 6-bit
// sub-scale, a value under 64), so every build's vector code rounds once, where numpy does.
enum class Form { kCentered, kPlusMin, kMinusMin };

template <Form F, typename Q>
inline void put16(const Q* q, float d, float m, float* out) {
  const vec vd = vbroadcast(d), vm = vbroadcast(m);
  for (int v = 0; v < kVecs; ++v) {
    const vec x = vload(q + v * kLanes);
    vec w;
    if constexpr (F == Form::kCentered)
      w = vmul(vd, vsub(x, vm));  // m: the zero point, whole, so q - zero is exact
    else if constexpr (F == Form::kPlusMin)
      w = vadd(vmul(vd, x), vm);
    else
      w = vsub(vmul(vd, x), vm);
    vstore(out + v * kLanes, w);
  }
}

// 16 weights that are 4-bit values (byte l's bits shift..shift+3) of one scale: d * (q - zero),
// d * q + m or d * q - m. With AVX-512 the 16 weights those 4 bits can give are computed once, as
// a register, and each value picks its lane of it (the same bits: each is computed as above).
template <Form F>
struct NibbleWeights {
#if defined(__AVX512F__)
  __m512 table;
  NibbleWeights(float d, float m) {
    const vec iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const vec vd = vbroadcast(d), vm = vbroadcast(m);
    table = F == Form::kCentered ? vmul(vd, vsub(iota, vm)) : F == Form::kPlusMin ? vadd(vmul(vd, iota), vm)
                                                                                 : vsub(vmul(vd, iota), vm);
  }
  vec pick(const uint8_t* bytes, int shift) const {
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    if (shift) q = _mm512_srli_epi32(q, shift);
    return _mm512_permutexvar_ps(q, table);  // the low 4 bits pick
  }
  void put16(const uint8_t* bytes, int shift, float* out) const { vstore(out, pick(bytes, shift)); }
#else
  float d, m;
  NibbleWeights(float d_, float m_) : d(d_), m(m_) {}
  void put16(const uint8_t* bytes, int shift, float* out) const {
    uint8_t q[16];
    for (int l = 0; l < 16; ++l) q[l] = static_cast<uint8_t>((bytes[l] >> shift) & 0xF);
    tandem_gguf::put16<F>(q, d, m, out);
  }
#endif
};

// One block's weights into out, each as gguf-py's dequantize_blocks computes it: the values of
// 16 consecutive weights gathered as bytes (each run one shift of consecutive bytes), then
// scaled in vectors. The 32-weight types keep weight e < 16 in byte e's low nibble, e >= 16 in
// byte e - 16's high one.
template <int64_t K>
inline void dequantize_block(const uint8_t* b, float* out) {
  uint8_t q[16];
  if constexpr (K == Q8_0) {
    const float d = half_at(b);
    const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
    put16<Form::kCentered>(qs, d, 0.0f, out);
    put16<Form::kCentered>(qs + 16, d, 0.0f, out + 16);
  } else if constexpr (K == Q4_0 || K == Q4_1) {
    const float d = half_at(b);
    const uint8_t* qs = b + (K == Q4_1 ? 4 : 2);
    if constexpr (K == Q4_1) {
      const NibbleWeights<Form::kPlusMin> w(d, half_at(b + 2));
      w.put16(qs, 0, out);
      w.put16(qs, 4, out + 16);
    } else {
      const NibbleWeights<Form::kCentered> w(d, 8.0f);
      w.put16(qs, 0, out);
      w.put16(qs, 4, out + 16);
    }
  } else if constexpr (K == Q5_0 || K == Q5_1) {
    constexpr bool with_min = K == Q5_1;
    constexpr int at = with_min ? 4 : 2;  // qh after d (and m)
    const float d = half_at(b), m = with_min ? half_at(b + 2) : 16.0f;
    uint32_t qh;
    std::memcpy(&qh, b + at, 4);
    const uint8_t* qs = b + at + 4;
    for (int half = 0; half < 2; ++half) {
      for (int e = 0; e < 16; ++e)
        q[e] = static_cast<uint8_t>(((qs[e] >> (4 * half)) & 0xF) | (((qh >> (16 * half + e)) & 1) << 4));
      if constexpr (with_min)
        put16<Form::kPlusMin>(q, d, m, out + 16 * half);
      else
        put16<Form::kCentered>(q, d, m, out + 16 * half);
    }
  } else if constexpr (K == Q4_K || K == Q5_K) {
    // d, dmin, 12 bytes of scales and mins, (Q5_K: 32 bytes of fifth bits,) 128 of nibbles: in
    // chunks of 32 bytes, sub-block 2c in chunk c's low nibbles, 2c + 1 in its high ones.
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + (K == Q5_K ? 48 : 16);
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      scale_min_k4(scales, j, sc, m);
      const float ds = d * static_cast<float>(sc), dm = dmin * static_cast<float>(m);
      const uint8_t* chunk = qs + (j / 2) * 32;
      if constexpr (K == Q4_K) {
        const NibbleWeights<Form::kMinusMin> w(ds, dm);
        w.put16(chunk, 4 * (j % 2), out + j * 32);
        w.put16(chunk + 16, 4 * (j % 2), out + j * 32 + 16);
      } else {
        for (int half = 0; half < 2; ++half) {
          for (int l = 0; l < 16; ++l)
            q[l] = static_cast<uint8_t>(((chunk[16 * half + l] >> (4 * (j % 2))) & 0xF) |
                                        (((qh[16 * half + l] >> j) & 1) << 4));
          put16<Form::kMinusMin>(q, ds, dm, out + j * 32 + 16 * half);
        }
      }
    }
  } else if constexpr (K == Q6_K) {
    // ql[128], qh[64], 16 int8 scales (a sub-block of 16 each), d. Weight e = 128h + 32g + l:
    // low nibble from ql[64h + 32 (g % 2) + l] (shifted 4 for g >= 2), high two bits from
    // qh[32h + l] (shifted 2g).
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int h = 0; h < 2; ++h)
      for (int g = 0; g < 4; ++g)
        for (int half = 0; half < 2; ++half) {
          const int e0 = 128 * h + 32 * g + 16 * half;
          const uint8_t* low = ql + 64 * h + 32 * (g % 2) + 16 * half;
          const uint8_t* high = qh + 32 * h + 16 * half;
          for (int l = 0; l < 16; ++l)
            q[l] = static_cast<uint8_t>(((low[l] >> (4 * (g / 2))) & 0xF) | (((high[l] >> (2 * g)) & 3) << 4));
          put16<Form::kCentered>(q, d * static_cast<float>(scales[e0 / 16]), 32.0f, out + e0);
        }
  }
}

template <int64_t K>
constexpr BlockLayout kLayout = K == Q4_0   ? BlockLayout{32, 18}
                                : K == Q4_1 ? BlockLayout{32, 20}
                                : K == Q5_0 ? BlockLayout{32, 22}
                                : K == Q5_1 ? BlockLayout{32, 24}
                                : K == Q8_0 ? BlockLayout{32, 34}
                                : K == Q4_K ? BlockLayout{256, 144}
                                : K == Q5_K ? BlockLayout{256, 176}
                                            : BlockLayout{256, 210};

#if defined(__AVX512F__)
// The 4-bit types' runs of 32 weights of one scale (Q4_0, Q4_1: a block; Q4_K: a sub-block), to
// each(e, w, lo, lo_shift, hi, hi_shift): weight e + l at bits lo_shift.. of byte lo[l], weight
// e + 16 + l at bits hi_shift.. of hi[l], w the 16 weights their scale gives.
template <int64_t K, typename Each>
inline void nibble_runs(const uint8_t* b, Each&& each) {
  static_assert(K == Q4_0 || K == Q4_1 || K == Q4_K);
  if constexpr (K == Q4_0 || K == Q4_1) {
    const uint8_t* qs = b + (K == Q4_1 ? 4 : 2);
    const NibbleWeights<K == Q4_1 ? Form::kPlusMin : Form::kCentered> w(half_at(b), K == Q4_1 ? half_at(b + 2) : 8.0f);
    each(0, w, qs, 0, qs, 4);
  } else {
    const float d = half_at(b), dmin = half_at(b + 2);
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      scale_min_k4(b + 4, j, sc, m);
      const NibbleWeights<Form::kMinusMin> w(d * static_cast<float>(sc), dmin * static_cast<float>(m));
      const uint8_t* chunk = b + 16 + (j / 2) * 32;
      each(32 * j, w, chunk, 4 * (j % 2), chunk + 16, 4 * (j % 2));
    }
  }
}
#endif

// A block's weights, 16 at a time, to use(e, w): weights e..e + 15 in w[0..kVecs), the values
// dequantize_block writes. With AVX-512 the common types never leave the registers.
template <int64_t K, typename Use>
inline void block_weights(const uint8_t* b, Use&& use) {
#if defined(__AVX512F__)
  if constexpr (K == Q4_0 || K == Q4_1 || K == Q4_K) {
    nibble_runs<K>(b, [&](int e, const auto& w, const uint8_t* lo, int lo_shift, const uint8_t* hi, int hi_shift) {
      const vec first = w.pick(lo, lo_shift), second = w.pick(hi, hi_shift);
      use(e, &first);
      use(e + 16, &second);
    });
    return;
  } else if constexpr (K == Q8_0) {
    const vec d = vbroadcast(half_at(b));
    for (int e = 0; e < 32; e += 16) {
      const vec w = vmul(vload(reinterpret_cast<const int8_t*>(b + 2 + e)), d);
      use(e, &w);
    }
    return;
  }
#endif
  alignas(64) float w[kLayout<K>.weights];
  dequantize_block<K>(b, w);
  for (int e = 0; e < kLayout<K>.weights; e += 16) {
    vec v[kVecs];
    for (int i = 0; i < kVecs; ++i) v[i] = vload(w + e + i * kLanes);
    use(e, v);
  }
}

}  // namespace tandem_gguf
