// Multi-head latent attention (engine/models/deepseek_v3.py's LatentAttention, absorbed) in one
// op on the batch-invariant kernels: the same ops in the same order as the Python layer, so the
// same bits, without the Python and the dozen small ATen calls between them that cost a decode
// step at batch 1 about as much as the layer's matmuls.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

#ifndef TANDEM_OPS_NAMESPACE
#define TANDEM_OPS_NAMESPACE tandem
#endif

namespace {

using at::Tensor;
using namespace tandem_ops;

// x [T, in] (the layer's normed input). qkv_a: both latents' projection [q_lora_rank + kv_lora_rank
// + rope]; q_b [heads x (nope + rope)]; w_uk, w_uv: the per-head absorbed maps; o_proj [out]: packed
// weights, with their scales where quantized. cos, sin [T, 1, rope / 2]. The layer's KV pool and the
// invariant backend's plan (engine/attention/invariant_backend.py): each token's latent and rotated
// k_pe are written to row k_rows of the pool, then every head attends over the latent.
// dims: heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, out.
Tensor latent_attention(const Tensor& x, const Tensor& qkv_a, const c10::optional<Tensor>& qkv_a_scales,
                        const Tensor& q_a_norm, const Tensor& q_b, const c10::optional<Tensor>& q_b_scales,
                        const Tensor& kv_a_norm, const Tensor& w_uk, const Tensor& w_uv, const Tensor& o_proj,
                        const c10::optional<Tensor>& o_proj_scales, const Tensor& cos, const Tensor& sin,
                        bool interleaved, double eps, const Tensor& kv_layer, const Tensor& k_rows,
                        const Tensor& block_tables, const Tensor& token_seq, const Tensor& token_pos, int64_t window,
                        double scale, at::IntArrayRef dims) {
  TORCH_CHECK(dims.size() == 7 && x.dim() == 2, "tandem latent_attention: x [T, in] and 7 dims");
  const int64_t T = x.size(0), heads = dims[0], q_rank = dims[1], kv_rank = dims[2], nope = dims[3], rope = dims[4],
                v = dims[5], out = dims[6];
  const c10::optional<Tensor> none;
  const Tensor q_kv = invariant_linear(x, qkv_a, none, q_rank + kv_rank + rope, qkv_a_scales);
  const Tensor q_in = rms_norm(q_kv.narrow(1, 0, q_rank), q_a_norm, eps);
  const Tensor q = invariant_linear(q_in, q_b, none, heads * (nope + rope), q_b_scales).view({T, heads, nope + rope});
  const Tensor latent = rms_norm(q_kv.narrow(1, q_rank, kv_rank), kv_a_norm, eps);
  const Tensor q_pe = rotary(q.narrow(2, nope, rope), cos, sin, interleaved);
  const Tensor k_pe = rotary(q_kv.narrow(1, q_rank + kv_rank, rope).unsqueeze(1), cos, sin, interleaved);
  const Tensor query = at::cat({invariant_linear_heads(q.narrow(2, 0, nope), w_uk, kv_rank), q_pe}, -1);
  const Tensor key = at::cat({latent.unsqueeze(1), k_pe}, -1);  // [T, 1, latent + rope]: what the cache keeps
  kv_layer.view({-1, kv_rank + rope}).index_copy_(0, k_rows, key.view({T, -1}));
  const Tensor k_pages = kv_layer.select(1, 0);  // the latent is both K and V (V its first columns)
  const Tensor attended = paged_attention(query, k_pages, k_pages.narrow(-1, 0, kv_rank), block_tables, token_seq,
                                          token_pos, window, scale);
  return invariant_linear(invariant_linear_heads(attended, w_uv, v).view({T, heads * v}), o_proj, none, out,
                          o_proj_scales);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(TANDEM_OPS_NAMESPACE, m) {
  m.def(
      "latent_attention(Tensor x, Tensor qkv_a, Tensor? qkv_a_scales, Tensor q_a_norm, Tensor q_b, Tensor? q_b_scales, "
      "Tensor kv_a_norm, Tensor w_uk, Tensor w_uv, Tensor o_proj, Tensor? o_proj_scales, Tensor cos, Tensor sin, "
      "bool interleaved, float eps, Tensor kv_layer, Tensor k_rows, Tensor block_tables, Tensor token_seq, "
      "Tensor token_pos, int window, float scale, int[] dims) -> Tensor",
      &latent_attention);
}
