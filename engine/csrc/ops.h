// The ops one source calls of another's (engine/csrc/*.cpp), in namespace tandem_ops, hidden: each
// build loaded into one process (the tests load several) calls its own.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace tandem_ops __attribute__((visibility("hidden"))) {

using at::Tensor;

// fused_ops.cpp
Tensor rms_norm(const Tensor& x, const Tensor& w, double eps);
Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved);
Tensor silu_and_mul(const Tensor& gate_up);
Tensor sigmoid(const Tensor& x);

// invariant_linear.cpp: y = x @ W.T (+ bias) on the packed weight (with scales where quantized).
Tensor invariant_linear(const Tensor& x, const Tensor& packed, const c10::optional<Tensor>& bias, int64_t N,
                        const c10::optional<Tensor>& scales);
// One matmul a head: x [M, H, K], packed [H, NB, K, 16].
Tensor invariant_linear_heads(const Tensor& x, const Tensor& packed, int64_t N);
// Rows [offsets[g], offsets[g + 1]) of x times the packed weight packed[experts[g]] (with
// scales[experts[g]] where scales is defined), every group the same out_features N: the same
// bits as invariant_linear_grouped.
Tensor grouped_stacked(const Tensor& x, const Tensor& packed, const Tensor& scales, const std::vector<int64_t>& experts,
                       const std::vector<int64_t>& offsets, int64_t N);

// invariant_attention.cpp
Tensor paged_attention(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages, const Tensor& block_tables,
                       const Tensor& token_seq, const Tensor& token_pos, int64_t window, double scale);

}  // namespace tandem_ops
