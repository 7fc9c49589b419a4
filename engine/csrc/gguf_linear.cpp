// GGUF's quantized weights (llama.cpp's ggml block types) multiplied as the file stores them:
// y = x @ W.T, W [N, K] a row of blocks per output (engine/layers/quantized/gguf.py).
//
// Each weight is dequantized inside the matmul with the very expression gguf-py's reference
// `dequantize` evaluates (its product exact in fp32, then at most one rounding: d * q + m, or
// (d * scale) * q), so the weights summed are bit for bit gguf-py's. A work item takes four
// outputs and 96 rows (64 with AVX2): it dequantizes the four outputs' rows once into a scratch
// of K floats each (in L1 or L2), then sums every row against them. Up to four rows (decode) nothing would share
// the scratch, so the weights go from registers into the sums (sum_direct); with AVX-512 a
// 4-bit block's 16 possible weights are one register that each value picks its lane of.
//
// The sums are batch-invariant and the same on every build: an output is 16 chains of fused
// multiply-adds, chain j over k = j, j + 16, j + 32, ... in order, then the 16 chains added in a
// fixed tree (j + 8 onto j, then + 4, + 2, + 1). An AVX-512 vector is one set of 16 chains, two
// AVX2 vectors or 16 scalars the same, and nothing about the call (rows, threads, which item a
// thread takes) changes what any output sums.

#include <ATen/ATen.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstring>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

using at::Tensor;
using namespace tandem_vec;

// ggml_type's numbers (gguf-py's GGMLQuantizationType).
enum Kind : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct BlockLayout {
  int64_t weights, bytes;  // a block's
};

BlockLayout layout_of(int64_t kind) {
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
    ::put16<F>(q, d, m, out);
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

// A block's weights, 16 at a time, to use(e, w): weights e..e + 15 in w[0..kVecs), the values
// dequantize_block writes. With AVX-512 the common types never leave the registers.
template <int64_t K, typename Use>
inline void block_weights(const uint8_t* b, Use&& use) {
#if defined(__AVX512F__)
  if constexpr (K == Q4_0 || K == Q4_1) {
    const uint8_t* qs = b + (K == Q4_1 ? 4 : 2);
    const NibbleWeights<K == Q4_1 ? Form::kPlusMin : Form::kCentered> w(half_at(b), K == Q4_1 ? half_at(b + 2) : 8.0f);
    const vec low = w.pick(qs, 0), high = w.pick(qs, 4);
    use(0, &low);
    use(16, &high);
    return;
  } else if constexpr (K == Q8_0) {
    const vec d = vbroadcast(half_at(b));
    for (int e = 0; e < 32; e += 16) {
      const vec w = vmul(vload(reinterpret_cast<const int8_t*>(b + 2 + e)), d);
      use(e, &w);
    }
    return;
  } else if constexpr (K == Q4_K) {
    const float d = half_at(b), dmin = half_at(b + 2);
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      scale_min_k4(b + 4, j, sc, m);
      const NibbleWeights<Form::kMinusMin> w(d * static_cast<float>(sc), dmin * static_cast<float>(m));
      const uint8_t* chunk = b + 16 + (j / 2) * 32;
      const vec first = w.pick(chunk, 4 * (j % 2)), second = w.pick(chunk + 16, 4 * (j % 2));
      use(32 * j, &first);
      use(32 * j + 16, &second);
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

template <int64_t K>
void dequantize_row_as(const uint8_t* row, int64_t cols, float* out) {
  constexpr BlockLayout l = kLayout<K>;
  for (int64_t i = 0; i < cols / l.weights; ++i) dequantize_block<K>(row + i * l.bytes, out + i * l.weights);
}

using DequantizeRow = void (*)(const uint8_t*, int64_t, float*);

DequantizeRow dequantizer(int64_t kind) {
  switch (kind) {
    case Q4_0: return dequantize_row_as<Q4_0>;
    case Q4_1: return dequantize_row_as<Q4_1>;
    case Q5_0: return dequantize_row_as<Q5_0>;
    case Q5_1: return dequantize_row_as<Q5_1>;
    case Q8_0: return dequantize_row_as<Q8_0>;
    case Q4_K: return dequantize_row_as<Q4_K>;
    case Q5_K: return dequantize_row_as<Q5_K>;
    case Q6_K: return dequantize_row_as<Q6_K>;
  }
  TORCH_CHECK(false, "tandem gguf: no kernel for ggml type ", kind);
}

void check_weight(const Tensor& raw, int64_t kind, int64_t K) {
  const BlockLayout l = layout_of(kind);
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.device().is_cpu() && raw.stride(1) == 1,
              "tandem gguf: the weight is uint8 [out, row bytes] on the CPU, rows contiguous");
  TORCH_CHECK(K % l.weights == 0 && raw.size(1) == K / l.weights * l.bytes, "tandem gguf: rows of ", raw.size(1),
              " bytes are not ", K, " weights of ggml type ", kind);
}

constexpr int kChains = 16;      // an output's chains: lane j of a 16-wide accumulator
constexpr int kTileCols = 4;     // outputs a work item dequantizes and a tile sums
constexpr int kDirectRows = 4;  // up to these rows (decode) the weights go from registers into the sums
// Rows a tile sums at once: a 6 x 4 tile's 24 accumulators, 4 weight vectors and a row's fill
// AVX-512's 32 registers (10 loads a step for 24 FMAs; 4 x 4: 8 for 16).
constexpr int kTileRows = kLanes == 16 ? 6 : 4;
constexpr int64_t kItemRows = 16 * kTileRows;  // rows a work item takes

// y[r, c] = the sum over k of x[r, k] * w[c, k], for R rows and C outputs (w: C dequantized rows
// of K, a multiple of 16).
template <int R, int C>
void tile(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  vec acc[R][C][kVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < kVecs; ++v) acc[r][c][v] = vzero();
  for (int64_t k = 0; k < K; k += kChains) {
    vec wv[C][kVecs];
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < kVecs; ++v) {
        wv[c][v] = vload(w + c * K + k + v * kLanes);
        in_register(wv[c][v]);
      }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVecs; ++v) {
        vec xv = vload(x + r * ldx + k + v * kLanes);
        in_register(xv);
        for (int c = 0; c < C; ++c) acc[r][c][v] = vfma(xv, wv[c][v], acc[r][c][v]);
      }
  }
  float sums[R * C];  // a whole tile's trees together
  vtree_sums(&acc[0][0][0], R * C, sums);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = sums[r * C + c];
}

template <int C>
void tile_rows(int rows, const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  switch (rows) {
    case 1: return tile<1, C>(x, ldx, w, K, y, ldy);
    case 2: return tile<2, C>(x, ldx, w, K, y, ldy);
    case 3: return tile<3, C>(x, ldx, w, K, y, ldy);
    case 4: return tile<4, C>(x, ldx, w, K, y, ldy);
    case 5: return tile<5, C>(x, ldx, w, K, y, ldy);
    default: return tile<kTileRows, C>(x, ldx, w, K, y, ldy);
  }
}

void tile_any(int rows, int cols, const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  switch (cols) {
    case 1: return tile_rows<1>(rows, x, ldx, w, K, y, ldy);
    case 2: return tile_rows<2>(rows, x, ldx, w, K, y, ldy);
    case 3: return tile_rows<3>(rows, x, ldx, w, K, y, ldy);
    default: return tile_rows<4>(rows, x, ldx, w, K, y, ldy);
  }
}

// Up to kDirectRows rows of x against C outputs, each weight dequantized in registers and summed
// at once (no scratch): the C outputs' chains run side by side, each in tile's order, so every
// output is the same bits as tile's.
// The next item's rows (a thread takes items in runs), here while this item sums: on a matrix
// larger than the caches, the hardware's prefetchers alone leave the loads waiting.
TANDEM_PREFETCH void prefetch(const uint8_t* p) { __builtin_prefetch(p); }

template <int64_t K, int R, int C>
void sum_direct(const float* x, const uint8_t* w, int64_t ld, int64_t cols, float* y, int64_t ldy) {
  constexpr BlockLayout l = kLayout<K>;
  vec acc[C][R][kVecs];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVecs; ++v) acc[c][r][v] = vzero();
  for (int64_t i = 0; i < cols / l.weights; ++i) {
    const float* xb = x + i * l.weights;
    const bool new_line = (i * l.bytes) % kLine < l.bytes;  // a prefetch a cache line
    for (int c = 0; c < C; ++c) {
      if (new_line) prefetch(w + (c + C) * ld + i * l.bytes);  // the next item's rows
      block_weights<K>(w + c * ld + i * l.bytes, [&](int e, const vec* wv) {
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < kVecs; ++v) acc[c][r][v] = vfma(vload(xb + r * cols + e + v * kLanes), wv[v], acc[c][r][v]);
      });
    }
  }
  float sums[C * R];
  vtree_sums(&acc[0][0][0], C * R, sums);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = sums[c * R + r];
}

template <int64_t K, int R>
void direct_item(const float* x, const uint8_t* w, int64_t ld, int64_t cols, int n, float* y, int64_t ldy) {
  if (n == kTileCols) return sum_direct<K, R, kTileCols>(x, w, ld, cols, y, ldy);
  for (int c = 0; c < n; ++c) sum_direct<K, R, 1>(x, w + c * ld, ld, cols, y + c, ldy);
}

using DirectItem = void (*)(const float*, const uint8_t*, int64_t, int64_t, int, float*, int64_t);

template <int64_t K>
DirectItem direct_for_rows(int64_t rows) {
  switch (rows) {
    case 1: return direct_item<K, 1>;
    case 2: return direct_item<K, 2>;
    case 3: return direct_item<K, 3>;
    default: return direct_item<K, 4>;
  }
}

DirectItem direct_kernel(int64_t kind, int64_t rows) {
  switch (kind) {
    case Q4_0: return direct_for_rows<Q4_0>(rows);
    case Q4_1: return direct_for_rows<Q4_1>(rows);
    case Q5_0: return direct_for_rows<Q5_0>(rows);
    case Q5_1: return direct_for_rows<Q5_1>(rows);
    case Q8_0: return direct_for_rows<Q8_0>(rows);
    case Q4_K: return direct_for_rows<Q4_K>(rows);
    case Q5_K: return direct_for_rows<Q5_K>(rows);
    case Q6_K: return direct_for_rows<Q6_K>(rows);
  }
  TORCH_CHECK(false, "tandem gguf: no kernel for ggml type ", kind);
}

}  // namespace

namespace tandem_ops {

// The weights as the kernel sums them: fp32 [N, K].
Tensor gguf_dequantize(const Tensor& raw, int64_t kind, int64_t K) {
  check_weight(raw, kind, K);
  const int64_t N = raw.size(0);
  Tensor out = at::empty({N, K}, raw.options().dtype(at::kFloat));
  const DequantizeRow row = dequantizer(kind);
  const uint8_t* w = raw.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t ld = raw.stride(0);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) row(w + n * ld, K, o + n * K);
  });
  return out;
}

// y = x @ [W_0; W_1; ...].T, x [M, K] (fp32 or bf16, widened exactly), each W_p GGUF rows of its
// own type (fused q/k/v or gate/up kept apart); y in x's dtype. Each output is computed as it
// would be alone, so one call over the parts is the same bits as a call each.
Tensor gguf_linear(const Tensor& x_in, at::TensorList raws, at::IntArrayRef kinds, int64_t K) {
  TORCH_CHECK(!raws.empty() && raws.size() == kinds.size(), "tandem gguf_linear: a kind for each weight");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "tandem gguf_linear: x is [rows, ", K, "]");
  const Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), row_items = M <= kDirectRows ? 1 : (M + kItemRows - 1) / kItemRows;
  struct Part {
    const uint8_t* w;
    int64_t ld, rows, col_tiles, first_col, first_item;
    DequantizeRow dequantize;
    DirectItem direct;
  };
  std::vector<Part> parts;
  int64_t N = 0, items = 0;
  for (size_t p = 0; p < raws.size(); ++p) {
    check_weight(raws[p], kinds[p], K);
    const int64_t rows = raws[p].size(0), col_tiles = (rows + kTileCols - 1) / kTileCols;
    parts.push_back({raws[p].data_ptr<uint8_t>(), raws[p].stride(0), rows, col_tiles, N, items, dequantizer(kinds[p]),
                     direct_kernel(kinds[p], M)});
    N += rows;
    items += row_items * col_tiles;
  }
  Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y.to(x_in.scalar_type());  // a chunk that samples nothing: no items (each reads rows)
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // A part's items row block by row block, every column tile of one block in turn: the block's
  // rows of x (kItemRows x K floats) stay in L2 while the quantized weights, 7x smaller, stream past
  // (column-major, a prompt's x came from L3 again for every 4 outputs). Up to kDirectRows rows
  // (decode) nothing shares a dequantized row, so none is stored: the direct kernel sums each
  // weight from registers.
  parallel_items(
      items, [&] { return std::vector<float>(M <= kDirectRows ? 0 : kTileCols * K); },
      [&](std::vector<float>& scratch, int64_t item) {
        size_t p = 0;
        while (p + 1 < parts.size() && parts[p + 1].first_item <= item) ++p;
        const Part& part = parts[p];
        const int64_t local = item - part.first_item;
        const int64_t n0 = local % part.col_tiles * kTileCols, m0 = local / part.col_tiles * kItemRows;
        const int cols = static_cast<int>(std::min<int64_t>(kTileCols, part.rows - n0));
        const uint8_t* w = part.w + n0 * part.ld;
        float* out = yp + part.first_col + n0;
        if (M <= kDirectRows) return part.direct(xp, w, part.ld, K, cols, out, N);
        for (int c = 0; c < cols; ++c) part.dequantize(w + c * part.ld, K, scratch.data() + c * K);
        for (int64_t m = m0; m < std::min(M, m0 + kItemRows); m += kTileRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - m));
          tile_any(rows, cols, xp + m * K, K, scratch.data(), K, out + m * N, N);
        }
      });
  return y.to(x_in.scalar_type());
}

}  // namespace tandem_ops

TORCH_LIBRARY_FRAGMENT(TANDEM_OPS_NAMESPACE, m) {
  m.def("gguf_dequantize(Tensor raw, int kind, int in_features) -> Tensor", &tandem_ops::gguf_dequantize);
  m.def("gguf_linear(Tensor x, Tensor[] raws, int[] kinds, int in_features) -> Tensor", &tandem_ops::gguf_linear);
}
