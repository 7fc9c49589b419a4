// The batch-invariant matmul: y = x @ W.T (+ bias) where every output element is summed in one
// fixed order, in fp32: a chain of fused multiply-adds from zero over each chunk of kChunk
// consecutive k (k = 0..255, 256..511, ...), and the chunks' sums added in order (shorter
// chains than one over all of K: about as accurate as a blocked BLAS). Nothing about the call
// changes that order: not the number of rows, not which rows share a
// register tile, not the threads (work is split over rows and columns, never over k), not the
// vector width (lanes run along the output columns; an AVX-512 lane, an AVX2 lane and the scalar
// std::fma compute the same chain). So a token's row is the same bits alone, in a batch of any
// size, cached or not, and on every x86-64 CPU with FMA. See engine/layers/linear.py.
//
// The weight is packed once at load into blocks of 16 output columns, k-major within a block:
// packed [ceil(N / 16), K, 16] (zero columns past N), fp32 or bf16, or FP8 block-quantized
// bytes (uint8) with fp32 `scales` [ceil(N / 128), ceil(K / 128)] (each 128 x 128 block's scale
// times 2^120, engine/layers/fp8.py): a weight is then its byte's value times its block's scale,
// one fp32 rounding, as transformers dequantizes. bf16 weights and inputs are widened exactly to
// fp32; the fp32 result is rounded once to the output dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "vec.h"

namespace {

using at::Tensor;
using namespace tandem_vec;

constexpr int64_t kChunk = 256;  // k per summed chunk: part of the numerics, never tuned per CPU

// One chunk [k0, k1) of R rows x B consecutive blocks: acc = sum over the chunk of x[r, k] * W[n, k],
// k in order, then out = acc (the first chunk) or out += acc. x: fp32 rows (stride ldx); w: the
// panel's first block (blocks K * 16 apart); out: fp32 [R, B * 16] (stride ldo).
// `scale`: FP8's block scales for these columns (one per 128 k), else null.
template <int R, int B, typename W>
inline void tile(const float* x, int64_t ldx, const W* w, const float* scale, int64_t K, int64_t k0, int64_t k1,
                 float* out, int64_t ldo) {
  vec acc[R][B * kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < B * kVecs; ++v) acc[r][v] = vzero();
  for (int64_t k = k0; k < k1; ++k) {
    vec wv[B * kVecs];
    for (int b = 0; b < B; ++b)
      for (int v = 0; v < kVecs; ++v) wv[b * kVecs + v] = vload(w + (b * K + k) * kBlock + v * kLanes);
    if constexpr (std::is_same_v<W, Fp8>) {
      const vec s = vbroadcast(scale[k >> 7]);
      for (int v = 0; v < B * kVecs; ++v) wv[v] = vmul(wv[v], s);
    }
    for (int r = 0; r < R; ++r) {
      const vec xv = vbroadcast(x[r * ldx + k]);
      for (int v = 0; v < B * kVecs; ++v) acc[r][v] = vfma(xv, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < B * kVecs; ++v) {
      float* o = out + r * ldo + v * kLanes;
      vstore(o, k0 == 0 ? acc[r][v] : vadd(vload(o), acc[r][v]));
    }
}

template <int B, typename W>
void tile_rows(int rows, const float* x, int64_t ldx, const W* w, const float* scale, int64_t K, int64_t k0,
               int64_t k1, float* out, int64_t ldo) {
  switch (rows) {
    case 1: return tile<1, B>(x, ldx, w, scale, K, k0, k1, out, ldo);
    case 2: return tile<2, B>(x, ldx, w, scale, K, k0, k1, out, ldo);
    case 3: return tile<3, B>(x, ldx, w, scale, K, k0, k1, out, ldo);
    case 4: return tile<4, B>(x, ldx, w, scale, K, k0, k1, out, ldo);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    case 5: return tile<5, B>(x, ldx, w, scale, K, k0, k1, out, ldo);
    case 6: return tile<6, B>(x, ldx, w, scale, K, k0, k1, out, ldo);
#endif
  }
}

// Rows [m0, m1) x blocks [b0, b1) into the fp32 scratch y [M, NB * 16], a chunk of k at a time
// over every row (the chunk's weights stay in cache while the rows pass over them).
// scales: FP8's [ceil(N / 128), ceil(K / 128)], else null. A panel's blocks share a 128-column
// group of scales (kPanel * 16 divides 128).
template <typename W>
void panel(const float* x, int64_t ldx, const W* packed, const float* scales, int64_t K, int64_t m0, int64_t m1,
           int64_t b0, int64_t b1, float* y, int64_t ldy) {
  static_assert(128 % (kPanel * kBlock) == 0);
  const int64_t scale_cols = (K + 127) / 128;
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t k1 = std::min(K, k0 + kChunk);
    for (int64_t b = b0; b < b1; b += kPanel) {
      const int64_t nb = std::min<int64_t>(kPanel, b1 - b);
      const W* w = packed + b * K * kBlock;
      const float* scale = scales ? scales + (b * kBlock / 128) * scale_cols : nullptr;
      for (int64_t m = m0; m < m1; m += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m1 - m));
        const float* xr = x + m * ldx;
        float* yr = y + m * ldy + b * kBlock;
        // Fewer blocks at the right edge: one block at a time (the same sums, a narrower tile).
        if (nb == kPanel) {
          tile_rows<kPanel>(rows, xr, ldx, w, scale, K, k0, k1, yr, ldy);
        } else {
          for (int64_t j = 0; j < nb; ++j)
            tile_rows<1>(rows, xr, ldx, w + j * K * kBlock, scale, K, k0, k1, yr + j * kBlock, ldy);
        }
      }
    }
  }
}

template <typename T>
void finish(const float* y, int64_t ldy, const Tensor& bias, T* out, int64_t M, int64_t N) {
  const T* bp = bias.defined() ? bias.data_ptr<T>() : nullptr;
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t n = 0; n < N; ++n) {
        const float v = y[m * ldy + n];
        out[m * N + n] = static_cast<T>(bp ? v + static_cast<float>(bp[n]) : v);
      }
  });
}

// packed: [NB, K, 16] in x's dtype; x: [M, K] (rows contiguous); out: [M, N].
Tensor linear(const Tensor& x, const Tensor& packed, const c10::optional<Tensor>& bias_opt, int64_t N,
              const c10::optional<Tensor>& scales_opt) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "tandem invariant_linear: x must be [rows, in], rows contiguous");
  const bool fp8 = packed.scalar_type() == at::kByte;
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlock && packed.is_contiguous() && packed.size(1) == x.size(1) &&
                  (fp8 || packed.scalar_type() == x.scalar_type()) && packed.size(0) * kBlock >= N,
              "tandem invariant_linear: the packed weight must be [ceil(out / 16), in, 16] in x's dtype or FP8 bytes");
  TORCH_CHECK(fp8 == scales_opt.has_value(), "tandem invariant_linear: FP8 bytes come with their block scales");
  const Tensor scales = fp8 ? scales_opt->contiguous() : Tensor();
  TORCH_CHECK(!fp8 || (scales.scalar_type() == at::kFloat && scales.size(0) == (N + 127) / 128 &&
                       scales.size(1) == (x.size(1) + 127) / 128),
              "tandem invariant_linear: FP8 scales must be float32 [ceil(out / 128), ceil(in / 128)]");
  const Tensor bias = bias_opt.has_value() ? bias_opt->contiguous() : Tensor();
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), ldy = NB * kBlock;
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  // fp32 scratch: the accumulators as they leave the registers (whole blocks, so no masked stores).
  auto y = at::empty({M, ldy}, x.options().dtype(at::kFloat));
  const Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  const float* xp = xf.data_ptr<float>();
  const int64_t ldx = xf.stride(0);
  // Work items: a panel of blocks x a chunk of rows (never a range of k).
  const int64_t panels = (NB + kPanel - 1) / kPanel;
  const int64_t row_chunk = kMaxRows * 8;
  const int64_t chunks = (M + row_chunk - 1) / row_chunk;
  float* yp = y.data_ptr<float>();
  const float* sp = fp8 ? scales.data_ptr<float>() : nullptr;
  auto run = [&](const auto* wp) {
    at::parallel_for(0, panels * chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t p = item % panels, c = item / panels;
        const int64_t m0 = c * row_chunk, m1 = std::min(M, m0 + row_chunk);
        panel(xp, ldx, wp, sp, K, m0, m1, p * kPanel, std::min(NB, (p + 1) * kPanel), yp, ldy);
      }
    });
  };
  const Fp8* fp8_weights = fp8 ? reinterpret_cast<const Fp8*>(packed.data_ptr<uint8_t>()) : nullptr;
  if (x.scalar_type() == at::kFloat) {
    fp8 ? run(fp8_weights) : run(packed.data_ptr<float>());
    finish<float>(yp, ldy, bias, out.data_ptr<float>(), M, N);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "tandem invariant_linear: fp32 or bf16 only");
    fp8 ? run(fp8_weights) : run(packed.data_ptr<c10::BFloat16>());
    finish<c10::BFloat16>(yp, ldy, bias, out.data_ptr<c10::BFloat16>(), M, N);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(TANDEM_OPS_NAMESPACE, m) {
  m.def("invariant_linear(Tensor x, Tensor packed, Tensor? bias, int out_features, Tensor? scales=None) -> Tensor",
        &linear);
}
