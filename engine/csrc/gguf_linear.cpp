// GGUF's quantized weights (llama.cpp's ggml block types) multiplied as the file stores them:
// y = x @ W.T, W [N, K] a row of blocks per output (engine/layers/quantized/gguf.py).
//
// Each weight is dequantized inside the matmul with the very expression gguf-py's reference
// `dequantize` evaluates (its product exact in fp32, then at most one rounding: d * q + m, or
// (d * scale) * q), so the weights summed are bit for bit gguf-py's. A work item takes 64 rows
// and four outputs: it dequantizes the four outputs' rows once into a scratch of K floats each
// (in L1 or L2), then sums every row against them.
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
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// A 4-bit value of the 32-weight types: weight e < 16 in byte e's low nibble, e >= 16 in byte
// e - 16's high one.
inline int nibble32(const uint8_t* qs, int e) { return e < 16 ? qs[e] & 0xF : qs[e - 16] >> 4; }

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

// One block's weights into out, each as gguf-py's dequantize_blocks computes it.
template <int64_t K>
inline void dequantize_block(const uint8_t* b, float* out) {
  if constexpr (K == Q8_0) {
    const float d = half_at(b);
    for (int e = 0; e < 32; ++e) out[e] = static_cast<float>(static_cast<int8_t>(b[2 + e])) * d;
  } else if constexpr (K == Q4_0) {
    const float d = half_at(b);
    for (int e = 0; e < 32; ++e) out[e] = d * static_cast<float>(nibble32(b + 2, e) - 8);
  } else if constexpr (K == Q4_1) {
    const float d = half_at(b), m = half_at(b + 2);
    for (int e = 0; e < 32; ++e) out[e] = d * static_cast<float>(nibble32(b + 4, e)) + m;
  } else if constexpr (K == Q5_0 || K == Q5_1) {
    constexpr int at = K == Q5_0 ? 2 : 4;  // qh after d (and m)
    const float d = half_at(b), m = K == Q5_1 ? half_at(b + 2) : 0.0f;
    uint32_t qh;
    std::memcpy(&qh, b + at, 4);
    for (int e = 0; e < 32; ++e) {
      const int q = nibble32(b + at + 4, e) | (((qh >> e) & 1) << 4);
      if constexpr (K == Q5_0)
        out[e] = d * static_cast<float>(q - 16);
      else
        out[e] = d * static_cast<float>(q) + m;
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
      for (int l = 0; l < 32; ++l) {
        int q = (chunk[l] >> (4 * (j % 2))) & 0xF;
        if constexpr (K == Q5_K) q |= ((qh[l] >> j) & 1) << 4;
        out[j * 32 + l] = ds * static_cast<float>(q) - dm;
      }
    }
  } else if constexpr (K == Q6_K) {
    // ql[128], qh[64], 16 int8 scales (a sub-block of 16 each), d. Weight e = 128h + r: low
    // nibble from ql[64h + r % 64] (shifted 4 for r >= 64), high two bits from qh[32h + r % 32]
    // (shifted 2 (r / 32)).
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int e = 0; e < 256; ++e) {
      const int h = e / 128, r = e % 128;
      const int low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0xF;
      const int high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
      const float ds = d * static_cast<float>(scales[e / 16]);
      out[e] = ds * static_cast<float>((low | (high << 4)) - 32);
    }
  }
}

template <int64_t K>
void dequantize_row_as(const uint8_t* row, int64_t cols, float* out) {
  constexpr BlockLayout l = K == Q4_0   ? BlockLayout{32, 18}
                            : K == Q4_1 ? BlockLayout{32, 20}
                            : K == Q5_0 ? BlockLayout{32, 22}
                            : K == Q5_1 ? BlockLayout{32, 24}
                            : K == Q8_0 ? BlockLayout{32, 34}
                            : K == Q4_K ? BlockLayout{256, 144}
                            : K == Q5_K ? BlockLayout{256, 176}
                                        : BlockLayout{256, 210};
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
constexpr int kTileRows = 4;     // rows a tile sums at once
constexpr int64_t kItemRows = 64;  // rows a work item takes

// The 16 chains added in the fixed tree.
inline float add_chains(const vec* acc) {
  float t[kChains];
  for (int v = 0; v < kVecs; ++v) vstore(t + v * kLanes, acc[v]);
  for (int s = kChains / 2; s; s /= 2)
    for (int i = 0; i < s; ++i) t[i] += t[i + s];
  return t[0];
}

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
      for (int v = 0; v < kVecs; ++v) wv[c][v] = vload(w + c * K + k + v * kLanes);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVecs; ++v) {
        const vec xv = vload(x + r * ldx + k + v * kLanes);
        for (int c = 0; c < C; ++c) acc[r][c][v] = vfma(xv, wv[c][v], acc[r][c][v]);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = add_chains(acc[r][c]);
}

template <int C>
void tile_rows(int rows, const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  switch (rows) {
    case 1: return tile<1, C>(x, ldx, w, K, y, ldy);
    case 2: return tile<2, C>(x, ldx, w, K, y, ldy);
    case 3: return tile<3, C>(x, ldx, w, K, y, ldy);
    default: return tile<4, C>(x, ldx, w, K, y, ldy);
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

// y = x @ W.T, x [M, K] (fp32 or bf16, widened exactly), W the GGUF rows; y in x's dtype.
Tensor gguf_linear(const Tensor& x_in, const Tensor& raw, int64_t kind, int64_t K) {
  check_weight(raw, kind, K);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "tandem gguf_linear: x is [rows, ", K, "]");
  const Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), N = raw.size(0), ld = raw.stride(0);
  Tensor y = at::empty({M, N}, x.options());
  const DequantizeRow row = dequantizer(kind);
  const uint8_t* w = raw.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t row_items = (M + kItemRows - 1) / kItemRows, col_items = (N + kTileCols - 1) / kTileCols;
  // Items column tile by column tile, the row blocks of one tile in turn (its rows stay in cache).
  parallel_items(
      row_items * col_items, [&] { return std::vector<float>(kTileCols * K); },
      [&](std::vector<float>& scratch, int64_t item) {
        const int64_t n0 = item / row_items * kTileCols, m0 = item % row_items * kItemRows;
        const int cols = static_cast<int>(std::min<int64_t>(kTileCols, N - n0));
        for (int c = 0; c < cols; ++c) row(w + (n0 + c) * ld, K, scratch.data() + c * K);
        for (int64_t m = m0; m < std::min(M, m0 + kItemRows); m += kTileRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - m));
          tile_any(rows, cols, xp + m * K, K, scratch.data(), K, yp + m * N + n0, N);
        }
      });
  return y.to(x_in.scalar_type());
}

}  // namespace tandem_ops

TORCH_LIBRARY_FRAGMENT(TANDEM_OPS_NAMESPACE, m) {
  m.def("gguf_dequantize(Tensor raw, int kind, int in_features) -> Tensor", &tandem_ops::gguf_dequantize);
  m.def("gguf_linear(Tensor x, Tensor raw, int kind, int in_features) -> Tensor", &tandem_ops::gguf_linear);
}
