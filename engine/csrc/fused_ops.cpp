// Fused CPU ops for the decoder layer: one pass over each row instead of 5-8 eager torch ops
// (each a dispatch, an allocation and a trip through memory). Registered as torch.ops.tandem.*;
// engine/layers/fused.py builds this file and falls back to eager torch without it.
//
// Numerics follow the eager code in engine/layers/ op for op: statistics in fp32, and for bf16
// every elementwise op rounds to bf16 where eager torch would (built with -ffp-contract=off, so
// no fused multiply-add changes a rounding). SiLU-and-mul, gpt-oss's clamped SwiGLU, sigmoid and
// log_softmax (the sampler's logprobs) are the exceptions:
// vec.h's exp (the same bits on every build), in fp32. Eager torch's differ in the
// last bits, and not only from these: it computes a tensor's last values, and those where a
// thread's share ends, with a scalar exp, so a value's bits depended on its batch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec.h"

#ifndef TANDEM_OPS_NAMESPACE
#define TANDEM_OPS_NAMESPACE tandem
#endif

namespace {

using at::Tensor;

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }

// One row: out = w * (x * rsqrt(mean(x^2) + eps)), as engine/layers/norm.py computes it.
template <typename T>
inline void rms_norm_row(const T* x, const T* w, T* out, int64_t d, float eps) {
  // 16 running sums (one vector register), so the loop vectorises without reassociation flags.
  constexpr int kLanes = 16;
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= d; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float v = static_cast<float>(x[j + l]);
      lanes[l] += v * v;
    }
  }
  float ss = 0.f;
  for (int l = 0; l < kLanes; ++l) ss += lanes[l];
  for (; j < d; ++j) {
    const float v = static_cast<float>(x[j]);
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (int64_t j = 0; j < d; ++j) {
    // fp32: (x * inv) * w; bf16: w * bf16(x * inv), each product rounded as eager rounds it.
    const T normed = round_to<T>(static_cast<float>(x[j]) * inv);
    out[j] = round_to<T>(static_cast<float>(normed) * static_cast<float>(w[j]));
  }
}

void check_rows(const Tensor& x, const Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "tandem fused ops: x must be [rows, hidden], rows contiguous");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1) && w.scalar_type() == x.scalar_type(),
              "tandem fused ops: weight must match x's hidden size and dtype");
}

}  // namespace

namespace tandem_ops {

Tensor rms_norm(const Tensor& x, const Tensor& w, double eps) {
  check_rows(x, w);
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "tandem_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t d = x.size(1), stride = x.stride(0);
    at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) rms_norm_row(xp + i * stride, wp, op + i * d, d, static_cast<float>(eps));
    });
  });
  return out;
}

// (x + r, rms_norm(x + r)): the residual add and the next norm in one pass; x is not changed.
std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& r, const Tensor& w, double eps) {
  check_rows(x, w);
  TORCH_CHECK(r.sizes() == x.sizes() && r.stride(1) == 1 && r.scalar_type() == x.scalar_type(),
              "tandem fused ops: the residual must match x");
  auto sum = at::empty({x.size(0), x.size(1)}, x.options());
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "tandem_add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = r.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t d = x.size(1);
    at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* xi = xp + i * x.stride(0);
        const scalar_t* ri = rp + i * r.stride(0);
        scalar_t* si = sp + i * d;
        for (int64_t j = 0; j < d; ++j) si[j] = round_to<scalar_t>(static_cast<float>(xi[j]) + static_cast<float>(ri[j]));
        rms_norm_row(si, wp, op + i * d, d, static_cast<float>(eps));
      }
    });
  });
  return {sum, out};
}

// Rotary embedding, NeoX layout, as engine/layers/rotary.py: x [T, heads, head_dim] (rows and heads
// may be strided, each head contiguous), cos and sin [T, 1, head_dim / 2]; returns a new contiguous
// tensor. `interleaved`: x's pairs are (x0, x1), (x2, x3), ... (DeepSeek's rope), read as the halves
// [x0, x2, ...] and [x1, x3, ...] and returned in that order (as gathering them first would).
Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "tandem fused ops: rotary wants [tokens, heads, head_dim]");
  const int64_t T = x.size(0), H = x.size(1), half = x.size(2) / 2;
  TORCH_CHECK(cos.numel() == T * half && sin.numel() == T * half && cos.is_contiguous() && sin.is_contiguous() &&
              cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "tandem fused ops: cos and sin must be [tokens, 1, head_dim / 2] in x's dtype");
  auto out = at::empty({T, H, 2 * half}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "tandem_rotary", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < H; ++h) {
          const scalar_t* x1 = xp + t * x.stride(0) + h * x.stride(1);
          const scalar_t* x2 = interleaved ? x1 + 1 : x1 + half;
          const int64_t step = interleaved ? 2 : 1;
          scalar_t* o = op + (t * H + h) * 2 * half;
          for (int64_t j = 0; j < half; ++j) {
            const float c = cp[t * half + j], s = sp[t * half + j];
            const float a = x1[j * step], b = x2[j * step];
            // Each product and sum rounds as eager's separate ops do.
            o[j] = round_to<scalar_t>(static_cast<float>(round_to<scalar_t>(a * c)) -
                                      static_cast<float>(round_to<scalar_t>(b * s)));
            o[j + half] = round_to<scalar_t>(static_cast<float>(round_to<scalar_t>(b * c)) +
                                             static_cast<float>(round_to<scalar_t>(a * s)));
          }
        }
      }
    });
  });
  return out;
}

// gate_up [rows, 2 * width] (gate, then up; rows contiguous) -> act(T{}, g, u) [rows, width] over
// fp32 vectors of gate and up, T the dtype; a row's whole vectors, then its zero-padded tail.
template <typename Act>
Tensor gated(const Tensor& gate_up, const char* op, Act act) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0, "tandem ", op,
              ": gate_up must be [rows, 2 * width], rows contiguous");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2, ld = gate_up.stride(0);
  auto out = at::empty({rows, width}, gate_up.options());
  auto run = [&](auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    const T* in = gate_up.data_ptr<T>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        tandem_vec::each_vector(in + r * ld, in + r * ld + width, o + r * width, width,
                                [&](tandem_vec::vec g, tandem_vec::vec u) { return act(T{}, g, u); });
    });
  };
  if (gate_up.scalar_type() == at::kFloat) {
    run(out.data_ptr<float>());
  } else {
    TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "tandem ", op, ": fp32 or bf16 only");
    run(out.data_ptr<c10::BFloat16>());
  }
  return out;
}

// silu(gate) * up, in fp32: silu(g) = g * sigmoid(g).
Tensor silu_and_mul(const Tensor& gate_up) {
  return gated(gate_up, "silu_and_mul", [](auto t, tandem_vec::vec g, tandem_vec::vec u) {
    return tandem_vec::vsilu_times<decltype(t)>(g, u);
  });
}

// Gemma's activation, gelu_tanh(gate) * up, each op as the eager path (engine/layers/mlp.py's
// gelu_tanh_and_mul) computes it: in fp32, z = (g + 0.044715 * (g * g * g)) * 2 * sqrt(2 / pi),
// gelu = g * sigmoid(z) (0.5 * (1 + tanh(z / 2)) is sigmoid(z)), rounded to bf16 in a bf16 model
// before it meets up. One pass, not eight over [rows, width].
Tensor gelu_tanh_and_mul(const Tensor& gate_up) {
  return gated(gate_up, "gelu_tanh_and_mul", [](auto t, tandem_vec::vec g, tandem_vec::vec u) {
    using namespace tandem_vec;
    const vec cube = vmul(vmul(g, g), g);
    const vec z = vmul(vadd(g, vmul(cube, vbroadcast(0.044715f))), vbroadcast(static_cast<float>(2 * std::sqrt(2 / M_PI))));
    const vec gelu = vmul(g, vsigmoid(z));
    return vmul(std::is_same_v<decltype(t), float> ? gelu : vround_bf16(gelu), u);
  });
}

// gpt-oss's experts' activation, as transformers' GptOssExperts._apply_gate computes it:
// gate_up [T, 2 * width] interleaved (gate j in column 2j, up j in 2j + 1; rows contiguous) ->
// (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit): [T, width]. In
// fp32, each op's result rounded to bf16 where eager torch's is (a bf16 model), with vec.h's
// sigmoid: a value's bits are its own, wherever it falls.
Tensor clamped_swiglu(const Tensor& gate_up, double alpha, double limit) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "tandem clamped_swiglu: gate_up must be [rows, 2 * width], rows contiguous");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2, ld = gate_up.stride(0);
  auto out = at::empty({rows, width}, gate_up.options());
  auto run = [&](auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    const T* in = gate_up.data_ptr<T>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)), [&](int64_t begin, int64_t end) {
      std::vector<T> gate(width), up(width);
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t j = 0; j < width; ++j) {
          gate[j] = in[r * ld + 2 * j];
          up[j] = in[r * ld + 2 * j + 1];
        }
        tandem_vec::each_vector(gate.data(), up.data(), o + r * width, width, [&](tandem_vec::vec g, tandem_vec::vec u) {
          using namespace tandem_vec;
          auto rounded = [](vec v) { return std::is_same_v<T, float> ? v : vround_bf16(v); };
          const vec top = vbroadcast(static_cast<float>(limit));
          g = vmin(g, top);
          u = vmax(vmin(u, top), vbroadcast(-static_cast<float>(limit)));
          const vec sig = rounded(vsigmoid(rounded(vmul(g, vbroadcast(static_cast<float>(alpha))))));
          return vmul(rounded(vadd(u, vbroadcast(1.f))), rounded(vmul(g, sig)));
        });
      }
    });
  };
  if (gate_up.scalar_type() == at::kFloat) {
    run(out.data_ptr<float>());
  } else {
    TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "tandem clamped_swiglu: fp32 or bf16 only");
    run(out.data_ptr<c10::BFloat16>());
  }
  return out;
}

// x (fp32, contiguous) -> sigmoid(x): a value's bits are its own, wherever it falls in x.
Tensor sigmoid(const Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat, "tandem sigmoid: contiguous fp32 only");
  auto out = at::empty_like(x);
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  constexpr int64_t kChunk = 4096;  // whole vectors on every build
  at::parallel_for(0, (x.numel() + kChunk - 1) / kChunk, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t from = c * kChunk, n = std::min(kChunk, x.numel() - from);
      tandem_vec::each_vector(in + from, in + from, o + from, n, [](tandem_vec::vec v, tandem_vec::vec) { return tandem_vec::vsigmoid(v); });
    }
  });
  return out;
}

// Each row of fp32 x [B, V]: x - m - log(s), m the row's largest value (exact) and s the sum of
// exp(x - m) (vec.h's exp) in 16 lanes by index mod 16, then vtree_sum: the same bits on every
// build and CPU (torch's log_softmax sums in the order of the vector width ATen picks, so a
// reported logprob differed between an AVX-512 and an AVX2 machine).
Tensor log_softmax(const Tensor& x) {
  using namespace tandem_vec;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "tandem log_softmax: contiguous fp32 [rows, values] only");
  auto out = at::empty_like(x);
  const int64_t V = x.size(1);
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* row = in + b * V;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t v = 0; v < V; ++v) m = std::max(m, row[v]);
      vec lane_sum[kVecs];
      for (auto& s : lane_sum) s = vzero();
      for (int64_t v = 0; v < V; v += kBlock) {
        float chunk[kBlock];  // the last one padded with -inf: exp gives 0
        for (int i = 0; i < kBlock; ++i) chunk[i] = v + i < V ? row[v + i] : -std::numeric_limits<float>::infinity();
        for (int i = 0; i < kVecs; ++i)
          lane_sum[i] = vadd(lane_sum[i], vexp_nonpositive(vsub(vload(chunk + i * kLanes), vbroadcast(m))));
      }
      const float log_sum = std::log(vtree_sum(lane_sum));
      for (int64_t v = 0; v < V; ++v) o[b * V + v] = (row[v] - m) - log_sum;
    }
  });
  return out;
}

}  // namespace tandem_ops

TORCH_LIBRARY_FRAGMENT(TANDEM_OPS_NAMESPACE, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &tandem_ops::rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)", &tandem_ops::add_rms_norm);
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved=False) -> Tensor", &tandem_ops::rotary);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor", &tandem_ops::silu_and_mul);
  m.def("sigmoid(Tensor x) -> Tensor", &tandem_ops::sigmoid);
  m.def("gelu_tanh_and_mul(Tensor gate_up) -> Tensor", &tandem_ops::gelu_tanh_and_mul);
  m.def("clamped_swiglu(Tensor gate_up, float alpha, float limit) -> Tensor", &tandem_ops::clamped_swiglu);
  m.def("log_softmax(Tensor x) -> Tensor", &tandem_ops::log_softmax);
}
