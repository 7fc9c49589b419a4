// GGUF's quantized weights (llama.cpp's ggml block types) multiplied as the file stores them:
// y = x @ W.T, W [N, K] a row of blocks per output (engine/layers/quantized/gguf.py).
//
// Each weight is dequantized inside the matmul as gguf-py's reference `dequantize` computes it
// (gguf_blocks.h). A work item takes four outputs and 96 rows (64 with AVX2; twice as many of
// bf16 x, as many bytes): it dequantizes the four outputs' rows once into a scratch (in L1 or
// L2), then sums every row against them. Up to four rows (decode) nothing would share the
// scratch, so the weights go from registers into the sums (sum_direct); with AVX-512 a 4-bit
// block's 16 possible weights are one register that each value picks its lane of.
//
// The sums are batch-invariant and the same on every build: an output is 16 chains, then the 16
// chains added in a fixed tree (j + 8 onto j, then + 4, + 2, + 1). An AVX-512 vector is one set
// of 16 chains, two AVX2 vectors or 16 scalars the same, and nothing about the call (rows,
// threads, which item a thread takes) changes what any output sums. The chains take their
// products in one of two ways, by x's dtype (gguf_products.h):
//  - fp32 x (Fp32Products): the weights as gguf-py's fp32, chain j a fused multiply-add of each
//    k = j, j + 16, j + 32, ... in order.
//  - bf16 x (Bf16Products, what a model served in bf16 computes): the weights rounded to bf16,
//    chain j over each 32 k from k0 the product of k0 + 16 + j, then of k0 + j. AVX512-BF16's dot
//    product (vdpbf16ps) takes that pair a lane an instruction, as two fused multiply-adds in
//    that order, which the other builds compute; it flushes subnormals, which never occur: a
//    weight is 0 or at least 2^-24 (gguf's fp16 scales), activations below 2^-55 are zeroed, so
//    every product and partial sum is 0 or a multiple of 2^-93. Twice the products an instruction.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "gguf_blocks.h"
#include "gguf_products.h"
#include "ops.h"
#include "vec.h"

namespace {

using at::Tensor;
using namespace tandem_vec;
using namespace tandem_gguf;


// bf16 x [M, K] as Bf16Products' units, a row of K / 32 (the values below kTiny zeroed).
Tensor bf16_units(const Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), ld = x.stride(0), row = K / Bf16Products::kStep * Bf16Products::kUnitBytes;
  Tensor out = at::empty({M, row}, x.options().dtype(at::kByte));
  const c10::BFloat16* in = x.data_ptr<c10::BFloat16>();
  uint8_t* o = out.data_ptr<uint8_t>();
  auto kept = [&](const c10::BFloat16* p) {
    const vec v = vload(p);
    return vselect_below(vmax(v, vsub(vzero(), v)), kTiny, vzero(), v);
  };
  at::parallel_for(0, M, std::max<int64_t>(1, 4096 / K), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t s = 0; s < K / Bf16Products::kStep; ++s) {
        const c10::BFloat16* p = in + r * ld + s * Bf16Products::kStep;
        vec lo[kVecs], hi[kVecs];
        for (int v = 0; v < kVecs; ++v) lo[v] = kept(p + v * kLanes), hi[v] = kept(p + kBlock + v * kLanes);
        Bf16Products::store(o + r * row + s * Bf16Products::kUnitBytes, Bf16Products::pack(lo, hi));
      }
  });
  return out;
}

// A row of K weights as P's units (the scratch a work item sums against).
template <typename P, int64_t K>
void dequantize_row(const uint8_t* row, int64_t cols, uint8_t* out) {
  constexpr BlockLayout l = kLayout<K>;
  for (int64_t i = 0; i < cols / l.weights; ++i)
    P::template block_units<K>(row + i * l.bytes, [&](int e, const typename P::Unit& u) {
      P::store(out + (i * l.weights + e) / P::kStep * P::kUnitBytes, u);
    });
}

using DequantizeRow = void (*)(const uint8_t*, int64_t, uint8_t*);

template <typename P>
DequantizeRow dequantizer(int64_t kind) {
  switch (kind) {
    case Q4_0: return dequantize_row<P, Q4_0>;
    case Q4_1: return dequantize_row<P, Q4_1>;
    case Q5_0: return dequantize_row<P, Q5_0>;
    case Q5_1: return dequantize_row<P, Q5_1>;
    case Q8_0: return dequantize_row<P, Q8_0>;
    case Q4_K: return dequantize_row<P, Q4_K>;
    case Q5_K: return dequantize_row<P, Q5_K>;
    case Q6_K: return dequantize_row<P, Q6_K>;
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

constexpr int kTileCols = 4;     // outputs a work item dequantizes and a tile sums
constexpr int kDirectRows = 4;  // up to these rows (decode) the weights go from registers into the sums
// Rows a tile sums at once: a 6 x 4 tile's 24 accumulators, 4 weight vectors and a row's fill
// AVX-512's 32 registers (10 loads a step for 24 FMAs; 4 x 4: 8 for 16).
constexpr int kTileRows = kLanes == 16 ? 6 : 4;
constexpr int64_t kItemRows = 16 * kTileRows;  // rows of fp32 x a work item takes

// y[r, c] = the sum over k of x[r, k] * w[c, k], for R rows and C outputs: x and w rows of
// `units` of P's units, ldx and ldw bytes apart.
template <typename P, typename Y, int R, int C>
void tile(const uint8_t* x, int64_t ldx, const uint8_t* w, int64_t ldw, int64_t units, Y* y, int64_t ldy) {
  vec acc[R][C][kVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < kVecs; ++v) acc[r][c][v] = vzero();
  for (int64_t u = 0; u < units; ++u) {
    typename P::Unit wv[C];
    for (int c = 0; c < C; ++c) {
      wv[c] = P::load(w + c * ldw + u * P::kUnitBytes);
      P::keep(wv[c]);
    }
    for (int r = 0; r < R; ++r) {
      typename P::Unit xv = P::load(x + r * ldx + u * P::kUnitBytes);
      P::keep(xv);
      for (int c = 0; c < C; ++c) P::dot(acc[r][c], xv, wv[c]);
    }
  }
  float sums[R * C];  // a whole tile's trees together
  vtree_sums(&acc[0][0][0], R * C, sums);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = static_cast<Y>(sums[r * C + c]);
}

template <typename Y>
using Tile = void (*)(const uint8_t*, int64_t, const uint8_t*, int64_t, int64_t, Y*, int64_t);

template <typename P, typename Y, int C>
Tile<Y> tile_for_rows(int rows) {
  switch (rows) {
    case 1: return tile<P, Y, 1, C>;
    case 2: return tile<P, Y, 2, C>;
    case 3: return tile<P, Y, 3, C>;
    case 4: return tile<P, Y, 4, C>;
    case 5: return tile<P, Y, 5, C>;
    default: return tile<P, Y, kTileRows, C>;
  }
}

template <typename P, typename Y>
Tile<Y> tile_for(int rows, int cols) {
  switch (cols) {
    case 1: return tile_for_rows<P, Y, 1>(rows);
    case 2: return tile_for_rows<P, Y, 2>(rows);
    case 3: return tile_for_rows<P, Y, 3>(rows);
    default: return tile_for_rows<P, Y, 4>(rows);
  }
}

// The next item's rows (a thread takes items in runs), here while this item sums: on a matrix
// larger than the caches, the hardware's prefetchers alone leave the loads waiting.
TANDEM_PREFETCH void prefetch(const uint8_t* p) { __builtin_prefetch(p); }

// Up to kDirectRows rows of x (units, ldx bytes apart) against C outputs, each weight
// dequantized in registers and summed at once (no scratch): the C outputs' chains run side by
// side, each in tile's order, so every output is the same bits as tile's.
template <typename P, typename Y, int64_t K, int R, int C>
void sum_direct(const uint8_t* x, int64_t ldx, const uint8_t* w, int64_t ld, int64_t cols, Y* y, int64_t ldy) {
  constexpr BlockLayout l = kLayout<K>;
  vec acc[C][R][kVecs];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVecs; ++v) acc[c][r][v] = vzero();
  for (int64_t i = 0; i < cols / l.weights; ++i) {
    const uint8_t* xb = x + i * l.weights / P::kStep * P::kUnitBytes;
    const bool new_line = (i * l.bytes) % kLine < l.bytes;  // a prefetch a cache line
    for (int c = 0; c < C; ++c) {
      if (new_line) prefetch(w + (c + C) * ld + i * l.bytes);  // the next item's rows
      P::template block_units<K>(w + c * ld + i * l.bytes, [&](int e, const typename P::Unit& wu) {
        for (int r = 0; r < R; ++r) P::dot(acc[c][r], P::load(xb + r * ldx + e / P::kStep * P::kUnitBytes), wu);
      });
    }
  }
  float sums[C * R];
  vtree_sums(&acc[0][0][0], C * R, sums);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = static_cast<Y>(sums[c * R + r]);
}

template <typename Y>
using DirectItem = void (*)(const uint8_t*, int64_t, const uint8_t*, int64_t, int64_t, int, Y*, int64_t);

template <typename P, typename Y, int64_t K, int R>
void direct_item(const uint8_t* x, int64_t ldx, const uint8_t* w, int64_t ld, int64_t cols, int n, Y* y, int64_t ldy) {
  if (n == kTileCols) return sum_direct<P, Y, K, R, kTileCols>(x, ldx, w, ld, cols, y, ldy);
  for (int c = 0; c < n; ++c) sum_direct<P, Y, K, R, 1>(x, ldx, w + c * ld, ld, cols, y + c, ldy);
}

template <typename P, typename Y, int64_t K>
DirectItem<Y> direct_for_rows(int64_t rows) {
  switch (rows) {
    case 1: return direct_item<P, Y, K, 1>;
    case 2: return direct_item<P, Y, K, 2>;
    case 3: return direct_item<P, Y, K, 3>;
    default: return direct_item<P, Y, K, 4>;
  }
}

template <typename P, typename Y>
DirectItem<Y> direct_kernel(int64_t kind, int64_t rows) {
  switch (kind) {
    case Q4_0: return direct_for_rows<P, Y, Q4_0>(rows);
    case Q4_1: return direct_for_rows<P, Y, Q4_1>(rows);
    case Q5_0: return direct_for_rows<P, Y, Q5_0>(rows);
    case Q5_1: return direct_for_rows<P, Y, Q5_1>(rows);
    case Q8_0: return direct_for_rows<P, Y, Q8_0>(rows);
    case Q4_K: return direct_for_rows<P, Y, Q4_K>(rows);
    case Q5_K: return direct_for_rows<P, Y, Q5_K>(rows);
    case Q6_K: return direct_for_rows<P, Y, Q6_K>(rows);
  }
  TORCH_CHECK(false, "tandem gguf: no kernel for ggml type ", kind);
}

// y [M, N] = x @ [W_0; W_1; ...].T, x M rows of K / P::kStep units (ldx bytes apart), each sum
// stored as Y (rounded once to bf16 where Y is: what converting an fp32 y would give).
template <typename P, typename Y>
void multiply(const uint8_t* xp, int64_t ldx, int64_t M, at::TensorList raws, at::IntArrayRef kinds, int64_t K,
              Y* yp, int64_t N) {
  const int64_t units = K / P::kStep, scratch_row = units * P::kUnitBytes;
  const int64_t item_rows = kItemRows * 4 * P::kStep / P::kUnitBytes;  // as many bytes of x: bf16's twice the rows
  const int64_t row_items = M <= kDirectRows ? 1 : (M + item_rows - 1) / item_rows;
  struct Part {
    const uint8_t* w;
    int64_t ld, rows, col_tiles, first_col, first_item;
    DequantizeRow dequantize;
    DirectItem<Y> direct;
  };
  std::vector<Part> parts;
  int64_t first_col = 0, items = 0;
  for (size_t p = 0; p < raws.size(); ++p) {
    const int64_t rows = raws[p].size(0), col_tiles = (rows + kTileCols - 1) / kTileCols;
    parts.push_back({raws[p].data_ptr<uint8_t>(), raws[p].stride(0), rows, col_tiles, first_col, items,
                     dequantizer<P>(kinds[p]), direct_kernel<P, Y>(kinds[p], M)});
    first_col += rows;
    items += row_items * col_tiles;
  }
  // A part's items row block by row block, every column tile of one block in turn: the block's
  // rows of x (item_rows x K values) stay in L2 while the quantized weights, 4-7x smaller, stream
  // past (column-major, a prompt's x came from L3 again for every 4 outputs). Up to kDirectRows
  // rows (decode) nothing shares a dequantized row, so none is stored: the direct kernel sums
  // each weight from registers.
  tandem_ops::parallel_items(
      items, [&] { return std::vector<uint8_t>(M <= kDirectRows ? 0 : kTileCols * scratch_row); },
      [&](std::vector<uint8_t>& scratch, int64_t item) {
        size_t p = 0;
        while (p + 1 < parts.size() && parts[p + 1].first_item <= item) ++p;
        const Part& part = parts[p];
        const int64_t local = item - part.first_item;
        const int64_t n0 = local % part.col_tiles * kTileCols, m0 = local / part.col_tiles * item_rows;
        const int cols = static_cast<int>(std::min<int64_t>(kTileCols, part.rows - n0));
        const uint8_t* w = part.w + n0 * part.ld;
        Y* out = yp + part.first_col + n0;
        if (M <= kDirectRows) return part.direct(xp, ldx, w, part.ld, K, cols, out, N);
        for (int c = 0; c < cols; ++c) part.dequantize(w + c * part.ld, K, scratch.data() + c * scratch_row);
        for (int64_t m = m0; m < std::min(M, m0 + item_rows); m += kTileRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - m));
          tile_for<P, Y>(rows, cols)(xp + m * ldx, ldx, scratch.data(), scratch_row, units, out + m * N, N);
        }
      });
}

}  // namespace

namespace tandem_ops {

// The weights as the kernel sums fp32 x against them: fp32 [N, K] (a bf16 x: these, rounded).
Tensor gguf_dequantize(const Tensor& raw, int64_t kind, int64_t K) {
  check_weight(raw, kind, K);
  const int64_t N = raw.size(0);
  Tensor out = at::empty({N, K}, raw.options().dtype(at::kFloat));
  const DequantizeRow row = dequantizer<Fp32Products>(kind);
  const uint8_t* w = raw.data_ptr<uint8_t>();
  uint8_t* o = reinterpret_cast<uint8_t*>(out.data_ptr<float>());
  const int64_t ld = raw.stride(0);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) row(w + n * ld, K, o + n * K * int64_t{sizeof(float)});
  });
  return out;
}

// y = x @ [W_0; W_1; ...].T, x [M, K], each W_p GGUF rows of its own type (fused q/k/v or
// gate/up kept apart); y in x's dtype. bf16 x: bf16 products (Bf16Products), else fp32 ones on x
// widened. Each output is computed as it would be alone, so one call over the parts is the same
// bits as a call each.
Tensor gguf_linear(const Tensor& x_in, at::TensorList raws, at::IntArrayRef kinds, int64_t K) {
  TORCH_CHECK(!raws.empty() && raws.size() == kinds.size(), "tandem gguf_linear: a kind for each weight");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "tandem gguf_linear: x is [rows, ", K, "]");
  int64_t N = 0;
  for (size_t p = 0; p < raws.size(); ++p) {
    check_weight(raws[p], kinds[p], K);
    N += raws[p].size(0);
  }
  const int64_t M = x_in.size(0);
  if (x_in.scalar_type() == at::kBFloat16) {  // y rounded to bf16 as it is stored
    Tensor y = at::empty({M, N}, x_in.options());
    if (M == 0) return y;  // a chunk that samples nothing: no items (each reads rows)
    const Tensor units = bf16_units(x_in);
    multiply<Bf16Products>(units.data_ptr<uint8_t>(), units.stride(0), M, raws, kinds, K,
                           y.data_ptr<c10::BFloat16>(), N);
    return y;
  }
  Tensor y = at::empty({M, N}, x_in.options().dtype(at::kFloat));
  if (M == 0) return y.to(x_in.scalar_type());
  const Tensor x = x_in.to(at::kFloat).contiguous();
  multiply<Fp32Products>(reinterpret_cast<const uint8_t*>(x.data_ptr<float>()), K * int64_t{sizeof(float)}, M, raws,
                         kinds, K, y.data_ptr<float>(), N);
  return y.to(x_in.scalar_type());
}

}  // namespace tandem_ops

TORCH_LIBRARY_FRAGMENT(TANDEM_OPS_NAMESPACE, m) {
  m.def("gguf_dequantize(Tensor raw, int kind, int in_features) -> Tensor", &tandem_ops::gguf_dequantize);
  m.def("gguf_linear(Tensor x, Tensor[] raws, int[] kinds, int in_features) -> Tensor", &tandem_ops::gguf_linear);
}
