// Batch-invariant paged attention: each query token attends over the keys its position sees,
// read from the paged pool, in an order fixed by that token alone. For a token at position pos
// (keys lo..pos; lo > 0 only under a sliding window, pos - window + 1, or within chunks of
// local attention, pos - pos % chunk) and each query head:
//   score_j = scale * dot(q, k_j): 16 lanes, lane l summing d = l, l+16, ... by FMA, the lanes
//             then added as a fixed tree (l + l+8, then + l+4, + l+2, + l+1);
//   p_j     = exp(score_j - max) (vec.h's exp), sum = the p_j in 16 lanes by (j - lo) mod 16, the
//             same tree;
//   out     = (sum_j p_j v_j, FMA in j order, lanes along the value dims) / sum.
// With per-head sinks (gpt-oss), the head's sink logit joins the max and adds exp(sink - max) to
// the sum after the tree; it weighs no value. Without them nothing changes.
// So a token's output does not depend on how many tokens share its step (a prompt, a cached
// tail, draft verification, a decode batch), on the threads (a work item is a kv head and a
// token, or tiles of a prompt's consecutive tokens whose rows are each computed as alone), on
// the order keys are read in (a long prompt's tiles take them a block at a time), or on the
// vector width.
// bf16 (q and the pool in bf16) takes units of two values (attention_units.h), every value below
// 2^-55 counting as 0: score lane l sums the dim pairs (2i, 2i+1) for i = l, l+16, ... (dims
// past D: 0), each adding dim 2i+1's product, then 2i's; p_j is rounded to bf16 (below 2^-55:
// 0), and summed and weighed as rounded; out sums the key pairs (2t, 2t+1) by position, t in
// order, the odd key's product, then the even one's (a key outside lo..pos: 0). A bf16 product
// is exact in fp32, so AVX512-BF16's vdpbf16ps adds a pair in one instruction, other builds in
// two FMAs, to the same bits. The output is rounded once.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_units.h"
#include "vec.h"

namespace {

using at::Tensor;
using namespace tandem_vec;

#if defined(__AVX512F__)
constexpr int kTileRows = 4, kTileKeys = 3;  // score tiles: accumulators that fit the registers
#else
constexpr int kTileRows = 2, kTileKeys = 2;
#endif
constexpr int64_t kTileRowsMax = 16;  // query rows a prompt tile holds: its tokens times a kv head's query heads

// The score sums of RB query rows (D units apart) against KB keys: acc[r][k] over d in 16-lane
// chunks, then each reduced as one tree (the D % 16 tail into the first lanes before it).
template <int RB, int KB, typename U>
inline void score_tile(const U* q, int64_t D, const U* const* keys, float* out, int64_t ld, float scale) {
  vec acc[RB][KB][kVecs];
  for (int r = 0; r < RB; ++r)
    for (int k = 0; k < KB; ++k)
      for (int v = 0; v < kVecs; ++v) acc[r][k][v] = vzero();
  const int64_t whole = D / kBlock * kBlock;
  for (int64_t d = 0; d < whole; d += kBlock) {
    UnitVec<U> kv[KB][kVecs];
    for (int k = 0; k < KB; ++k)
      for (int v = 0; v < kVecs; ++v) kv[k][v] = uload(keys[k] + d + v * kLanes);
    for (int r = 0; r < RB; ++r)
      for (int v = 0; v < kVecs; ++v) {
        const UnitVec<U> qv = uload(q + r * D + d + v * kLanes);
        for (int k = 0; k < KB; ++k) acc[r][k][v] = vmac(acc[r][k][v], qv, kv[k][v]);
      }
  }
  for (int r = 0; r < RB; ++r)
    for (int k = 0; k < KB; ++k) {
      float sum;
      if (whole == D) {
        sum = vtree_sum(acc[r][k]);
      } else {
        float lanes[kBlock];
        for (int v = 0; v < kVecs; ++v) vstore(lanes + v * kLanes, acc[r][k][v]);
        for (int64_t d = whole; d < D; ++d)
          lanes[d - whole] = smac(lanes[d - whole], q[r * D + d], keys[k][d]);
        sum = tree_sum16(lanes);
      }
      out[r * ld + k] = sum * scale;
    }
}

#if defined(__AVX512F__)
// score_tile<1, 16> for D a multiple of 16, its 16 trees reduced together.
template <typename U>
inline void score_row_x16(const U* q, int64_t D, const U* const* keys, float* out, float scale) {
  __m512 acc[16];
  for (int k = 0; k < 16; ++k) acc[k] = vzero();
  for (int64_t d = 0; d < D; d += kBlock) {
    const UnitVec<U> qv = uload(q + d);
    for (int k = 0; k < 16; ++k) acc[k] = vmac(acc[k], qv, uload(keys[k] + d));
  }
  vstore(out, vmul(tree_sum16_x16(acc), vbroadcast(scale)));
}
#elif defined(__AVX2__) && defined(__FMA__)
// tree_sum16 of 4 keys' accumulators (two 8-lane vectors a key) at once: the same adds, paired
// across keys by shuffles instead of within each. Returns the sums in key order.
inline __m128 tree_sum16_x4(const __m256 (&a)[4][2]) {
  __m256 s8[4];
  for (int k = 0; k < 4; ++k) s8[k] = _mm256_add_ps(a[k][0], a[k][1]);  // l[i] + l[i+8]
  // s8[i] + s8[i+4]: key 0 (then 2) in the low half, key 1 (then 3) in the high one
  const __m256 x = _mm256_add_ps(_mm256_permute2f128_ps(s8[0], s8[1], 0x20), _mm256_permute2f128_ps(s8[0], s8[1], 0x31));
  const __m256 y = _mm256_add_ps(_mm256_permute2f128_ps(s8[2], s8[3], 0x20), _mm256_permute2f128_ps(s8[2], s8[3], 0x31));
  // (s4[0] + s4[2]), (s4[1] + s4[3]): low half keys 0, 0, 2, 2; high half 1, 1, 3, 3
  const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_hadd_ps(z, z);  // their sum: low half keys 0, 2, 0, 2; high half 1, 3, 1, 3
  return _mm_unpacklo_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// score_tile<1, 4> for D a multiple of 16, its 4 trees reduced together (one row: 8 accumulators
// leave room for the row's vectors).
template <typename U>
inline void score_row_x4(const U* q, int64_t D, const U* const* keys, float* out, float scale) {
  __m256 acc[4][2];
  for (int k = 0; k < 4; ++k) acc[k][0] = acc[k][1] = vzero();
  for (int64_t d = 0; d < D; d += kBlock) {
    const UnitVec<U> q0 = uload(q + d), q1 = uload(q + d + kLanes);
    for (int k = 0; k < 4; ++k) {
      acc[k][0] = vmac(acc[k][0], q0, uload(keys[k] + d));
      acc[k][1] = vmac(acc[k][1], q1, uload(keys[k] + d + kLanes));
    }
  }
  _mm_storeu_ps(out, _mm_mul_ps(tree_sum16_x4(acc), _mm_set1_ps(scale)));
}
#endif

// Keys or values ahead of the one about to be read, brought into cache: the pool's pages are
// scattered, so the hardware prefetcher cannot follow a sequence's rows (a hint only). kAheadKeys
// ahead into L1; where a row is read once (packing bf16 blocks, the per-row path), also Far: a block
// of keys (kFarKeys) ahead into L2, which holds more misses in flight. A decode batch's attention
// waits on memory, not on its products (64 decodes at 600 keys: 0.70x the time with it).
// TANDEM_PREFETCH (vec.h): inlined early, or GCC drops the hint with the call.
constexpr int64_t kAheadKeys = 8, kFarKeys = 64;
template <int Locality, typename T>
TANDEM_PREFETCH void prefetch_row(const T* row, int64_t n) {
  for (int64_t b = 0; b < n * int64_t{sizeof(T)}; b += kLine)
    __builtin_prefetch(reinterpret_cast<const char*>(row) + b, 0, Locality);
}
template <bool Far = false, typename T>
TANDEM_PREFETCH void prefetch_ahead(const T* const* rows, int64_t i, int64_t L, int64_t d0, int64_t n) {
  if (i + kAheadKeys < L) prefetch_row<3>(rows[i + kAheadKeys] + d0, n);
  if (Far && i + kFarKeys < L) prefetch_row<1>(rows[i + kFarKeys] + d0, n);
}

// bf16 keys and values as Words (attention_units.h), a block of keys at a time: a key's D values
// as key_words(D) words (zero-padded to whole 16-word vectors), a pair of keys' values (keys 2t
// and 2t + 1 of the block) as Dv words. fp32 ones are read where they lie in the pool.
template <typename U>
constexpr int64_t kKeysPerUnit = std::is_same_v<U, float> ? 1 : 2;
inline int64_t key_words(int64_t D) { return (D + 31) / 32 * 16; }

template <typename U>
struct UnitBlocks {
  std::vector<U> packed;
  std::vector<const U*> rows;
};

// Keys [j0, j1) of [0, L) as units (a null key: zero).
template <typename U, typename T>
const U* const* key_units(const T* const* keys, int64_t j0, int64_t j1, int64_t L, int64_t D, UnitBlocks<U>& b) {
  if constexpr (std::is_same_v<U, float>) {
    return keys + j0;
  } else {
    const int64_t w = key_words(D);
    b.packed.resize((j1 - j0) * w);
    b.rows.resize(j1 - j0);
    for (int64_t j = j0; j < j1; ++j) {
      Word* row = b.packed.data() + (j - j0) * w;
      prefetch_ahead<true>(keys, j, L, 0, D);
      pack_words(keys[j], D, row, w);
      b.rows[j - j0] = row;
    }
    return b.rows.data();
  }
}

// The values of keys [j0, j1) of [0, L) (j0 even) as units: a key's, or a pair's (a key at j1 or
// null: zero).
template <typename U, typename T>
const U* const* value_units(const T* const* values, int64_t j0, int64_t j1, int64_t L, int64_t Dv, UnitBlocks<U>& b) {
  if constexpr (std::is_same_v<U, float>) {
    return values + j0;
  } else {
    const int64_t n = (j1 - j0 + 1) / 2;
    b.packed.resize(n * Dv);
    b.rows.resize(n);
    for (int64_t t = 0; t < n; ++t) {
      Word* row = b.packed.data() + t * Dv;
      for (int64_t j = j0 + 2 * t; j < std::min(j1, j0 + 2 * t + 2); ++j) prefetch_ahead<true>(values, j, L, 0, Dv);
      pack_pair_words(values[j0 + 2 * t], j0 + 2 * t + 1 < j1 ? values[j0 + 2 * t + 1] : nullptr, Dv, row);
      b.rows[t] = row;
    }
    return b.rows.data();
  }
}

// Scores of `rows` query rows (D units apart) against keys [0, L): out [rows, ld]. A block of
// keys at a time for every row, so a prompt tile's rows share each key's load.
template <typename U>
void score_rows(const U* q, int64_t rows, int64_t D, const U* const* keys, int64_t L, float* out, int64_t ld,
                float scale) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if (D % kBlock == 0)
    for (; i + 16 <= L; i += 16) {
      for (int j = 0; j < 16; ++j) prefetch_ahead<true>(keys, i + j, L, 0, D);
      for (int64_t r = 0; r < rows; ++r) score_row_x16(q + r * D, D, keys + i, out + r * ld + i, scale);
    }
#elif defined(__AVX2__) && defined(__FMA__)
  if (D % kBlock == 0)
    for (; i + 4 <= L; i += 4) {
      for (int j = 0; j < 4; ++j) prefetch_ahead<true>(keys, i + j, L, 0, D);
      for (int64_t r = 0; r < rows; ++r) score_row_x4(q + r * D, D, keys + i, out + r * ld + i, scale);
    }
#endif
  const int64_t done = i;
  auto rest = [&](auto rb, int64_t r) {  // the keys left, RB rows from row r
    constexpr int RB = decltype(rb)::value;
    int64_t k = done;
    for (; k + kTileKeys <= L; k += kTileKeys)
      score_tile<RB, kTileKeys>(q + r * D, D, keys + k, out + r * ld + k, ld, scale);
    for (; k < L; ++k) score_tile<RB, 1>(q + r * D, D, keys + k, out + r * ld + k, ld, scale);
  };
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) rest(std::integral_constant<int, kTileRows>{}, r);
  for (; r < rows; ++r) rest(std::integral_constant<int, 1>{}, r);
}

// a[r][d0 .. d0 + NV * kLanes) += sum over units [i0, i1) (keys, or bf16 key pairs), in order, of
// p[r][i] * value_i for NR rows (lanes along the dims; from zero when `fresh`): the rows share
// each value load, and each row's sums are its own chain, carried through `a` from one block of
// keys to the next.
template <int NR, int NV, typename U>
inline void weigh_values(const U* p, int64_t ldp, const U* const* values, int64_t i0, int64_t i1, int64_t L,
                         int64_t d0, float* a, int64_t lda, bool fresh) {
  vec acc[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = fresh ? vzero() : vload(a + r * lda + d0 + v * kLanes);
  for (int64_t i = i0; i < i1; ++i) {
    prefetch_ahead<true>(values, i, L, d0, NV * kLanes);
    UnitVec<U> value[NV];
    for (int v = 0; v < NV; ++v) value[v] = uload(values[i] + d0 + v * kLanes);
    for (int r = 0; r < NR; ++r) {
      const UnitVec<U> pv = ubroadcast(p[r * ldp + i]);
      for (int v = 0; v < NV; ++v) acc[r][v] = vmac(acc[r][v], pv, value[v]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) vstore(a + r * lda + d0 + v * kLanes, acc[r][v]);
}

// Rows [0, NR) of the weighed values over units [i0, i1): p [NR, ldp] (the softmax numerators),
// a [NR, lda].
template <int NR, typename U>
void weigh_rows(const U* p, int64_t ldp, const U* const* values, int64_t i0, int64_t i1, int64_t L, int64_t Dv,
                float* a, int64_t lda, bool fresh) {
  constexpr int kMaxVecs = kLanes == 16 ? 4 : 2;  // NR x kMaxVecs accumulators fit the registers
  int64_t d = 0;
  for (; d + kMaxVecs * kLanes <= Dv; d += kMaxVecs * kLanes)
    weigh_values<NR, kMaxVecs>(p, ldp, values, i0, i1, L, d, a, lda, fresh);
  if (kMaxVecs > 2 && d + 2 * kLanes <= Dv) {  // e.g. 32 dims: both vectors over one pass of the keys
    weigh_values<NR, 2>(p, ldp, values, i0, i1, L, d, a, lda, fresh);
    d += 2 * kLanes;
  }
  for (; d + kLanes <= Dv; d += kLanes) weigh_values<NR, 1>(p, ldp, values, i0, i1, L, d, a, lda, fresh);
  for (int r = 0; r < NR; ++r)
    for (int64_t e = d; e < Dv; ++e) {  // the last dims past whole vectors: the same products, one lane at a time
      float acc = fresh ? 0.f : a[r * lda + e];
      for (int64_t i = i0; i < i1; ++i) acc = smac(acc, p[r * ldp + i], values[i][e]);
      a[r * lda + e] = acc;
    }
}

// a [R, Dv] = p [R, ldp] (units) times the values of keys [0, L), a block of keys at a time for
// every row, so that a prompt tile's rows read each block's values from the L1 cache.
constexpr int64_t kWeighKeys = 64;
template <typename U, typename T>
void weigh_all(const U* p, int64_t ldp, const T* const* values, int64_t L, int64_t Dv, float* a, int64_t R,
               UnitBlocks<U>& blocks) {
  for (int64_t i0 = 0; i0 < L; i0 += kWeighKeys) {
    const int64_t i1 = std::min(L, i0 + kWeighKeys), u0 = i0 / kKeysPerUnit<U>;
    const int64_t n = (i1 - i0 + kKeysPerUnit<U> - 1) / kKeysPerUnit<U>;
    const U* const* vb = value_units(values, i0, i1, L, Dv, blocks);
    const U* pb = p + u0;
    const int64_t Lb = std::is_same_v<U, float> ? L - i0 : n;  // the units prefetch_ahead may reach
    const bool fresh = i0 == 0;
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) weigh_rows<4>(pb + r * ldp, ldp, vb, 0, n, Lb, Dv, a + r * Dv, Dv, fresh);
    switch (R - r) {
      case 3: weigh_rows<3>(pb + r * ldp, ldp, vb, 0, n, Lb, Dv, a + r * Dv, Dv, fresh); break;
      case 2: weigh_rows<2>(pb + r * ldp, ldp, vb, 0, n, Lb, Dv, a + r * Dv, Dv, fresh); break;
      case 1: weigh_rows<1>(pb + r * ldp, ldp, vb, 0, n, Lb, Dv, a + r * Dv, Dv, fresh); break;
    }
  }
}

// A prompt tile with its rows along the lanes: rows [0, 16) of a virtual vector (kVecs native
// ones), the rows past the tile's zero. Each (row, key) is computed as in the path above, in a
// lane of its own: a score's 16 partial sums (lane l: d = l, l + 16, ... by FMA from zero) are
// vectors over the rows, added as the same tree; the sum of p by key index mod 16, then that
// tree; the values weighed by FMA in key order. So the bits are the per-row path's, while a
// key's loads and the tree's adds serve all 16 rows at once (no per-row tree of shuffles).
struct Rows {
  vec v[kVecs];
};
inline Rows rows_zero() {
  Rows r;
  for (int i = 0; i < kVecs; ++i) r.v[i] = vzero();
  return r;
}
inline Rows rows_load(const float* p) {
  Rows r;
  for (int i = 0; i < kVecs; ++i) r.v[i] = vload(p + i * kLanes);
  return r;
}
inline void rows_store(float* p, const Rows& r) {
  for (int i = 0; i < kVecs; ++i) vstore(p + i * kLanes, r.v[i]);
}
inline Rows rows_add(const Rows& a, const Rows& b) {
  Rows r;
  for (int i = 0; i < kVecs; ++i) r.v[i] = vadd(a.v[i], b.v[i]);
  return r;
}
template <typename U>  // the 16 rows' units
struct UnitRows {
  UnitVec<U> v[kVecs];
};
template <typename U>
inline UnitRows<U> rows_uload(const U* p) {
  UnitRows<U> r;
  for (int i = 0; i < kVecs; ++i) r.v[i] = uload(p + i * kLanes);
  return r;
}
template <typename U>
inline Rows rows_mac(const Rows& acc, const UnitRows<U>& a, const U* b) {  // acc + a * (*b), lane by lane
  Rows r;
  for (int i = 0; i < kVecs; ++i) r.v[i] = vmac(acc.v[i], a.v[i], b);
  return r;
}

// The tiles that take the lanes, from measurement (one thread, this build against the per-row
// path, 64 sequences at 600 keys): on AVX-512, 12 rows 1.14x, 16 rows of prompts 1.48x, but 8
// rows 0.90x; AVX2's 16 registers of 8 lanes lose at every size (prompts 1.02x, 12 rows 0.78x,
// 8 rows 0.59x), so there every tile keeps a row a pass.
constexpr int64_t kLaneRowsMin = kLanes == 16 ? 9 : kBlock + 1;
constexpr int kKeysInLanes = kVecs == 1 ? 4 : 1;  // keys a pass: their accumulators fit the registers

// Scores of the 16 rows (qt [D][16] units) against KB keys (D units each): out[k] = the tree of
// the lane chains, times scale. The tree's quarters one at a time (s4[i]: lanes i, i + 8, i + 4,
// i + 12), each over d in passes of 16, so a quarter's chains share the rows' loads across keys
// and the registers hold them.
template <int KB, typename U>
__attribute__((always_inline)) inline void score_keys_in_lanes(const U* qt, int64_t D, const U* const* keys,
                                                               float scale, Rows* out) {
  const U* key[KB];  // in registers, not read again for every product
  for (int k = 0; k < KB; ++k) key[k] = keys[k];
  Rows s4[4][KB];
  for (int i = 0; i < 4; ++i) {
    constexpr int kLanesOf[4] = {0, 8, 4, 12};  // l[i] + l[i+8], then + (l[i+4] + l[i+12])
    Rows acc[4][KB];
    for (int a = 0; a < 4; ++a)
      for (int k = 0; k < KB; ++k) acc[a][k] = rows_zero();
    for (int64_t d0 = 0; d0 < D; d0 += kBlock)
      for (int a = 0; a < 4; ++a) {
        const int64_t d = d0 + i + kLanesOf[a];
        if (d >= D) continue;
        const UnitRows<U> q = rows_uload(qt + d * kBlock);
        for (int k = 0; k < KB; ++k) acc[a][k] = rows_mac(acc[a][k], q, key[k] + d);
      }
    for (int k = 0; k < KB; ++k) s4[i][k] = rows_add(rows_add(acc[0][k], acc[1][k]), rows_add(acc[2][k], acc[3][k]));
  }
  const vec sv = vbroadcast(scale);
  for (int k = 0; k < KB; ++k) {
    const Rows sum = rows_add(rows_add(s4[0][k], s4[2][k]), rows_add(s4[1][k], s4[3][k]));
    for (int v = 0; v < kVecs; ++v) out[k].v[v] = vmul(sum.v[v], sv);
  }
}

// The values weighed, dims [e0, e0 + EB), over units [0, L) of a block (keys, or bf16 key pairs):
// at[e] += sum over them, in order, of p * value, for the 16 rows of p [L][16]. `at` starts at
// zero and carries each chain from one block of keys to the next (a store and a load change no
// bit).
template <int EB, typename U>
inline void weigh_dims_in_lanes(const U* p, const U* const* values, int64_t L, int64_t e0, float* at) {
  Rows acc[EB];
  for (int e = 0; e < EB; ++e) acc[e] = rows_load(at + (e0 + e) * kBlock);
  for (int64_t j = 0; j < L; ++j) {
    prefetch_ahead(values, j, L, e0, EB);
    const UnitRows<U> pj = rows_uload(p + j * kBlock);
    const U* value = values[j] + e0;
    asm("" : "+r"(value));  // one base register, the dims at fixed offsets (not an offset register each)
    for (int e = 0; e < EB; ++e) acc[e] = rows_mac(acc[e], pj, value + e);
  }
  for (int e = 0; e < EB; ++e) rows_store(at + (e0 + e) * kBlock, acc[e]);
}

// Long prompts: keys are taken a block at a time (kKeyBlockBytes, which stay in L2), every tile of
// a group of kGroupTiles using a block before the next, so the group reads the keys and values
// from memory once, not once a tile (16 rows against 32k keys of 256 dims read 64 MB for 5 ms of
// FMAs: 87 GF/s, memory-bound). Only past kGroupFromBytes of a tile's keys and values, which L3
// no longer holds: below, a group's scores outgrow L2 and cost more than its reads save
// (bench/kernels.py: gemma-3-270m's heads at 16k 0.54x the time, at 8k 0.80x; SmolLM2's at 4k
// 1.13x when grouped, so not grouped). That is fp32's; bf16's tiles always group (attend).
constexpr int64_t kKeyBlockBytes = 128 * 1024;
constexpr int64_t kGroupTiles = 8;
constexpr int64_t kGroupFromBytes = 4 << 20;

template <typename U>
struct LaneScratch {
  std::vector<U> qt, p;
  std::vector<float> st, top, lane_sums, at;
  UnitBlocks<U> blocks;
};

// exp(x) for x <= 0, as vec.h's exp computes a lane of it on every build.
inline float exp_nonpositive(float x) {
  float lanes[kLanes];
  vstore(lanes, vexp_nonpositive(vbroadcast(x)));
  return lanes[0];
}

// A group of a prompt's n consecutive tokens (qu [n * R, Du] units, token-major) over keys [0, L),
// token i seeing keys first[i] .. L - n + i (first: 0 but under a sliding window or chunks), in tiles of
// tile_tokens tokens (tile_tokens * R rows, at most 16, along the lanes): acc [n * R, Dv] (the
// weighed values) and sums [n * R], as the per-row path leaves them. Scores first (a block of
// keys for every tile), then each tile's max, then p and the weighed values (a block of values
// for every tile). A row's keys outside its own range score -inf, so their p is 0 and adds
// nothing. Its sum's lanes are keyed by the tile's first key, not its token's: a rotation of its
// own lanes, which the tree adds to the same bits (each level adds lanes a fixed distance apart,
// cyclically, and a + b is b + a). row_sinks: each row's head's sink logit, or null.
template <typename U, typename T>
void attend_in_lanes(const U* qu, int64_t n, int64_t tile_tokens, int64_t R, int64_t D, int64_t Du, int64_t Dv,
                     const T* const* keys, const T* const* values, int64_t L, const int64_t* first, float scale,
                     float* acc, float* sums, const float* row_sinks, LaneScratch<U>& scratch) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  constexpr int64_t kPer = kKeysPerUnit<U>;
  const int64_t tiles = (n + tile_tokens - 1) / tile_tokens;
  const int64_t row_bytes = int64_t{sizeof(T)} * std::max(D, Dv);
  const int64_t B = std::max<int64_t>(kBlock, kKeyBlockBytes / row_bytes / kBlock * kBlock);
  auto tile_n = [&](int64_t g) { return std::min(tile_tokens, n - g * tile_tokens); };
  auto tile_first = [&](int64_t g) { return first[g * tile_tokens]; };  // its first token's first key
  auto tile_end = [&](int64_t g) { return L - n + g * tile_tokens + tile_n(g); };  // past its last token's
  auto seen = [&](int64_t g) {  // the keys every row of the tile sees: [its last token's first, its first token's last]
    return std::pair<int64_t, int64_t>{first[g * tile_tokens + tile_n(g) - 1], tile_end(g) - tile_n(g) + 1};
  };
  auto& [qt, p, st, top, lane_sums, at, blocks] = scratch;
  qt.assign(tiles * Du * kBlock, U{});
  for (int64_t row = 0; row < n * R; ++row) {
    U* t = qt.data() + row / (tile_tokens * R) * Du * kBlock + row % (tile_tokens * R);
    for (int64_t d = 0; d < Du; ++d) t[d * kBlock] = qu[row * Du + d];
  }
  st.resize(tiles * L * kBlock);
  top.resize(tiles * kBlock);
  std::vector<Rows> m(tiles);
  for (auto& mg : m)
    for (int i = 0; i < kVecs; ++i) mg.v[i] = vbroadcast(kNone);
  for (int64_t j0 = 0; j0 < L; j0 += B) {  // scores, and the max of those every row of a tile sees
    const int64_t j1 = std::min(L, j0 + B);
    const U* const* kb = key_units(keys, j0, j1, L, D, blocks);
    for (int64_t g = 0; g < tiles; ++g) {
      const int64_t end = std::min(j1, tile_end(g));
      const auto [seen_from, seen_to] = seen(g);
      const U* q = qt.data() + g * Du * kBlock;
      float* s = st.data() + g * L * kBlock;
      auto score = [&](auto kbn, int64_t j) __attribute__((always_inline)) {
        constexpr int KB = decltype(kbn)::value;
        Rows out[KB];
        for (int k = 0; k < KB; ++k) prefetch_ahead(kb, j - j0 + k, j1 - j0, 0, Du);
        score_keys_in_lanes<KB>(q, Du, kb + (j - j0), scale, out);
        for (int k = 0; k < KB; ++k) rows_store(s + (j + k) * kBlock, out[k]);
      };
      int64_t j = std::max(j0, tile_first(g));
      for (; j + kKeysInLanes <= end; j += kKeysInLanes) score(std::integral_constant<int, kKeysInLanes>{}, j);
      for (; j < end; ++j) score(std::integral_constant<int, 1>{}, j);
      for (int64_t k = std::max(j0, seen_from); k < std::min(end, seen_to); ++k) {
        const Rows sk = rows_load(s + k * kBlock);
        for (int i = 0; i < kVecs; ++i) m[g].v[i] = vmax(m[g].v[i], sk.v[i]);
      }
    }
  }
  for (int64_t g = 0; g < tiles; ++g) {  // the keys some rows do not see: -inf there, then the max
    const int64_t t0 = g * tile_tokens, ng = tile_n(g), rows = ng * R, end = tile_end(g);
    const auto [seen_from, seen_to] = seen(g);
    float* s = st.data() + g * L * kBlock;
    for (int64_t k = tile_first(g); k < end; ++k) {
      if (k >= seen_from && k < seen_to) continue;
      for (int64_t i = 0; i < ng; ++i)
        if (k < first[t0 + i] || k > end - ng + i) std::fill_n(s + k * kBlock + i * R, R, kNone);
      const Rows sk = rows_load(s + k * kBlock);
      for (int i = 0; i < kVecs; ++i) m[g].v[i] = vmax(m[g].v[i], sk.v[i]);
    }
    float* t = top.data() + g * kBlock;  // each row's max, with its sink
    if (row_sinks) {
      std::fill_n(t, kBlock, kNone);
      std::copy_n(row_sinks + t0 * R, rows, t);
      const Rows sink = rows_load(t);
      for (int i = 0; i < kVecs; ++i) m[g].v[i] = vmax(m[g].v[i], sink.v[i]);
    }
    rows_store(t, m[g]);
  }
  lane_sums.assign(tiles * kBlock * kBlock, 0.f);  // a tile's 16 Rows: key index mod 16
  at.assign(tiles * Dv * kBlock, 0.f);
  p.resize((B / kPer + 1) * kBlock);
  constexpr int kDims = kVecs == 1 ? 16 : kVecs == 2 ? 4 : 1;  // accumulators that fit the registers
  for (int64_t j0 = 0; j0 < L; j0 += B) {  // p, its sums and the weighed values
    const int64_t j1 = std::min(L, j0 + B);
    const U* const* vb = value_units(values, j0, j1, L, Dv, blocks);
    for (int64_t g = 0; g < tiles; ++g) {
      const int64_t from = std::max(j0, tile_first(g)), end = std::min(j1, tile_end(g));
      if (end <= from) continue;
      const Rows mg = rows_load(top.data() + g * kBlock);
      const float* s = st.data() + g * L * kBlock;
      float* sum = lane_sums.data() + g * kBlock * kBlock;
      auto numerator = [&](int64_t k) {  // key k's p for the tile's rows (0 outside [from, end)), summed
        Rows pk = rows_zero();
        if (k < from || k >= end) return pk;
        const Rows sk = rows_load(s + k * kBlock);
        for (int i = 0; i < kVecs; ++i) {
          pk.v[i] = vexp_nonpositive(vsub(sk.v[i], mg.v[i]));
          if constexpr (!std::is_same_v<U, float>) pk.v[i] = kept_bf16(pk.v[i]);
        }
        float* lane = sum + (k - tile_first(g)) % kBlock * kBlock;
        rows_store(lane, rows_add(rows_load(lane), pk));
        return pk;
      };
      const int64_t base = from - (from - j0) % kPer;  // bf16: the pair from an even key of the block
      for (int64_t k = base; k < end; k += kPer) {
        U* pu = p.data() + (k - base) / kPer * kBlock;
        if constexpr (std::is_same_v<U, float>) {
          rows_store(pu, numerator(k));
        } else {
          const Rows even = numerator(k), odd = numerator(k + 1);
          for (int i = 0; i < kVecs; ++i) store_words(pu + i * kLanes, even.v[i], odd.v[i]);
        }
      }
      float* a = at.data() + g * Dv * kBlock;
      const U* const* v = vb + (base - j0) / kPer;
      const int64_t units = (end - base + kPer - 1) / kPer;
      int64_t e = 0;
      for (; e + kDims <= Dv; e += kDims) weigh_dims_in_lanes<kDims>(p.data(), v, units, e, a);
      for (; e < Dv; ++e) weigh_dims_in_lanes<1>(p.data(), v, units, e, a);
    }
  }
  for (int64_t g = 0; g < tiles; ++g) {
    const int64_t r0 = g * tile_tokens * R, rows = tile_n(g) * R;
    const float* sum = lane_sums.data() + g * kBlock * kBlock;
    Rows lane[kBlock];
    for (int k = 0; k < kBlock; ++k) lane[k] = rows_load(sum + k * kBlock);
    float total[kBlock];
    rows_store(total, tree_sum16(lane, rows_add));
    const float* t = top.data() + g * kBlock;
    for (int64_t r = 0; r < rows; ++r)
      sums[r0 + r] = row_sinks ? total[r] + exp_nonpositive(row_sinks[r0 + r] - t[r]) : total[r];
    const float* a = at.data() + g * Dv * kBlock;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < Dv; ++d) acc[(r0 + r) * Dv + d] = a[d * kBlock + r];
  }
}

template <typename T>
void attend(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages, const Tensor& block_tables,
            const Tensor& token_seq, const Tensor& token_pos, int64_t window, double scale, const float* sinks,
            Tensor& out) {
  const int64_t T_ = q.size(0), H = q.size(1), D = q.size(2), KVH = k_pages.size(2), Dv = v_pages.size(3);
  const int64_t R = H / KVH, BS = k_pages.size(1);
  const T* qp = q.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);  // q may be a view (of q, k and v together)
  const T* kp = k_pages.data_ptr<T>();
  const T* vp = v_pages.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* seqs = token_seq.data_ptr<int64_t>();
  const int64_t* positions = token_pos.data_ptr<int64_t>();
  const int64_t table_stride = block_tables.size(1);
  const int64_t ks0 = k_pages.stride(0), ks1 = k_pages.stride(1), ks2 = k_pages.stride(2);
  const int64_t vs0 = v_pages.stride(0), vs1 = v_pages.stride(1), vs2 = v_pages.stride(2);
  const float fscale = static_cast<float>(scale);
  // Work items: a group of consecutive query tokens of one sequence (a prompt's) and a kv head.
  // A tile of the group's tokens puts its rows (token-major, then the group's query heads) along
  // a vector's lanes, sharing each key and value load; a token's scores outside its own keys
  // (past its position; before its window or chunk) are -inf, so its p there is 0, which adds
  // nothing (x + 0 and fma(0, v, x) are x): each row's bits are those of its token alone. Tiles
  // too small for the lanes take the per-row path, a token at a time where tokens' first keys
  // differ. Tiles whose keys and values outgrow L3 go in groups of kGroupTiles, which take the
  // keys a block at a time together.
  const int64_t tile_tokens = std::max<int64_t>(1, kTileRowsMax / R);
  const bool in_lanes = tile_tokens * R >= kLaneRowsMin && tile_tokens * R <= kBlock;
  // bf16 tiles always go in groups: packing the keys and values into words, once a group, saves
  // more than the group's scores spilling from L2 costs (bench/kernels.py: SmolLM2's heads at 4k
  // 0.73x the time, gemma3's at 8k 0.83x)
  const int64_t group_from_keys = std::is_same_v<T, float> ? kGroupFromBytes / ((D + Dv) * int64_t{sizeof(T)}) : 0;
  auto first_key = [&](int64_t p) {  // the first key position p sees
    return window > 0 ? std::max<int64_t>(0, p - window + 1) : window < 0 ? p - p % -window : 0;
  };
  std::vector<int64_t> item_start;
  for (int64_t t = 0; t < T_;) {
    item_start.push_back(t);
    const int64_t most = tile_tokens * (in_lanes && window == 0 && positions[t] >= group_from_keys ? kGroupTiles : 1);
    int64_t n = 1;
    while (n < most && t + n < T_ && seqs[t + n] == seqs[t] && positions[t + n] == positions[t] + n) ++n;
    if (n * R < kLaneRowsMin && first_key(positions[t + n - 1]) != first_key(positions[t])) n = 1;
    t += n;
  }
  item_start.push_back(T_);
  const int64_t items = (static_cast<int64_t>(item_start.size()) - 1) * KVH;
  using U = std::conditional_t<std::is_same_v<T, float>, float, Word>;  // what the sums multiply
  constexpr int64_t kPer = kKeysPerUnit<U>;
  const int64_t Du = std::is_same_v<U, float> ? D : key_words(D);  // a query or key row's units
  struct Scratch {
    std::vector<U> qu, p;
    std::vector<float> scores, acc, sums, row_sinks;
    std::vector<const T*> keys, values;
    std::vector<int64_t> first;
    UnitBlocks<U> blocks;
    LaneScratch<U> lanes;
  };
  tandem_ops::parallel_items(items, [] { return Scratch(); }, [&](Scratch& scratch, int64_t item) {
    auto& [qu, p, scores, acc, sums, row_sinks, keys, values, first, blocks, lanes] = scratch;
    const int64_t t0 = item_start[item / KVH], n = item_start[item / KVH + 1] - t0, g = item % KVH;
    const int64_t rows = n * R, pos = positions[t0 + n - 1];  // the item's last position
    // bf16 pairs keys by their positions (2t, 2t + 1): an odd first key follows a zero one
    const int64_t lo = first_key(positions[t0]), shift = kPer == 2 ? lo % 2 : 0;
    const int64_t L = pos - lo + 1 + shift, padded = (L + kBlock - 1) / kBlock * kBlock;
    const int64_t* table = tables + seqs[t0] * table_stride;
    keys.resize(L);
    values.resize(L);
    if (shift) keys[0] = values[0] = nullptr;
    for (int64_t j = lo; j <= pos;) {  // a page at a time
      const int64_t block = table[j / BS], first = j % BS, m = std::min(BS - first, pos + 1 - j);
      for (int64_t o = 0; o < m; ++o) {
        keys[j - lo + shift + o] = kp + block * ks0 + (first + o) * ks1 + g * ks2;
        values[j - lo + shift + o] = vp + block * vs0 + (first + o) * vs1 + g * vs2;
      }
      j += m;
    }
    qu.resize(rows * Du);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t r = 0; r < R; ++r) {
        const T* row = qp + (t0 + i) * qs0 + (g * R + r) * qs1;
        if constexpr (std::is_same_v<U, float>)
          std::copy_n(row, D, qu.data() + (i * R + r) * Du);
        else
          pack_words(row, D, qu.data() + (i * R + r) * Du, Du);
      }
    sums.resize(rows);
    acc.resize(rows * Dv);
    if (sinks) {  // rows token-major, then the kv head's query heads
      row_sinks.resize(rows);
      for (int64_t row = 0; row < rows; ++row) row_sinks[row] = sinks[g * R + row % R];
    }
    const float* sink_of = sinks ? row_sinks.data() : nullptr;
    if (in_lanes && std::min(n, tile_tokens) * R >= kLaneRowsMin) {
      first.resize(n);
      for (int64_t i = 0; i < n; ++i) first[i] = first_key(positions[t0 + i]) - lo + shift;
      attend_in_lanes(qu.data(), n, tile_tokens, R, D, Du, Dv, keys.data(), values.data(), L, first.data(), fscale,
                      acc.data(), sums.data(), sink_of, lanes);
    } else {
      scores.assign(rows * padded, -std::numeric_limits<float>::infinity());  // padding: exp gives 0
      const int64_t per_block = std::is_same_v<U, float> ? L : kWeighKeys;  // bf16 keys: packed a block at a time
      for (int64_t j0 = 0; j0 < L; j0 += per_block) {
        const int64_t j1 = std::min(L, j0 + per_block);
        const U* const* kb = key_units(keys.data(), j0, j1, L, D, blocks);
        score_rows(qu.data(), rows, Du, kb, j1 - j0, scores.data() + j0, padded, fscale);
      }
      if constexpr (!std::is_same_v<U, float>) p.resize(rows * padded / 2);
      for (int64_t row = 0; row < rows; ++row) {
        float* s = scores.data() + row * padded;
        const int64_t own = L - (n - 1 - row / R);  // the keys this row's token sees
        std::fill(s + own, s + L, -std::numeric_limits<float>::infinity());
        std::fill(s, s + shift, -std::numeric_limits<float>::infinity());
        // the largest score, lane-wise over the padded row (padding is -inf): max is exact, so
        // any order gives its value (a zero's sign aside, which exp(s - m) does not see)
        vec lane_max[kVecs];
        for (int v = 0; v < kVecs; ++v) lane_max[v] = vload(s + v * kLanes);
        for (int64_t i = kBlock; i < padded; i += kBlock)
          for (int v = 0; v < kVecs; ++v) lane_max[v] = vmax(lane_max[v], vload(s + i + v * kLanes));
        float lanes[kBlock];
        for (int v = 0; v < kVecs; ++v) vstore(lanes + v * kLanes, lane_max[v]);
        float m = lanes[0];
        for (int i = 1; i < kBlock; ++i) m = std::max(m, lanes[i]);
        if (sink_of) m = std::max(m, sink_of[row]);
        vec lane_sum[kVecs];
        for (int v = 0; v < kVecs; ++v) lane_sum[v] = vzero();
        for (int64_t i = 0; i < padded; i += kBlock)
          for (int v = 0; v < kVecs; ++v) {
            vec pv = vexp_nonpositive(vsub(vload(s + i + v * kLanes), vbroadcast(m)));
            if constexpr (!std::is_same_v<U, float>) pv = kept_bf16(pv);
            vstore(s + i + v * kLanes, pv);
            lane_sum[v] = vadd(lane_sum[v], pv);
          }
        sums[row] = vtree_sum(lane_sum);
        if (sink_of) sums[row] += exp_nonpositive(sink_of[row] - m);
        if constexpr (!std::is_same_v<U, float>)  // keys 2t and 2t + 1's p, paired
          for (int64_t t = 0; t < padded / 2; ++t) {
            uint32_t even, odd;
            std::memcpy(&even, s + 2 * t, 4);
            std::memcpy(&odd, s + 2 * t + 1, 4);
            p[row * padded / 2 + t].bits = even >> 16 | odd;
          }
      }
      if constexpr (std::is_same_v<U, float>)
        weigh_all(scores.data(), padded, values.data(), L, Dv, acc.data(), rows, blocks);
      else
        weigh_all(p.data(), padded / 2, values.data(), L, Dv, acc.data(), rows, blocks);
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t d = 0; d < Dv; ++d)
          op[((t0 + i) * H + g * R + r) * Dv + d] = static_cast<T>(acc[(i * R + r) * Dv + d] / sums[i * R + r]);
  });
}

}  // namespace

namespace tandem_ops {

// q [T, H, D] and k_pages [blocks, block_size, kv_heads, D] and v_pages [..., Dv] (any strides, the
// last dim contiguous); block_tables [seqs, max_blocks] and token_seq, token_pos [T] (int64);
// window 0: none, > 0: a sliding window, < 0: chunks of -window (a token sees its chunk's keys up
// to itself); sinks: fp32 [H], each query head's sink logit, or none. Returns [T, H, Dv] in
// q's dtype.
Tensor paged_attention(const Tensor& q_in, const Tensor& k_pages, const Tensor& v_pages, const Tensor& block_tables,
                       const Tensor& token_seq, const Tensor& token_pos, int64_t window, double scale,
                       const c10::optional<Tensor>& sinks_opt) {
  const Tensor q = q_in.dim() == 3 && q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  TORCH_CHECK(q.dim() == 3 && k_pages.dim() == 4 && v_pages.dim() == 4 && k_pages.stride(3) == 1 &&
                  v_pages.stride(3) == 1 && k_pages.size(3) == q.size(2) && q.size(1) % k_pages.size(2) == 0 &&
                  k_pages.scalar_type() == q.scalar_type() && v_pages.scalar_type() == q.scalar_type(),
              "tandem paged_attention: q [T, H, D], pages [blocks, block_size, kv_heads, D] in q's dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  token_seq.scalar_type() == at::kLong && token_pos.scalar_type() == at::kLong &&
                  token_seq.numel() == q.size(0) && token_pos.numel() == q.size(0),
              "tandem paged_attention: int64 block tables, token_seq and token_pos");
  const Tensor sinks = sinks_opt.has_value() ? sinks_opt->contiguous() : Tensor();
  TORCH_CHECK(!sinks.defined() || (sinks.scalar_type() == at::kFloat && sinks.dim() == 1 && sinks.size(0) == q.size(1)),
              "tandem paged_attention: sinks are fp32 [heads]");
  const float* sink = sinks.defined() ? sinks.data_ptr<float>() : nullptr;
  auto out = at::empty({q.size(0), q.size(1), v_pages.size(3)}, q.options());
  const Tensor seqs = token_seq.contiguous(), positions = token_pos.contiguous();
  if (q.scalar_type() == at::kFloat) {
    attend<float>(q, k_pages, v_pages, block_tables, seqs, positions, window, scale, sink, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "tandem paged_attention: fp32 or bf16 only");
    attend<c10::BFloat16>(q, k_pages, v_pages, block_tables, seqs, positions, window, scale, sink, out);
  }
  return out;
}

}  // namespace tandem_ops

TORCH_LIBRARY_FRAGMENT(TANDEM_OPS_NAMESPACE, m) {
  m.def("paged_attention(Tensor q, Tensor k_pages, Tensor v_pages, Tensor block_tables, Tensor token_seq, "
        "Tensor token_pos, int window, float scale, Tensor? sinks=None) -> Tensor", &tandem_ops::paged_attention);
}
