// A Llama-family decoder layer of GGUF weights as one op (engine/models/one_op_layer.py): the
// kernels engine/models/llama.py's DecoderLayer calls, in its order, on the same tensors, so
// the same bits, without the ~20 Python calls a layer that were 40% of a 135M model's decode
// step (bench/README.md).

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

namespace tandem_ops {

// x [T, hidden] -> the layer's output [T, hidden]; K and V of the new tokens written into
// kv_layer [blocks, 2, block_size, kv_heads, head_dim] at rows k_rows and v_rows of its row view.
Tensor gguf_decoder_layer(const Tensor& x, const Tensor& input_norm, const Tensor& post_norm, double eps,
                          at::TensorList qkv, at::IntArrayRef qkv_kinds, at::TensorList o, at::IntArrayRef o_kinds,
                          at::TensorList gate_up, at::IntArrayRef gate_up_kinds, at::TensorList down,
                          at::IntArrayRef down_kinds, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          const Tensor& cos, const Tensor& sin, const Tensor& kv_layer, const Tensor& k_rows,
                          const Tensor& v_rows, const Tensor& block_tables, const Tensor& token_seq,
                          const Tensor& token_pos, int64_t window, double scale) {
  const int64_t T = x.size(0), hidden = x.size(1), num_qk = num_heads + num_kv_heads;
  // attention
  const Tensor h = rms_norm(x, input_norm, eps);
  const Tensor heads = gguf_linear(h, qkv, qkv_kinds, hidden).view({T, -1, head_dim});
  const Tensor qk = rotary(heads.slice(1, 0, num_qk), cos, sin, false);
  const Tensor v = heads.slice(1, num_qk);
  const Tensor rows = kv_layer.view({-1, num_kv_heads * head_dim});
  rows.index_copy_(0, k_rows, qk.slice(1, num_heads).reshape({T, -1}));
  rows.index_copy_(0, v_rows, v.reshape({T, -1}));
  const Tensor attended = paged_attention(qk.slice(1, 0, num_heads), kv_layer.select(1, 0), kv_layer.select(1, 1),
                                          block_tables, token_seq, token_pos, window, scale);
  const Tensor out = gguf_linear(attended.reshape({T, -1}), o, o_kinds, num_heads * head_dim);
  // MLP
  auto [residual, normed] = add_rms_norm(x, out, post_norm, eps);
  const Tensor act = silu_and_mul(gguf_linear(normed, gate_up, gate_up_kinds, hidden));
  return residual + gguf_linear(act, down, down_kinds, act.size(1));
}

}  // namespace tandem_ops

TORCH_LIBRARY_FRAGMENT(TANDEM_OPS_NAMESPACE, m) {
  m.def(
      "gguf_decoder_layer(Tensor x, Tensor input_norm, Tensor post_norm, float eps, Tensor[] qkv, int[] qkv_kinds, "
      "Tensor[] o, int[] o_kinds, Tensor[] gate_up, int[] gate_up_kinds, Tensor[] down, int[] down_kinds, "
      "int num_heads, int num_kv_heads, int head_dim, Tensor cos, Tensor sin, Tensor kv_layer, Tensor k_rows, "
      "Tensor v_rows, Tensor block_tables, Tensor token_seq, Tensor token_pos, int window, float scale) -> Tensor",
      &tandem_ops::gguf_decoder_layer);
}
