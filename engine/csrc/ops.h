// The ops one source calls of another's (engine/csrc/*.cpp), in namespace tandem_ops, hidden: each
// build loaded into one process (the tests load several) calls its own.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace tandem_ops __attribute__((visibility("hidden"))) {

using at::Tensor;

// work(state, i) for every item i in [0, n), each thread taking the next item as it frees up
// (an atomic counter), with a state of its own (make_state()): where the OS deschedules a thread
// (a served worker borrows its front end's CPU for a wave), the others take its share instead of
// waiting for it at the end. Which thread computes an item never changes its bits.
// Runs of consecutive items, about 16 a thread and at most `max_run`, keep a thread's items
// neighbours in memory; never more, or one thread would take all of a small call (a decode's
// one row chunk) and the others none.
template <typename MakeState, typename Work>
void parallel_items(int64_t n, MakeState&& make_state, Work&& work, int64_t max_run = INT64_MAX) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(n, at::get_num_threads()));
  const int64_t run = std::clamp<int64_t>(n / (16 * threads), 1, std::max<int64_t>(1, max_run));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    auto state = make_state();
    for (int64_t i; (i = next.fetch_add(run, std::memory_order_relaxed)) < n;)
      for (const int64_t end = std::min(n, i + run); i < end; ++i) work(state, i);
  });
}
template <typename Work>
void parallel_items(int64_t n, Work&& work, int64_t max_run = INT64_MAX) {
  parallel_items(n, [] { return 0; }, [&](int, int64_t i) { work(i); }, max_run);
}

// fused_ops.cpp
Tensor rms_norm(const Tensor& x, const Tensor& w, double eps);
std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& r, const Tensor& w, double eps);
Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved);
Tensor silu_and_mul(const Tensor& gate_up);
Tensor sigmoid(const Tensor& x);
Tensor clamped_swiglu(const Tensor& gate_up, double alpha, double limit);
Tensor gelu_tanh_and_mul(const Tensor& gate_up);

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
// silu_and_mul of grouped_stacked's gate_up product (N = 2 * width), in one pass: the same bits.
Tensor grouped_stacked_silu(const Tensor& x, const Tensor& packed, const Tensor& scales,
                            const std::vector<int64_t>& experts, const std::vector<int64_t>& offsets, int64_t width);

// gguf_linear.cpp: y = x @ [W_0; W_1; ...].T of GGUF rows, each part of its own ggml type.
Tensor gguf_linear(const Tensor& x_in, at::TensorList raws, at::IntArrayRef kinds, int64_t K);

// invariant_attention.cpp
Tensor paged_attention(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages, const Tensor& block_tables,
                       const Tensor& token_seq, const Tensor& token_pos, int64_t window, double scale,
                       const c10::optional<Tensor>& sinks = c10::nullopt);

}  // namespace tandem_ops
