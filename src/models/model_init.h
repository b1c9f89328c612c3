#pragma once

// What the families share (transformers' _init_weights: weights normal(0,
// std), biases zero; the SwiGLU MLP), in one place so that the families'
// sources also compile together in one unity translation unit.

#include <colossalai/kernels/gelu_linear.h>
#include <colossalai/kernels/silu_mul.h>
#include <colossalai/kernels/silu_mul_linear.h>
#include <colossalai/shardformer/layer/linear.h>

#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>

#include <cstdint>

namespace colossalai {
namespace models {
namespace detail {

inline void init_normal(at::Tensor& w, double std) {
  at::NoGradGuard no_grad;
  w.normal_(0.0, std);
}

/// Zeroes `b` when it exists (a layer built without bias has none).
inline void init_zero(at::Tensor& b) {
  if (b.defined()) {
    at::NoGradGuard no_grad;
    b.zero_();
  }
}

/// A linear layer of `Layer` (Linear1D_Col or Linear1D_Row), weight
/// normal(0, std), bias zero.
template <class Layer>
Layer normal_linear(int64_t in, int64_t out, double std, bool bias) {
  Layer m(shardformer::layer::Linear1DOptions(in, out).bias(bias));
  init_normal(m->weight, std);
  init_zero(m->bias);
  return m;
}

inline shardformer::layer::Linear1D_Col col(
    int64_t in,
    int64_t out,
    double std,
    bool bias = true) {
  return normal_linear<shardformer::layer::Linear1D_Col>(in, out, std, bias);
}

inline shardformer::layer::Linear1D_Row row(
    int64_t in,
    int64_t out,
    double std,
    bool bias = true) {
  return normal_linear<shardformer::layer::Linear1D_Row>(in, out, std, bias);
}

/// out(gelu(h, approximate)), GPT-2's and BLOOM's MLP after its first
/// projection. With `recompute` and a plain `out`, gelu(h) is formed again
/// in backward instead of kept (kernels::gelu_linear).
inline at::Tensor gelu_projected(
    shardformer::layer::Linear1D_RowImpl& out,
    const at::Tensor& h,
    c10::string_view approximate,
    bool recompute) {
  if (recompute && out.plain()) {
    return kernels::gelu_linear(h, out.weight_out_in(), out.bias, approximate);
  }
  return out.forward(at::gelu(h, approximate));
}

/// down(silu(gate(x)) * up(x)), LLaMA's MLP and the experts': gate and up
/// share one prepared input (one gradient sum over tp, and under autocast
/// one cast kept, as q, k and v).
/// With `recompute` and a plain down projection the product is formed
/// again in backward instead of kept (kernels::silu_mul_linear).
inline at::Tensor swiglu(
    shardformer::layer::Linear1D_ColImpl& gate,
    shardformer::layer::Linear1D_ColImpl& up,
    shardformer::layer::Linear1D_RowImpl& down,
    const at::Tensor& x,
    bool recompute = false) {
  const auto gu = shardformer::layer::forward_shared_input({&gate, &up}, x);
  const auto& g = gu[0];
  const auto& u = gu[1];
  if (recompute && down.plain()) {
    return kernels::silu_mul_linear(g, u, down.weight_out_in(), down.bias);
  }
  // The fused kernels on a GPU, at::silu(g) * u elsewhere (bit for bit).
  return down.forward(kernels::silu_mul(g, u));
}

} // namespace detail
} // namespace models
} // namespace colossalai
