// The batch-invariant matmul: y = x @ W.T (+ bias) where every output element is summed in one
// fixed order, in fp32. Nothing about the call changes that order: not the number of rows, not
// which rows share a register tile, not the threads (work is split over rows and columns, never
// over k), not the vector width (lanes run along the output columns; an AVX-512 lane, an AVX2
// lane and the scalar std::fma compute the same chain). So a token's row is the same bits alone,
// in a batch of any size, cached or not, and on every x86-64 CPU with FMA. See
// engine/layers/linear.py.
//
// The weight is packed once at load into blocks of 16 output columns:
//  - fp32 or bf16 [ceil(N / 16), K, 16] (zero columns past N; bf16's K rounded up to even), the
//    blocks in panels of four interleaved by k (kLayoutPanel): for each k a panel's 64 values
//    side by side, so a tile of a panel reads one stream (a single row from DRAM read 10-20%
//    faster than from four streams a block each, on a Zen 5). An output is a chain of fused
//    multiply-adds from zero over each chunk of 256 consecutive k, the chunks' sums added in
//    order (shorter chains than one over all of K: about as accurate as a blocked BLAS). bf16
//    weights are stored in pairs of k (tile_bf16) that AVX512-BF16's dot product sums two a lane
//    an instruction, adding k's product before k + 1's, as the other builds' two FMAs do; bf16
//    weights and activations below 2^-55 are zero on every build, so it never meets the
//    subnormals it flushes (a 512-token bf16 prefill 1.34-1.43x on a Zen 5).
//  - Quantized (engine/layers/quantized), in groups along k that share a scale: FP8 e4m3 bytes
//    [ceil(N / 16), K, 16] (uint8, in the same panels) with fp32 scales [ceil(N / 128),
//    ceil(K / 128)], a group being a 128 x 128 block (each scale times 2^120, the bytes'
//    exponent offset); or INT4 records [ceil(N / 16), K / group, group / 8 * 16 + 16 scales]
//    (int32, int4_records): a group's words (8 consecutive k of a column a word, as
//    two's-complement nibbles: k + 1, k + 3, k + 5, k + 7 from bit 0, k, k + 2, k + 4, k + 6 from
//    bit 16, the pairs AVX512-BF16's dot product takes), then its 16 columns' scales (fp32, or
//    bf16 in 8 words), in panels of eight blocks, so a tile is one stream (with the scales in a
//    stream of their own, one row read 29 GB/s against 35 on a Zen 5 from DRAM; a stream a
//    block, 10% slower than a panel's). An output is, over the groups in order, a running fused
//    multiply-add of each group's scale times the group's sum (a chain from zero over its k, in
//    order, of x times the stored value): the scale is applied once a group, not once a weight,
//    so a weight costs one FMA a row (half of one with the pairs).
//  - MXFP4 (gpt-oss's experts): bytes [ceil(N / 16), K / 2, 16] (a pair of k a byte a column, the
//    low nibble first) with e8m0 scale bytes [ceil(N / 16), K / 32, 16], both in dense's panels
//    (the published bytes and scales, moved): each weight expanded in registers exactly as
//    transformers dequantizes it and summed as a dense fp32 weight (tile_mxfp4), so the product
//    is that of the dequantized weight, bit for bit.
// The fp32 result is rounded once to the output dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <array>
#include <variant>
#include <vector>

#include <unistd.h>

#include "ops.h"
#include "vec.h"

namespace {

using at::Tensor;
using namespace tandem_vec;

constexpr int64_t kChunk = 256;  // k per summed chunk (dense) and the k a pass covers: never tuned per CPU
inline int64_t padded_k(int64_t K) { return K + K % 2; }  // bf16 weights' k: whole pairs
constexpr int64_t kFp8Block = 128;

template <int R, int V>
using Acc = vec[R][V];

// The blocks are stored in panels (the last one narrower), so that a tile of a panel's blocks
// reads one stream: dense and FP8 panels of four, k by k, each k's 16 values of every block side
// by side; INT4 panels of eight, group by group: the group's k-steps (8 k) in turn, each its
// blocks' 16 words side by side, then its blocks' scales.
constexpr int64_t kLayoutPanel = 4, kLayoutPanelInt4 = 8;
struct Panel {
  int64_t first, width;  // the panel's first block and its blocks
};
inline Panel panel_holding(int64_t panel_width, int64_t NB, int64_t b) {
  const int64_t first = b / panel_width * panel_width;
  return {first, std::min(panel_width, NB - first)};
}
// Dense, bf16 and FP8: block b's first values (`block` values a block, `item` a block's values at
// one step of k) and the values from one step to the next (the panel's width of items).
struct InPanel {
  int64_t at, stride;
};
inline InPanel in_panel(int64_t NB, int64_t b, int64_t block, int64_t item) {
  const Panel p = panel_holding(kLayoutPanel, NB, b);
  return {p.first * block + (b - p.first) * item, p.width * item};
}
// A tile never straddles two panels: its blocks start at a multiple of its width, which divides
// the panel's.
static_assert(kLayoutPanel % kPanel == 0 && (!kWideDense || kLayoutPanel % kWidePanel == 0));
static_assert(kLayoutPanelInt4 % kPanel == 0 && kLayoutPanelInt4 % kWidePanel == 0);

// Software prefetch ahead of the stream (a hint only: never a fault, never a change to what is
// summed): one row of a small layer is too little work for the hardware prefetcher alone to
// reach the bandwidth. Measured on a Zen 5, decode at one row: dense and FP8, the tile's row
// kAheadRows k on (2 KiB for FP8, 4 KiB for bf16: +10-15% over 1 KiB); INT4, its words two
// groups of a panel on (4.5 KiB: +10% over 1 KiB, +7% over 9 KiB).
constexpr int64_t kAheadRows = 32, kAheadInt4 = 4608;
template <int64_t AheadRows = kAheadRows, typename W>
TANDEM_PREFETCH void prefetch_row(const W* row, int64_t bytes, int64_t stride) {
  const char* p = reinterpret_cast<const char*>(row + AheadRows * stride);
  for (int64_t at = 0; at < bytes; at += kLine) __builtin_prefetch(p + at, 0, 3);
}
template <int64_t Ahead, typename W>
TANDEM_PREFETCH void prefetch_blocks(const W* w, int64_t block_elems, int blocks, int64_t at) {
  for (int b = 0; b < blocks; ++b) __builtin_prefetch(reinterpret_cast<const char*>(w + b * block_elems + at) + Ahead, 0, 3);
}

template <int R, int V>
inline void zero(Acc<R, V>& acc) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = vzero();
}

// acc[r][v] += x[r, k] * w[v] for R rows, the weights' vectors already loaded.
template <int R, int V>
inline void fma_rows(const float* x, int64_t ldx, int64_t k, const vec* w, Acc<R, V>& acc) {
  for (int r = 0; r < R; ++r) {
    const vec xv = vbroadcast(x[r * ldx + k]);
    for (int v = 0; v < V; ++v) acc[r][v] = vfma(xv, w[v], acc[r][v]);
  }
}

// B blocks' values at k into wv, prefetching ahead. w: the first block's at k = 0, `stride`
// elements from one k to the next (its panel's width times 16); the blocks side by side.
template <int B, typename W>
inline void load_blocks(const W* w, int64_t stride, int64_t k, vec* wv) {
  constexpr int64_t bytes = B * kBlock * int64_t{sizeof(W)};
  const W* row = w + k * stride;
  if (bytes >= kLine || k % (kLine / bytes) == 0) prefetch_row(row, bytes, stride);
  for (int b = 0; b < B; ++b)
    for (int v = 0; v < kVecs; ++v) wv[b * kVecs + v] = vload(row + b * kBlock + v * kLanes);
}

// Dense: one chunk [k0, k1) of R rows x B blocks, acc = the chunk's chain, then out = acc (the
// first chunk) or out += acc. w, stride: see load_blocks; out: fp32 [R, B * 16].
template <int R, int B, typename W>
inline void tile_dense(const float* x, int64_t ldx, const W* w, int64_t stride, int64_t k0, int64_t k1, float* out,
                       int64_t ldo) {
  Acc<R, B * kVecs> acc;
  zero(acc);
  for (int64_t k = k0; k < k1; ++k) {
    vec wv[B * kVecs];
    load_blocks<B>(w, stride, k, wv);
    fma_rows<R, B * kVecs>(x, ldx, k, wv, acc);
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < B * kVecs; ++v) {
      float* o = out + r * ldo + v * kLanes;
      vstore(o, k0 == 0 ? acc[r][v] : vadd(vload(o), acc[r][v]));
    }
}

// bf16 bits of x[lo] | x[hi] << 16: fp32 widened from bf16, so its top half is exactly the bf16.
inline uint32_t bf16_pair(const float* x, int64_t lo, int64_t hi) {
  uint32_t even, odd;
  std::memcpy(&even, x + lo, sizeof even);
  std::memcpy(&odd, x + hi, sizeof odd);
  return (even >> 16) | (odd & 0xffff0000u);
}

// A widened bf16 row's pair words (widened_tiny_to_zero): word j is bf16_pair(x, 2j + 1, 2j), the
// last one's low half zero where K is odd.
inline const uint32_t* pair_words(const float* x_row, int64_t K) { return reinterpret_cast<const uint32_t*>(x_row + K); }

// bf16 weights in pairs of k: a block's 16 words a pair, weight k in each word's high half and
// k + 1 in its low one (K padded to even with a zero weight), so AVX512-BF16's dot product takes
// two a lane an instruction, adding k's product first (then k + 1's): the chain in k's order,
// as the other builds' two fused multiply-adds a pair compute it. w: the tile's first block at
// the first pair, `stride` bf16 values from one pair to the next. One chunk [k0, k1) (k0 even; a
// last odd k pairs with a zero activation) of R rows x B blocks, then out = acc or out += acc.
template <int R, int B>
inline void tile_bf16(const float* x, int64_t ldx, const c10::BFloat16* w, int64_t stride, int64_t K, int64_t k0,
                      int64_t k1, float* out, int64_t ldo) {
  Acc<R, B * kVecs> acc;
  zero(acc);
  for (int64_t k = k0; k < k1; k += 2) {
    const c10::BFloat16* row = w + k / 2 * stride;
    prefetch_row<kAheadRows / 2>(row, B * kBlock * 2 * int64_t{sizeof(c10::BFloat16)}, stride);  // 32 k on
#if defined(__AVX512BF16__)
    decltype(vload_words(nullptr)) wv[B];
    for (int b = 0; b < B; ++b) wv[b] = vload_words(reinterpret_cast<const int32_t*>(row + b * 2 * kBlock));
    for (int r = 0; r < R; ++r) {
      const uint32_t pair = pair_words(x + r * ldx, K)[k / 2];
      for (int b = 0; b < B; ++b) acc[r][b] = vdot_pairs(acc[r][b], pair, wv[b]);
    }
#else
    vec high[B * kVecs], low[B * kVecs];
    for (int b = 0; b < B; ++b)
      for (int v = 0; v < kVecs; ++v) {
        const int32_t* words = reinterpret_cast<const int32_t*>(row + b * 2 * kBlock) + v * kLanes;
        high[b * kVecs + v] = vpair_high(words);
        low[b * kVecs + v] = vpair_low(words);
      }
    fma_rows<R, B * kVecs>(x, ldx, k, high, acc);
    for (int r = 0; r < R; ++r) {
      const vec xv = vbroadcast(k + 1 == K ? 0.f : x[r * ldx + k + 1]);
      for (int v = 0; v < B * kVecs; ++v) acc[r][v] = vfma(xv, low[v], acc[r][v]);
    }
#endif
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < B * kVecs; ++v) {
      float* o = out + r * ldo + v * kLanes;
      vstore(o, k0 == 0 ? acc[r][v] : vadd(vload(o), acc[r][v]));
    }
}

// A group's sum into the running output: out = acc * scale (the first group) or
// fma(acc, scale, out). scale(v): the scale vector of accumulator column vector v.
template <int R, int V, typename Scale>
inline void add_group(const Acc<R, V>& acc, bool first, Scale&& scale, float* out, int64_t ldo) {
  for (int v = 0; v < V; ++v) {
    const vec s = scale(v);
    for (int r = 0; r < R; ++r) {
      float* o = out + r * ldo + v * kLanes;
      vstore(o, first ? vmul(acc[r][v], s) : vfma(acc[r][v], s, vload(o)));
    }
  }
}

// FP8: groups of 128 k within [k0, k1). A panel's blocks share a 128-column group of scales.
template <int R, int B>
inline void tile_fp8(const float* x, int64_t ldx, const Fp8* w, int64_t stride, const float* scales, int64_t k0,
                     int64_t k1, float* out, int64_t ldo) {
  for (int64_t g0 = k0; g0 < k1; g0 += kFp8Block) {
    Acc<R, B * kVecs> acc;
    zero(acc);
    for (int64_t k = g0; k < std::min(k1, g0 + kFp8Block); ++k) {
      vec wv[B * kVecs];
      load_blocks<B>(w, stride, k, wv);
      fma_rows<R, B * kVecs>(x, ldx, k, wv, acc);
    }
    const vec s = vbroadcast(scales[g0 / kFp8Block]);
    add_group<R, B * kVecs>(acc, g0 == 0, [&](int) { return s; }, out, ldo);
  }
}

// MXFP4 (engine/layers/quantized/mxfp4.py): a byte a column for each pair of k (k in its low
// nibble), [ceil(N / 16), K / 2, 16] in dense's panels, and each group of 32 k's e8m0 scales
// [ceil(N / 16), K / 32, 16] in the same panels. A weight is expanded as transformers'
// dequantization makes it, exactly (the e2m1 value doubled, times 2^(s - 128): ldexp(value, s -
// 127)), and summed as a dense fp32 weight is: a chain over each chunk of k from zero, the chunks
// added in order. So the product is invariant_linear's on the dequantized weight, bit for bit.
constexpr int64_t kMxfp4Group = 32;
template <int R, int B>
inline void tile_mxfp4(const float* x, int64_t ldx, const uint8_t* w, int64_t stride, const uint8_t* scales,
                       int64_t scale_stride, int64_t k0, int64_t k1, float* out, int64_t ldo) {
  constexpr int V = B * kVecs;
  constexpr int64_t bytes = B * kBlock;  // a step's: the blocks' bytes of one pair of k
  Acc<R, V> acc;
  zero(acc);
  vec scale[V];
  for (int64_t k = k0; k < k1; k += 2) {
    if (k % kMxfp4Group == 0)
      for (int v = 0; v < V; ++v) scale[v] = ve8m0_halved(scales + k / kMxfp4Group * scale_stride + v * kLanes);
    const uint8_t* row = w + k / 2 * stride;
    if (bytes >= kLine || (k / 2) % (kLine / bytes) == 0) prefetch_row(row, bytes, stride);
    vec low[V], high[V];
    for (int v = 0; v < V; ++v) {
      vfp4_doubled(row + v * kLanes, low[v], high[v]);
      low[v] = vmul(low[v], scale[v]);
      high[v] = vmul(high[v], scale[v]);
    }
    fma_rows<R, V>(x, ldx, k, low, acc);
    fma_rows<R, V>(x, ldx, k + 1, high, acc);
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      float* o = out + r * ldo + v * kLanes;
      vstore(o, k0 == 0 ? acc[r][v] : vadd(vload(o), acc[r][v]));
    }
}

// Where weight k + i of a word sits (nibble i's bits 4 nibble(i)): the odd k in the low half,
// the even k in the high half, so a shift by 4p puts pair p's (k + 2p + 1, k + 2p) at the
// bottom of each 16-bit half.
constexpr int nibble_of(int i) { return i % 2 ? i / 2 : 4 + i / 2; }


// INT4: groups of `group` k within [k0, k1) of blocks [i0, i0 + B) of a panel of `width`
// blocks (kLayoutPanelInt4), whose first record is at `panel`; `record` words a block a group.
// Pairs: x holds bf16 values with their pair words (none below 2^-55: widened_tiny_to_zero) and the
// build has AVX512-BF16's dot product.
template <int R, int B, typename S, bool Pairs>
inline void tile_int4(const float* x, int64_t ldx, int64_t K, const int32_t* panel, int64_t width, int64_t i0,
                      int64_t group, int64_t record, int64_t k0, int64_t k1, float* out, int64_t ldo) {
  constexpr int V = B * kVecs;
  const int64_t block = kBlock, step = width * kBlock;  // words: block to block, k-step to k-step
  for (int64_t g0 = k0; g0 < k1; g0 += group) {
    const int32_t* rec = panel + g0 / group * width * record;
    Acc<R, V> acc;
    zero(acc);
    for (int64_t k = g0; k < g0 + group; k += 8) {
      const int32_t* words = rec + (k - g0) / 8 * step + i0 * kBlock;
      prefetch_blocks<kAheadInt4>(words, block, B, 0);
#if defined(__AVX512BF16__)
      if constexpr (Pairs) {
        decltype(vload_words(words)) wv[B];
        for (int b = 0; b < B; ++b) wv[b] = vload_words(words + b * block);
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
          uint32_t pair[R];
          // x[k + 2p] in the odd half, summed first: the chain stays in k's order
          for (int r = 0; r < R; ++r) pair[r] = pair_words(x + r * ldx, K)[(k + 2 * p) / 2];
          for (int b = 0; b < B; ++b) {
            const auto q = vnibble_pairs(wv[b], p);
            for (int r = 0; r < R; ++r) acc[r][b] = vdot_pairs(acc[r][b], pair[r], q);
          }
        }
      } else
#endif
      {
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          vec q[V];
          for (int b = 0; b < B; ++b)
            for (int v = 0; v < kVecs; ++v) q[b * kVecs + v] = vnibble(words + b * block + v * kLanes, nibble_of(i));
          fma_rows<R, V>(x, ldx, k + i, q, acc);
        }
      }
    }
    const S* scale = reinterpret_cast<const S*>(rec + group / 8 * step) + i0 * kBlock;
    add_group<R, V>(
        acc, g0 == 0, [&](int v) { return vload(scale + (v / kVecs) * kBlock + (v % kVecs) * kLanes); }, out, ldo);
  }
}

// f(std::integral_constant<int, R>) for R = rows (at most MaxRows): the tile height as a
// compile-time constant.
template <int MaxRows, typename F>
inline void for_rows(int rows, F&& f) {
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: if constexpr (MaxRows >= 2) return f(std::integral_constant<int, 2>{}); break;
    case 3: if constexpr (MaxRows >= 3) return f(std::integral_constant<int, 3>{}); break;
    case 4: if constexpr (MaxRows >= 4) return f(std::integral_constant<int, 4>{}); break;
    case 5: if constexpr (MaxRows >= 5) return f(std::integral_constant<int, 5>{}); break;
    case 6: if constexpr (MaxRows >= 6) return f(std::integral_constant<int, 6>{}); break;
  }
  TORCH_CHECK(false, "tandem invariant_linear: no tile of ", rows, " rows");
}

// The tallest tile of B blocks: kMaxRows, or kWideRows for the wide panel (its accumulators
// fill the registers at fewer rows).
template <int B>
constexpr int max_rows = B > kPanel ? kWideRows : kMaxRows;

// A packed weight's tiles: tile<B>(rows, x, ldx, b, k0, k1, out, ldo) sums blocks [b, b + B)
// over [k0, k1) into out; `chunk`: the k a pass covers (a whole number of groups).
// kWide: whether one or two rows take the wide panel (panel_width; vec.h says which weights do
// on which build).
template <typename W>
struct DenseWeights {  // fp32 or bf16 (in pairs of k: tile_bf16)
  static constexpr bool kWide = kWideDense;
  static constexpr int64_t kBytes = kBlock * int64_t{sizeof(W)};  // a block's at one k
  const W* w;
  int64_t K, NB;
  int64_t chunk = kChunk;
  template <int B>
  void tile(int rows, const float* x, int64_t ldx, int64_t b, int64_t k0, int64_t k1, float* out, int64_t ldo) const {
    for_rows<max_rows<B>>(rows, [&](auto r) {
      if constexpr (std::is_same_v<W, float>) {
        const InPanel at = in_panel(NB, b, K * kBlock, kBlock);
        tile_dense<decltype(r)::value, B>(x, ldx, w + at.at, at.stride, k0, k1, out, ldo);
      } else {  // a step a pair of k: each block's 16 words
        const InPanel at = in_panel(NB, b, padded_k(K) * kBlock, 2 * kBlock);
        tile_bf16<decltype(r)::value, B>(x, ldx, w + at.at, at.stride, K, k0, k1, out, ldo);
      }
    });
  }
};

struct Fp8Weights {
  static constexpr bool kWide = kWideDense;
  static constexpr int64_t kBytes = kBlock;
  const Fp8* w;
  const float* scales;  // [ceil(N / 128), ceil(K / 128)]
  int64_t K, NB;
  int64_t chunk = kChunk;
  template <int B>
  void tile(int rows, const float* x, int64_t ldx, int64_t b, int64_t k0, int64_t k1, float* out, int64_t ldo) const {
    const float* s = scales + (b * kBlock / kFp8Block) * ((K + kFp8Block - 1) / kFp8Block);
    const InPanel at = in_panel(NB, b, K * kBlock, kBlock);
    for_rows<max_rows<B>>(rows, [&](auto r) { tile_fp8<decltype(r)::value, B>(x, ldx, w + at.at, at.stride, s, k0, k1, out, ldo); });
  }
};

struct Mxfp4Weights {
  static constexpr bool kWide = kWideDense;
  static constexpr int64_t kBytes = kBlock / 2;
  const uint8_t* w;       // [NB, K / 2, 16], in panels
  const uint8_t* scales;  // [NB, K / 32, 16], in panels
  int64_t K, NB;
  int64_t chunk = kChunk;
  template <int B>
  void tile(int rows, const float* x, int64_t ldx, int64_t b, int64_t k0, int64_t k1, float* out, int64_t ldo) const {
    const InPanel at = in_panel(NB, b, K / 2 * kBlock, kBlock);
    const InPanel s = in_panel(NB, b, K / kMxfp4Group * kBlock, kBlock);
    for_rows<max_rows<B>>(rows, [&](auto r) {
      tile_mxfp4<decltype(r)::value, B>(x, ldx, w + at.at, at.stride, scales + s.at, s.stride, k0, k1, out, ldo);
    });
  }
};

// The pairs' tile at most 4 rows high: at 6 its accumulators, words and activations overflow the
// 32 registers.
constexpr int kPairRows = 4;

template <typename S>  // the scales' type
struct Int4Weights {
  static constexpr bool kWide = true;
  static constexpr int64_t kBytes = kBlock / 2;
  const int32_t* w;  // [NB, K / group, record], in panels
  int64_t K, NB, group;
  bool pairs;  // x is bf16 (tiny_to_zero'd) and the build has kDotPairs
  int64_t record = group / 8 * kBlock + kBlock * int64_t{sizeof(S)} / int64_t{sizeof(int32_t)};
  int64_t chunk = std::max<int64_t>(1, kChunk / group) * group;
  template <int B>
  void tile(int rows, const float* x, int64_t ldx, int64_t b, int64_t k0, int64_t k1, float* out, int64_t ldo) const {
    const Panel p = panel_holding(kLayoutPanelInt4, NB, b);
    const int32_t* wb = w + p.first * (K / group) * record;
    if (kDotPairs && pairs && rows > kPairRows) {  // two tiles (each row's sums are its own)
      tile<B>(kPairRows, x, ldx, b, k0, k1, out, ldo);
      return tile<B>(rows - kPairRows, x + kPairRows * ldx, ldx, b, k0, k1, out + kPairRows * ldo, ldo);
    }
    for_rows<max_rows<B>>(rows, [&](auto r) {
      if constexpr (kDotPairs) {
        if (pairs) return tile_int4<decltype(r)::value, B, S, true>(x, ldx, K, wb, p.width, b - p.first, group, record, k0, k1, out, ldo);
      }
      tile_int4<decltype(r)::value, B, S, false>(x, ldx, K, wb, p.width, b - p.first, group, record, k0, k1, out, ldo);
    });
  }
};

// The blocks a work item of `rows` rows covers: at one or two rows, a tile of kPanel blocks can
// leave too few chains of FMAs to hide their latency, so the weights that need it
// (Weights::kWide) take a wider one.
inline int64_t panel_width(int64_t rows, bool wide) { return wide && rows <= kWideRows ? kWidePanel : kPanel; }

// Rows [m0, m1) x blocks [b0, b1) (at most a panel's width of them) into the fp32 scratch y,
// block b at column (b - origin) * 16, a chunk of k at a time over every row (the chunk's weights
// stay in cache while the rows pass over them). P: the panel's width.
template <int P, typename Weights>
void panel_of(const float* x, int64_t ldx, const Weights& weights, int64_t K, int64_t m0, int64_t m1, int64_t b0,
              int64_t b1, float* y, int64_t ldy, int64_t origin) {
  static_assert(kFp8Block % (P * kBlock) == 0 && kFp8Block % (kPanel * kBlock) == 0);
  for (int64_t k0 = 0; k0 < K; k0 += weights.chunk) {
    const int64_t k1 = std::min(K, k0 + weights.chunk);
    for (int64_t m = m0; m < m1; m += kMaxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m1 - m));
      const float* xr = x + m * ldx;
      float* yr = y + m * ldy;
      // Fewer blocks at the right edge: narrower tiles (the same sums; a tile never straddles
      // an FP8 scale block, as every width divides it and starts aligned to itself).
      for (int64_t b = b0; b < b1;) {
        if (b1 - b >= P) {
          weights.template tile<P>(rows, xr, ldx, b, k0, k1, yr + (b - origin) * kBlock, ldy);
          b += P;
        } else if (P > kPanel && b1 - b >= kPanel) {
          weights.template tile<kPanel>(rows, xr, ldx, b, k0, k1, yr + (b - origin) * kBlock, ldy);
          b += kPanel;
        } else {
          weights.template tile<1>(rows, xr, ldx, b, k0, k1, yr + (b - origin) * kBlock, ldy);
          b += 1;
        }
      }
    }
  }
}

template <typename Weights>
void panel(const float* x, int64_t ldx, const Weights& weights, int64_t K, int64_t m0, int64_t m1, int64_t b0,
           int64_t b1, float* y, int64_t ldy, int64_t origin = 0) {
  if constexpr (Weights::kWide && kWidePanel != kPanel) {
    if (panel_width(m1 - m0, true) == kWidePanel)
      return panel_of<kWidePanel>(x, ldx, weights, K, m0, m1, b0, b1, y, ldy, origin);
  }
  panel_of<kPanel>(x, ldx, weights, K, m0, m1, b0, b1, y, ldy, origin);
}

// Work items over the groups of rows [offsets[g], offsets[g + 1]) and NB blocks: (group, first
// block, first row), a chunk of a group's rows times the panel it takes (wide(g): its weights'
// kWide). A group's items come row chunk by row chunk, each over all of its panels, or
// (panel_major) panel by panel, each over all of its row chunks: whichever order streams fewer
// bytes from past a core's L2. The first keeps a chunk's rows there and reads the whole weight
// once a chunk (once in all where the weight fits beside the rows); the second keeps a panel
// there and reads all the rows once a panel (once where they fit beside the panel; where they do
// not, only on a weight of twice the L2 or more: the demo model's 1.5 MB gate_up on 2,048 rows ran
// 1.02-1.09x slower so). A prompt on a weight of megabytes takes the second (a 512-token
// prefill's matmuls 1.08-1.18x faster). The order is speed only: an item's sums are its own.
constexpr int64_t kRowChunk = kMaxRows * 8;
inline int64_t l2_bytes() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? int64_t{l2} : int64_t{1} << 20;
  }();
  return bytes;
}
inline bool panel_major(int64_t rows, int64_t K, int64_t NB, int64_t block_bytes_per_k) {
  const int64_t chunks = (rows + kRowChunk - 1) / kRowChunk, panels = (NB + kPanel - 1) / kPanel;
  if (chunks < 2 || block_bytes_per_k == 0) return false;
  const int64_t row = K * int64_t{sizeof(float)}, panel = kPanel * K * block_bytes_per_k;
  const int64_t weight = NB * K * block_bytes_per_k, x = rows * row, l2 = l2_bytes();
  const bool rows_fit = x + panel <= l2;
  if (!rows_fit && weight < 2 * l2) return false;  // measured slower (a small weight stays near the core)
  const int64_t by_chunks = weight + kRowChunk * row <= l2 ? weight : weight * chunks;
  return (rows_fit ? x : x * panels) < by_chunks;
}
// bytes(g): what group g's weight streams a block and a k (0: keep row chunk by row chunk).
template <typename Wide, typename Bytes>
std::vector<std::array<int64_t, 3>> work_items(const std::vector<int64_t>& offsets, int64_t NB, Wide&& wide, int64_t K,
                                               Bytes&& bytes) {
  std::vector<std::array<int64_t, 3>> items;
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    const int64_t first = offsets[g], last = offsets[g + 1];
    auto chunk_by_chunk = [&](int64_t from) {
      for (int64_t m = from; m < last; m += kRowChunk) {
        const int64_t width = panel_width(std::min(last, m + kRowChunk) - m, wide(g));
        for (int64_t b = 0; b < NB; b += width) items.push_back({static_cast<int64_t>(g), b, m});
      }
    };
    if (!panel_major(last - first, K, NB, bytes(g))) {
      chunk_by_chunk(first);
      continue;
    }
    // panel by panel, but for a last chunk of kWideRows rows or fewer (its panel is another width)
    const int64_t tail = (last - first) % kRowChunk, end = tail > 0 && tail <= kWideRows ? last - tail : last;
    for (int64_t b = 0; b < NB; b += kPanel)
      for (int64_t m = first; m < end; m += kRowChunk) items.push_back({static_cast<int64_t>(g), b, m});
    chunk_by_chunk(end);
  }
  return items;
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

using AnyWeights = std::variant<DenseWeights<float>, DenseWeights<c10::BFloat16>, Fp8Weights, Int4Weights<float>,
                                Int4Weights<c10::BFloat16>, Mxfp4Weights>;

// A packed weight checked against x: [NB, K, 16] in x's dtype (in panels), or FP8 bytes with `scales`
// (fp32), or MXFP4 bytes [NB, K / 2, 16] with `scales` (e8m0 bytes [NB, K / 32, 16]), or INT4
// records [NB, K / group, group * 2 + 8 (bf16 scales) or + 16 (fp32)] (undefined scales: none).
AnyWeights weights_of(const Tensor& x, const Tensor& packed, const Tensor& scales, int64_t N) {
  const int64_t K = x.size(1), NB = packed.size(0);
  const bool int4 = packed.scalar_type() == at::kInt, fp8 = packed.scalar_type() == at::kByte;
  if (int4) {
    const int64_t groups = packed.dim() == 3 ? packed.size(1) : 0, group = groups ? K / groups : 0;
    const int64_t scale_words = packed.dim() == 3 ? packed.size(2) - group / 8 * kBlock : 0;
    TORCH_CHECK(groups && group * groups == K && group % 8 == 0 && (scale_words == 8 || scale_words == 16) &&
                    packed.is_contiguous() && NB * kBlock >= N && !scales.defined(),
                "tandem invariant_linear: INT4 weights are records [ceil(out / 16), in / group, group * 2 + 8 or "
                "16] (a group of whole words dividing in; bf16 or fp32 scales inside), without scales beside");
    const bool pairs = kDotPairs && x.scalar_type() == at::kBFloat16;
    if (scale_words == 16) return Int4Weights<float>{packed.data_ptr<int32_t>(), K, NB, group, pairs};
    return Int4Weights<c10::BFloat16>{packed.data_ptr<int32_t>(), K, NB, group, pairs};
  }
  if (fp8 && scales.defined() && scales.scalar_type() == at::kByte) {
    TORCH_CHECK(K % kMxfp4Group == 0 && packed.dim() == 3 && packed.size(1) * 2 == K && packed.size(2) == kBlock &&
                    packed.is_contiguous() && NB * kBlock >= N && scales.dim() == 3 && scales.size(0) == NB &&
                    scales.size(1) == K / kMxfp4Group && scales.size(2) == kBlock && scales.is_contiguous(),
                "tandem invariant_linear: MXFP4 weights are bytes [ceil(out / 16), in / 2, 16] with e8m0 scales "
                "[ceil(out / 16), in / 32, 16] (in a multiple of 32)");
    return Mxfp4Weights{packed.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), K, NB};
  }
  const bool bf16 = !fp8 && x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlock && packed.is_contiguous() && NB * kBlock >= N &&
                  packed.size(1) == (bf16 ? padded_k(K) : K) && (fp8 || packed.scalar_type() == x.scalar_type()),
              "tandem invariant_linear: the packed weight must be [ceil(out / 16), in (bf16: rounded up to even), 16] "
              "in x's dtype or FP8 bytes");
  TORCH_CHECK(fp8 == scales.defined(), "tandem invariant_linear: FP8 weights come with scales");
  TORCH_CHECK(!fp8 || (scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.is_contiguous() &&
                       scales.size(0) == (N + kFp8Block - 1) / kFp8Block &&
                       scales.size(1) == (K + kFp8Block - 1) / kFp8Block),
              "tandem invariant_linear: FP8 scales must be float32 [ceil(out / 128), ceil(in / 128)]");
  if (fp8) return Fp8Weights{reinterpret_cast<const Fp8*>(packed.data_ptr<uint8_t>()), scales.data_ptr<float>(), K, NB};
  if (x.scalar_type() == at::kFloat) return DenseWeights<float>{packed.data_ptr<float>(), K, NB};
  return DenseWeights<c10::BFloat16>{packed.data_ptr<c10::BFloat16>(), K, NB};
}

// bf16 x [rows, in] (in contiguous) widened to fp32 with every |x| below kTiny zeroed, in one
// pass, on every build. bf16 weights (zeroed below kTiny when packed) and INT4 sum in
// AVX512-BF16's dot product where the build has it, which flushes subnormal inputs and partial
// sums to zero; with both factors 0 or at least 2^-55 (multiples of 2^-62; INT4's are integers),
// every product and partial sum is 0 or a multiple of 2^-124, never subnormal, so the dot
// product and the other builds' fused multiply-adds compute the same bits.
// Each row is its cols fp32 values, then, where the build has the dot product, the same values as
// padded_k(cols) / 2 pair words (pair_words) for its broadcasts.
Tensor widened_tiny_to_zero(const Tensor& x) {
  const int64_t rows = x.size(0), cols = x.size(1), ld = x.stride(0);
  const int64_t row = cols + (kDotPairs ? padded_k(cols) / 2 : 0);
  auto out = at::empty({rows, row}, x.options().dtype(at::kFloat));
  const c10::BFloat16* in = x.data_ptr<c10::BFloat16>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* values = o + r * row;
      for (int64_t c = 0; c < cols; ++c) {
        const float v = static_cast<float>(in[r * ld + c]);
        values[c] = std::fabs(v) < kTiny ? 0.f : v;
      }
      uint32_t* words = reinterpret_cast<uint32_t*>(values + cols);
      for (int64_t j = 0; kDotPairs && j < padded_k(cols) / 2; ++j)
        words[j] = 2 * j + 1 < cols ? bf16_pair(values, 2 * j + 1, 2 * j) : bf16_pair(values, 2 * j, 2 * j) & 0xffff0000u;
    }
  });
  return out;
}

// x as the tiles read it: fp32 rows (bf16 widened, its tiny values zeroed), checked.
Tensor fp32_rows(const Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "tandem invariant_linear: x must be [rows, in], rows contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "tandem invariant_linear: fp32 or bf16 only");
  return x.scalar_type() == at::kFloat ? x : widened_tiny_to_zero(x);
}

// Whether a weight's one- and two-row work items take the wide panel (its kind's kWide).
inline bool takes_wide(const AnyWeights& weights) {
  return std::visit([](const auto& w) { return w.kWide; }, weights);
}

// The bytes a weight streams a block and a k (its kind's kBytes, scales aside).
inline int64_t block_bytes(const AnyWeights& weights) {
  return std::visit([](const auto& w) { return w.kBytes; }, weights);
}

// Rows [offsets[g], offsets[g + 1]) of x times weights[g], for every g, into out [M, N] (each
// row summed exactly as a call of its own weight alone would). Work items: a group's panel of
// blocks x a chunk of its rows (never a range of k).
Tensor grouped(const Tensor& x, const std::vector<AnyWeights>& weights, const std::vector<int64_t>& offsets,
               int64_t NB, const Tensor& bias, int64_t N) {
  const Tensor xf = fp32_rows(x);
  const int64_t M = x.size(0), K = x.size(1), ldy = NB * kBlock;
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  // fp32 scratch: the accumulators as they leave the registers (whole blocks, so no masked
  // stores); an fp32 output of whole blocks without a bias is its own scratch (no second pass).
  const bool direct = x.scalar_type() == at::kFloat && !bias.defined() && N == ldy;
  auto y = direct ? out : at::empty({M, ldy}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const int64_t ldx = xf.stride(0);
  auto wide = [&](size_t g) { return takes_wide(weights[g]); };
  const auto items = work_items(offsets, NB, wide, K, [&](size_t g) { return block_bytes(weights[g]); });
  float* yp = y.data_ptr<float>();
  tandem_ops::parallel_items(static_cast<int64_t>(items.size()), [&](int64_t i) {
    const auto [g, b0, m0] = items[i];
    const int64_t m1 = std::min(offsets[g + 1], m0 + kRowChunk), b1 = std::min(NB, b0 + panel_width(m1 - m0, wide(g)));
    std::visit([&](const auto& w) { panel(xp, ldx, w, K, m0, m1, b0, b1, yp, ldy); }, weights[g]);
  }, (NB + kPanel - 1) / kPanel);  // runs of at most a row chunk's panels, its rows of x kept in one core's cache
  if (direct) return out;
  if (x.scalar_type() == at::kFloat) {
    finish<float>(yp, ldy, bias, out.data_ptr<float>(), M, N);
  } else {
    finish<c10::BFloat16>(yp, ldy, bias, out.data_ptr<c10::BFloat16>(), M, N);
  }
  return out;
}

// out[j] = silu(gate[j]) * up[j] for n values (a multiple of the lanes), each first rounded to T as
// the matmul's output is: silu_and_mul's bits on invariant_linear's output.
template <typename T>
inline void silu_times_row(const float* gate, const float* up, T* out, int64_t n) {
  auto as_output = [](vec v) { return std::is_same_v<T, float> ? v : vround_bf16(v); };
  for (int64_t j = 0; j < n; j += kLanes)
    vstore(out + j, vsilu_times<T>(as_output(vload(gate + j)), as_output(vload(up + j))));
}

// Rows [offsets[g], offsets[g + 1]) of x through weights[g], a packed gate_up (gate's `width`
// outputs, then up's): silu(x @ gate.T) * (x @ up.T), silu_and_mul of grouped's product bit for
// bit, without that [rows, 2 * width] product between them. A work item (a chunk of a group's
// rows times a panel of gate's blocks) sums that panel and up's matching one into a scratch of
// its own and combines them while they are in cache. width: a multiple of 128, so up's first
// block starts a panel on every build and for every weight kind.
Tensor grouped_silu(const Tensor& x, const std::vector<AnyWeights>& weights, const std::vector<int64_t>& offsets,
                    int64_t NB, int64_t width) {
  const Tensor xf = fp32_rows(x);
  TORCH_CHECK(width % 128 == 0 && NB * kBlock == 2 * width,
              "tandem invariant_linear_silu: gate and up of a width that is a multiple of 128");
  const int64_t M = x.size(0), K = x.size(1), half = width / kBlock;  // gate's blocks
  auto out = at::empty({M, width}, x.options());
  if (M == 0) return out;
  const float* xp = xf.data_ptr<float>();
  const int64_t ldx = xf.stride(0);
  auto wide = [&](size_t g) { return takes_wide(weights[g]); };
  // an item streams gate's block and up's
  const auto items = work_items(offsets, half, wide, K, [&](size_t g) { return 2 * block_bytes(weights[g]); });
  struct Scratch {
    std::vector<float> gate, up;
  };
  tandem_ops::parallel_items(static_cast<int64_t>(items.size()), [] { return Scratch(); }, [&](Scratch& scratch, int64_t i) {
    const auto [g, b0, m0] = items[i];
    const int64_t m1 = std::min(offsets[g + 1], m0 + kRowChunk), b1 = std::min(half, b0 + panel_width(m1 - m0, wide(g)));
    const int64_t rows = m1 - m0, cols = (b1 - b0) * kBlock;
    scratch.gate.resize(rows * cols);
    scratch.up.resize(rows * cols);
    std::visit([&](const auto& w) {
      panel(xp + m0 * ldx, ldx, w, K, 0, rows, b0, b1, scratch.gate.data(), cols, b0);
      panel(xp + m0 * ldx, ldx, w, K, 0, rows, half + b0, half + b1, scratch.up.data(), cols, half + b0);
    }, weights[g]);
    for (int64_t r = 0; r < rows; ++r) {
      const float* gate = scratch.gate.data() + r * cols;
      const float* up = scratch.up.data() + r * cols;
      if (x.scalar_type() == at::kFloat) {
        silu_times_row(gate, up, out.data_ptr<float>() + (m0 + r) * width + b0 * kBlock, cols);
      } else {
        silu_times_row(gate, up, out.data_ptr<c10::BFloat16>() + (m0 + r) * width + b0 * kBlock, cols);
      }
    }
  }, (half + kPanel - 1) / kPanel);
  return out;
}

// The stacked weights (and scales) of `experts`, each checked against x.
std::vector<AnyWeights> stacked_weights(const Tensor& x, const Tensor& packed, const Tensor& scales,
                                        const std::vector<int64_t>& experts, int64_t N) {
  std::vector<AnyWeights> weights;
  for (const int64_t e : experts)
    weights.push_back(weights_of(x, packed.select(0, e), scales.defined() ? scales.select(0, e) : Tensor(), N));
  return weights;
}

}  // namespace

namespace tandem_ops {

// packed: see weights_of; x: [M, K] (rows contiguous); out: [M, N].
Tensor invariant_linear(const Tensor& x, const Tensor& packed, const c10::optional<Tensor>& bias_opt, int64_t N,
              const c10::optional<Tensor>& scales_opt) {
  TORCH_CHECK(x.dim() == 2, "tandem invariant_linear: x must be [rows, in], rows contiguous");
  const Tensor scales = scales_opt.has_value() ? scales_opt->contiguous() : Tensor();
  const Tensor bias = bias_opt.has_value() ? bias_opt->contiguous() : Tensor();
  return grouped(x, {weights_of(x, packed, scales, N)}, {0, x.size(0)}, packed.size(0), bias, N);
}

// GatedMLP's gate, up and SiLU in one pass (grouped_silu, one group).
Tensor invariant_linear_silu(const Tensor& x, const Tensor& packed, int64_t width, const c10::optional<Tensor>& scales_opt) {
  const Tensor scales = scales_opt.has_value() ? scales_opt->contiguous() : Tensor();
  return grouped_silu(x, {weights_of(x, packed, scales, 2 * width)}, {0, x.size(0)}, packed.size(0), width);
}

// A mixture of experts' chosen experts in one call: rows [offsets[g], offsets[g + 1]) of x
// (grouped by expert) times packed[g] (with scales[g]), every group the same out_features.
// The same bits as a call a group.
Tensor invariant_linear_grouped(const Tensor& x, const std::vector<Tensor>& packed, const c10::List<c10::optional<Tensor>>& scales,
                      std::vector<int64_t> offsets, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && !packed.empty() && packed.size() == scales.size() &&
                  offsets.size() == packed.size() + 1 && offsets.front() == 0 && offsets.back() == x.size(0),
              "tandem invariant_linear_grouped: a weight and scales a group, offsets from 0 to the rows");
  std::vector<AnyWeights> weights;
  std::vector<Tensor> kept;  // contiguous scales, alive through the call
  for (size_t g = 0; g < packed.size(); ++g) {
    TORCH_CHECK(offsets[g] <= offsets[g + 1] && packed[g].size(0) == packed[0].size(0),
                "tandem invariant_linear_grouped: offsets in order, every weight the same shape");
    const c10::optional<Tensor> s = scales.get(g);
    kept.push_back(s.has_value() ? s->contiguous() : Tensor());
    weights.push_back(weights_of(x, packed[g], kept.back(), N));
  }
  return grouped(x, weights, offsets, packed[0].size(0), Tensor(), N);
}

// One matmul a head in one call (multi-head latent attention's absorbed projections): x [M, H, K]
// (any row and head strides, k contiguous), packed [H, NB, K, 16] in x's dtype, out [M, H, N].
// Each head's outputs are summed exactly as linear() sums them: the same bits as H calls.
Tensor invariant_linear_heads(const Tensor& x, const Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "tandem invariant_linear_heads: x must be fp32 or bf16 [rows, heads, in], in contiguous");
  const int64_t M = x.size(0), H = x.size(1), K = x.size(2);
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) == H &&
                  packed.size(2) == (x.scalar_type() == at::kBFloat16 ? padded_k(K) : K) && packed.size(3) == kBlock &&
                  packed.is_contiguous() && packed.scalar_type() == x.scalar_type() && packed.size(1) * kBlock >= N,
              "tandem invariant_linear_heads: the packed weights must be [heads, ceil(out / 16), in, 16] in x's dtype");
  const int64_t NB = packed.size(1), ldy = NB * kBlock;
  auto out = at::empty({M, H, N}, x.options());
  if (M == 0) return out;
  auto y = at::empty({H, M, ldy}, x.options().dtype(at::kFloat));
  // bf16: a row a head, each with its pair words
  const Tensor xf = x.scalar_type() == at::kFloat ? x : widened_tiny_to_zero(x.reshape({M * H, K}));
  const float* xp = xf.data_ptr<float>();
  const int64_t head_stride = x.scalar_type() == at::kFloat ? xf.stride(1) : xf.stride(0);
  const int64_t ldx = x.scalar_type() == at::kFloat ? xf.stride(0) : H * head_stride;
  constexpr bool wide = DenseWeights<float>::kWide;
  // one head's (each head's are alike), row chunk by row chunk
  const auto rows = work_items({0, M}, NB, [](size_t) { return wide; }, K, [](size_t) { return int64_t{0}; });
  float* yp = y.data_ptr<float>();
  auto run = [&](const auto* wp) {
    const int64_t per_head = static_cast<int64_t>(rows.size());
    tandem_ops::parallel_items(H * per_head, [&](int64_t item) {
      const int64_t h = item / per_head;
      const auto [g, b0, m0] = rows[item % per_head];
      const int64_t m1 = std::min(M, m0 + kRowChunk);
      using W = std::remove_cv_t<std::remove_pointer_t<decltype(wp)>>;
      const int64_t stored = std::is_same_v<W, float> ? K : padded_k(K);
      panel(xp + h * head_stride, ldx, DenseWeights<W>{wp + h * NB * stored * kBlock, K, NB}, K, m0, m1, b0,
            std::min(NB, b0 + panel_width(m1 - m0, wide)), yp + h * M * ldy, ldy);
    });
  };
  auto finish_heads = [&](auto* op) {
    using T = std::remove_pointer_t<decltype(op)>;
    at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t n = 0; n < N; ++n) op[(m * H + h) * N + n] = static_cast<T>(yp[(h * M + m) * ldy + n]);
    });
  };
  if (x.scalar_type() == at::kFloat) {
    run(packed.data_ptr<float>());
    finish_heads(out.data_ptr<float>());
  } else {
    run(packed.data_ptr<c10::BFloat16>());
    finish_heads(out.data_ptr<c10::BFloat16>());
  }
  return out;
}

// A pack-quantized INT4 weight as published (bytes [N, K / 2]: weight 2j in byte j's low nibble,
// 2j + 1 in its high one, each value + 8; scales [N, K / group], bf16 or fp32) as the kernel's
// records, in one pass (a weight of hundreds of GB is packed at load).
Tensor int4_records(const Tensor& bytes, const Tensor& scales) {
  TORCH_CHECK(bytes.dim() == 2 && bytes.scalar_type() == at::kByte && bytes.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == bytes.size(0) && scales.is_contiguous() &&
                  (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kBFloat16),
              "tandem int4_records: bytes [out, in / 2] uint8 and scales [out, in / group] (bf16 or fp32)");
  const int64_t N = bytes.size(0), K = bytes.size(1) * 2, groups = scales.size(1), group = groups ? K / groups : 0;
  TORCH_CHECK(groups && group * groups == K && group % 8 == 0, "tandem int4_records: a group of whole words dividing in");
  const int64_t scale_words = kBlock * static_cast<int64_t>(scales.element_size()) / 4;
  const int64_t NB = (N + kBlock - 1) / kBlock, record = group / 8 * kBlock + scale_words;
  // columns past N: zero
  auto out = N % kBlock ? at::zeros({NB, groups, record}, bytes.options().dtype(at::kInt))
                        : at::empty({NB, groups, record}, bytes.options().dtype(at::kInt));
  const uint8_t* in = bytes.data_ptr<uint8_t>();
  const auto* sc = static_cast<const uint8_t*>(scales.data_ptr());
  uint32_t* o = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  const int64_t scale_row = groups * scales.element_size();
  at::parallel_for(0, NB * groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / groups, g = item % groups;
      const Panel p = panel_holding(kLayoutPanelInt4, NB, b);
      uint32_t* rec = o + (p.first * groups + g * p.width) * record;  // the panel's group g
      const int64_t i = b - p.first, width = p.width;
      for (int64_t c = 0; c < kBlock && b * kBlock + c < N; ++c) {
        const int64_t n = b * kBlock + c;
        for (int64_t w = 0; w < group / 8; ++w) {
          const uint8_t* src = in + n * (K / 2) + (g * group + w * 8) / 2;
          uint32_t word = 0;
          for (int i = 0; i < 8; ++i) {
            const uint32_t nib = ((src[i / 2] >> (4 * (i % 2))) & 0xF) ^ 0x8;  // value + 8 -> two's complement
            word |= nib << (4 * nibble_of(i));
          }
          rec[(w * width + i) * kBlock + c] = word;
        }
        std::memcpy(reinterpret_cast<uint8_t*>(rec + group / 8 * width * kBlock + i * scale_words) + c * scales.element_size(),
                    sc + n * scale_row + g * scales.element_size(), scales.element_size());
      }
    }
  });
  return out;
}

// MXFP4 weights as published (blocks [N, K / 32, 16]: two e2m1 values a byte, the low nibble
// first; e8m0 scales [N, K / 32]) expanded by the matmul's own vector code (vfp4_doubled,
// ve8m0_halved) into fp32 [N, K]: what the kernel multiplies by.
Tensor mxfp4_dequantize(const Tensor& blocks, const Tensor& scales) {
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(2) == 16 && blocks.scalar_type() == at::kByte && scales.dim() == 2 &&
                  scales.scalar_type() == at::kByte && scales.size(0) == blocks.size(0) &&
                  scales.size(1) == blocks.size(1),
              "tandem mxfp4_dequantize: blocks [out, in / 32, 16] and scales [out, in / 32], uint8");
  const Tensor b = blocks.contiguous(), s = scales.contiguous();
  const int64_t N = b.size(0), groups = b.size(1);
  auto out = at::empty({N, groups * kMxfp4Group}, b.options().dtype(at::kFloat));
  const uint8_t* bp = b.data_ptr<uint8_t>();
  const uint8_t* sp = s.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      uint8_t scale_bytes[kLanes];
      std::fill_n(scale_bytes, kLanes, sp[item]);
      const vec scale = ve8m0_halved(scale_bytes);
      for (int64_t j = 0; j < 16; j += kLanes) {
        vec low, high;
        vfp4_doubled(bp + item * 16 + j, low, high);
        float lo[kLanes], hi[kLanes];
        vstore(lo, vmul(low, scale));
        vstore(hi, vmul(high, scale));
        for (int l = 0; l < kLanes; ++l) {
          op[item * kMxfp4Group + 2 * (j + l)] = lo[l];
          op[item * kMxfp4Group + 2 * (j + l) + 1] = hi[l];
        }
      }
    }
  });
  return out;
}

Tensor grouped_stacked(const Tensor& x, const Tensor& packed, const Tensor& scales, const std::vector<int64_t>& experts,
                       const std::vector<int64_t>& offsets, int64_t N) {
  return grouped(x, stacked_weights(x, packed, scales, experts, N), offsets, packed.size(1), Tensor(), N);
}

Tensor grouped_stacked_silu(const Tensor& x, const Tensor& packed, const Tensor& scales,
                            const std::vector<int64_t>& experts, const std::vector<int64_t>& offsets, int64_t width) {
  return grouped_silu(x, stacked_weights(x, packed, scales, experts, 2 * width), offsets, packed.size(1), width);
}

}  // namespace tandem_ops

TORCH_LIBRARY_FRAGMENT(TANDEM_OPS_NAMESPACE, m) {
  m.def("invariant_linear(Tensor x, Tensor packed, Tensor? bias, int out_features, Tensor? scales=None) -> Tensor",
        &tandem_ops::invariant_linear);
  m.def("invariant_linear_silu(Tensor x, Tensor packed, int width, Tensor? scales=None) -> Tensor",
        &tandem_ops::invariant_linear_silu);
  m.def("invariant_linear_heads(Tensor x, Tensor packed, int out_features) -> Tensor", &tandem_ops::invariant_linear_heads);
  m.def("int4_records(Tensor bytes, Tensor scales) -> Tensor", &tandem_ops::int4_records);
  m.def("mxfp4_dequantize(Tensor blocks, Tensor scales) -> Tensor", &tandem_ops::mxfp4_dequantize);
  m.def("invariant_linear_grouped(Tensor x, Tensor[] packed, Tensor?[] scales, int[] offsets, int out_features) -> Tensor",
        &tandem_ops::invariant_linear_grouped);
}
