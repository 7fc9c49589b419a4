// A mixture of experts' routed part in one op on the batch-invariant matmul: engine/layers/moe.py's
// CPU dispatch op for op (the same bits), without the 20-odd eager ops and Python between them
// that cost a decode step at batch 1 more than an expert's matmuls on a small model. The
// (token, slot) pairs sorted by expert, stably; every chosen expert's gate/up over its rows in
// one grouped call with silu(gate) * up, the down projections in another; each token's experts'
// weighted outputs added into its row in expert order. gpt-oss's experts (engine/models/gpt_oss.py)
// add a bias after each projection and take gate and up interleaved into a clamped SwiGLU
// (fused_ops.cpp's clamped_swiglu), as transformers' GptOssExperts does.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "ops.h"

#ifndef TANDEM_OPS_NAMESPACE
#define TANDEM_OPS_NAMESPACE tandem
#endif

namespace {

using at::Tensor;
using tandem_ops::clamped_swiglu;
using tandem_ops::grouped_stacked;
using tandem_ops::grouped_stacked_silu;
using tandem_ops::silu_and_mul;

// x [T, hidden]; ids, weights [T, top_k] (int64, fp32): the router's choices. gate_up [E', ...],
// down [E', ...]: the held experts' packed weights stacked (with their scales where quantized);
// slots [E]: each expert's index in the stacks, or -1 where another rank holds it (expert
// parallelism: its pairs are skipped, a routing weight of zero here). gate_up_bias [E', gate_up_out]
// and down_bias [E', down_out]: the held experts' biases (or none); swiglu_limit > 0: gpt-oss's
// clamped SwiGLU (alpha, limit) on interleaved gate and up, else SiLU(gate) * up on its halves.
Tensor moe_experts(const Tensor& x, const Tensor& ids, const Tensor& weights, const Tensor& gate_up,
                   const c10::optional<Tensor>& gate_up_scales, const Tensor& down,
                   const c10::optional<Tensor>& down_scales, const Tensor& slots, int64_t gate_up_out,
                   int64_t down_out, const c10::optional<Tensor>& gate_up_bias,
                   const c10::optional<Tensor>& down_bias, double swiglu_alpha, double swiglu_limit) {
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong &&
                  weights.sizes() == ids.sizes() && slots.dim() == 1 && slots.scalar_type() == at::kLong &&
                  gate_up_out % 2 == 0,
              "tandem moe_experts: x [T, hidden], ids and weights [T, top_k], slots [experts] int64");
  const int64_t top_k = ids.size(1), pairs = ids.numel(), num_experts = slots.size(0);
  auto out = at::zeros_like(x);
  const Tensor id_c = ids.contiguous(), slot_c = slots.contiguous();
  const int64_t* id = id_c.data_ptr<int64_t>();
  const int64_t* slot = slot_c.data_ptr<int64_t>();
  std::vector<int64_t> counts(num_experts, 0);
  for (int64_t i = 0; i < pairs; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < num_experts, "tandem moe_experts: expert id ", id[i], " out of range");
    ++counts[id[i]];
  }
  // The chosen held experts in expert order, each over its run of the sorted pairs.
  std::vector<int64_t> experts, offsets{0}, next(num_experts, -1);
  for (int64_t e = 0; e < num_experts; ++e)
    if (counts[e] && slot[e] >= 0) {
      next[e] = offsets.back();
      experts.push_back(slot[e]);
      offsets.push_back(offsets.back() + counts[e]);
    }
  if (experts.empty()) return out;
  auto order = at::empty({offsets.back()}, ids.options());
  auto tokens = at::empty({offsets.back()}, ids.options());
  auto row_slots = at::empty({offsets.back()}, ids.options());  // each row's expert in the stacks
  int64_t* o = order.data_ptr<int64_t>();
  int64_t* t = tokens.data_ptr<int64_t>();
  int64_t* rs = row_slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < pairs; ++i)
    if (next[id[i]] >= 0) {
      const int64_t at = next[id[i]]++;
      o[at] = i;
      t[at] = i / top_k;
      rs[at] = slot[id[i]];
    }
  const Tensor undefined, gate_up_scale = gate_up_scales.has_value() ? *gate_up_scales : undefined;
  const Tensor chosen = x.index_select(0, tokens);
  // each row's expert's bias, added to the matmul's rounded output as eager torch adds it
  auto biased = [&](const Tensor& y, const c10::optional<Tensor>& bias) {
    return bias.has_value() ? y + bias->index_select(0, row_slots) : y;
  };
  Tensor act;
  if (swiglu_limit > 0) {
    act = clamped_swiglu(biased(grouped_stacked(chosen, gate_up, gate_up_scale, experts, offsets, gate_up_out), gate_up_bias),
                         swiglu_alpha, swiglu_limit);
  } else if ((gate_up_out / 2) % 128 == 0 && !gate_up_bias.has_value()) {
    // silu(gate) * up (gate, then up: as engine/layers/mlp.py's), in the matmul's pass (the same bits)
    act = grouped_stacked_silu(chosen, gate_up, gate_up_scale, experts, offsets, gate_up_out / 2);
  } else {
    act = silu_and_mul(biased(grouped_stacked(chosen, gate_up, gate_up_scale, experts, offsets, gate_up_out), gate_up_bias));
  }
  const Tensor routed = biased(
      grouped_stacked(act, down, down_scales.has_value() ? *down_scales : undefined, experts, offsets, down_out),
      down_bias);
  out.index_add_(0, tokens, routed * weights.flatten().index_select(0, order).to(x.scalar_type()).unsqueeze(1));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(TANDEM_OPS_NAMESPACE, m) {
  m.def(
      "moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor gate_up, Tensor? gate_up_scales, Tensor down, "
      "Tensor? down_scales, Tensor slots, int gate_up_out, int down_out, Tensor? gate_up_bias=None, "
      "Tensor? down_bias=None, float swiglu_alpha=0., float swiglu_limit=0.) -> Tensor",
      &moe_experts);
}
