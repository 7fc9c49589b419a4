// Batch-invariant paged attention: each query token attends over the keys its position sees,
// read from the paged pool, in an order fixed by that token alone. For a token at position pos
// (keys lo..pos; lo > 0 only under a sliding window) and each query head:
//   score_j = scale * dot(q, k_j): 16 lanes, lane l summing d = l, l+16, ... by FMA, the lanes
//             then added as a fixed tree (l + l+8, then + l+4, + l+2, + l+1);
//   p_j     = exp(score_j - max) (vec.h's exp), sum = the p_j in 16 lanes by (j - lo) mod 16, the
//             same tree;
//   out     = (sum_j p_j v_j, FMA in j order, lanes along the value dims) / sum.
// So a token's output does not depend on how many tokens share its step (a prompt, a cached
// tail, draft verification, a decode batch), on the threads (one token and kv head per work
// item), or on the vector width. bf16 inputs are widened to fp32 and the output rounded once.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>
#include <vector>

#include "vec.h"

namespace {

using at::Tensor;
using namespace tandem_vec;

inline float tree_sum(const float* lanes) {  // 16 lanes, always in this order
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = lanes[i] + lanes[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
  vec acc[kVecs];
  for (int v = 0; v < kVecs; ++v) acc[v] = vzero();
  const int64_t whole = D / kBlock * kBlock;
  for (int64_t d = 0; d < whole; d += kBlock)
    for (int v = 0; v < kVecs; ++v) acc[v] = vfma(vload(q + d + v * kLanes), vload(k + d + v * kLanes), acc[v]);
  float lanes[kBlock];
  for (int v = 0; v < kVecs; ++v) vstore(lanes + v * kLanes, acc[v]);
  for (int64_t d = whole; d < D; ++d) lanes[d - whole] = std::fma(q[d], static_cast<float>(k[d]), lanes[d - whole]);
  return tree_sum(lanes);
}

template <typename T>
void attend(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages, const Tensor& block_tables,
            const Tensor& token_seq, const Tensor& token_pos, int64_t window, double scale, Tensor& out) {
  const int64_t T_ = q.size(0), H = q.size(1), D = q.size(2), KVH = k_pages.size(2), Dv = v_pages.size(3);
  const int64_t R = H / KVH, BS = k_pages.size(1);
  const T* qp = q.data_ptr<T>();
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
  const int64_t whole_v = Dv / kBlock * kBlock;
  at::parallel_for(0, T_ * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(R * D), scores, acc(R * Dv);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / KVH, g = item % KVH, pos = positions[t];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const int64_t L = pos - lo + 1, padded = (L + kBlock - 1) / kBlock * kBlock;
      const int64_t* table = tables + seqs[t] * table_stride;
      for (int64_t r = 0; r < R; ++r)
        for (int64_t d = 0; d < D; ++d) qf[r * D + d] = static_cast<float>(qp[(t * H + g * R + r) * D + d]);
      scores.assign(R * padded, -std::numeric_limits<float>::infinity());  // padding: exp gives 0
      for (int64_t i = 0; i < L; ++i) {
        const int64_t j = lo + i;
        const T* key = kp + table[j / BS] * ks0 + (j % BS) * ks1 + g * ks2;
        for (int64_t r = 0; r < R; ++r) scores[r * padded + i] = dot(qf.data() + r * D, key, D) * fscale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> sums(R);
      for (int64_t r = 0; r < R; ++r) {
        float* s = scores.data() + r * padded;
        float m = s[0];
        for (int64_t i = 1; i < L; ++i) m = std::max(m, s[i]);
        vec lane_sum[kVecs];
        for (int v = 0; v < kVecs; ++v) lane_sum[v] = vzero();
        for (int64_t i = 0; i < padded; i += kBlock)
          for (int v = 0; v < kVecs; ++v) {
            const vec p = vexp_nonpositive(vsub(vload(s + i + v * kLanes), vbroadcast(m)));
            vstore(s + i + v * kLanes, p);
            lane_sum[v] = vadd(lane_sum[v], p);
          }
        float lanes[kBlock];
        for (int v = 0; v < kVecs; ++v) vstore(lanes + v * kLanes, lane_sum[v]);
        sums[r] = tree_sum(lanes);
      }
      for (int64_t i = 0; i < L; ++i) {
        const int64_t j = lo + i;
        const T* value = vp + table[j / BS] * vs0 + (j % BS) * vs1 + g * vs2;
        for (int64_t r = 0; r < R; ++r) {
          const float p = scores[r * padded + i];
          float* a = acc.data() + r * Dv;
          const vec pv = vbroadcast(p);
          for (int64_t d = 0; d < whole_v; d += kLanes) vstore(a + d, vfma(pv, vload(value + d), vload(a + d)));
          for (int64_t d = whole_v; d < Dv; ++d) a[d] = std::fma(p, static_cast<float>(value[d]), a[d]);
        }
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t d = 0; d < Dv; ++d) op[(t * H + g * R + r) * Dv + d] = static_cast<T>(acc[r * Dv + d] / sums[r]);
    }
  });
}

// q [T, H, D]; k_pages [blocks, block_size, kv_heads, D] and v_pages [..., Dv] (any strides, the
// last dim contiguous); block_tables [seqs, max_blocks] and token_seq, token_pos [T] (int64);
// window 0: none. Returns [T, H, Dv] in q's dtype.
Tensor paged_attention(const Tensor& q_in, const Tensor& k_pages, const Tensor& v_pages, const Tensor& block_tables,
                       const Tensor& token_seq, const Tensor& token_pos, int64_t window, double scale) {
  const Tensor q = q_in.contiguous();
  TORCH_CHECK(q.dim() == 3 && k_pages.dim() == 4 && v_pages.dim() == 4 && k_pages.stride(3) == 1 &&
                  v_pages.stride(3) == 1 && k_pages.size(3) == q.size(2) && q.size(1) % k_pages.size(2) == 0 &&
                  k_pages.scalar_type() == q.scalar_type() && v_pages.scalar_type() == q.scalar_type(),
              "tandem paged_attention: q [T, H, D], pages [blocks, block_size, kv_heads, D] in q's dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  token_seq.scalar_type() == at::kLong && token_pos.scalar_type() == at::kLong &&
                  token_seq.numel() == q.size(0) && token_pos.numel() == q.size(0),
              "tandem paged_attention: int64 block tables, token_seq and token_pos");
  auto out = at::empty({q.size(0), q.size(1), v_pages.size(3)}, q.options());
  const Tensor seqs = token_seq.contiguous(), positions = token_pos.contiguous();
  if (q.scalar_type() == at::kFloat) {
    attend<float>(q, k_pages, v_pages, block_tables, seqs, positions, window, scale, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "tandem paged_attention: fp32 or bf16 only");
    attend<c10::BFloat16>(q, k_pages, v_pages, block_tables, seqs, positions, window, scale, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(TANDEM_OPS_NAMESPACE, m) {
  m.def("paged_attention(Tensor q, Tensor k_pages, Tensor v_pages, Tensor block_tables, Tensor token_seq, "
        "Tensor token_pos, int window, float scale) -> Tensor", &paged_attention);
}
