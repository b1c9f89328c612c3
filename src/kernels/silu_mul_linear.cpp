// silu_mul_linear (NOTE [Kernels]): linear(silu(gate) * up) as an autograd
// Function that keeps gate, up and the weight, and forms the product again
// in backward (kernels::silu_mul: the fused kernels on a GPU).

#include <colossalai/kernels/silu_mul.h>
#include <colossalai/kernels/silu_mul_linear.h>

#include "linear_dtype.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

namespace colossalai {
namespace kernels {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct SiluMulLinear : public torch::autograd::Function<SiluMulLinear> {
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& gate,
      const at::Tensor& up,
      const at::Tensor& weight,
      const at::Tensor& bias_or_empty) {
    const at::Tensor bias = detail::bias_of(bias_or_empty);
    const auto compute =
        detail::linear_compute_dtype("silu_mul_linear", gate, weight, bias);
    const auto g = gate.to(compute).contiguous();
    const auto u = up.to(compute).contiguous();
    const auto w = weight.to(compute);
    const auto b = bias.defined() ? bias.to(compute) : at::Tensor();
    const int64_t inter = g.size(-1);
    const auto h = silu_mul(g, u).view({-1, inter});
    auto y = b.defined() ? at::addmm(b, h, w.t()) : at::mm(h, w.t());
    // gate, up and the (cast) weight are kept; the product is not.
    ctx->save_for_backward({g, u, w});
    ctx->saved_data["gate_type"] = static_cast<int64_t>(gate.scalar_type());
    ctx->saved_data["up_type"] = static_cast<int64_t>(up.scalar_type());
    ctx->saved_data["w_type"] = static_cast<int64_t>(weight.scalar_type());
    ctx->saved_data["b_type"] =
        bias.defined() ? static_cast<int64_t>(bias.scalar_type()) : int64_t{-1};
    ctx->saved_data["need_w"] = weight.requires_grad();
    ctx->saved_data["need_b"] = bias.defined() && bias.requires_grad();
    ctx->saved_data["need_in"] = gate.requires_grad() || up.requires_grad();
    auto shape = gate.sizes().vec();
    shape.back() = w.size(0);
    return y.view(shape);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& w = saved[2];
    auto type = [&](const char* k) {
      return static_cast<at::ScalarType>(ctx->saved_data[k].toInt());
    };
    const bool need_w = ctx->saved_data["need_w"].toBool();
    const bool need_b = ctx->saved_data["need_b"].toBool();
    const bool need_in = ctx->saved_data["need_in"].toBool();
    const auto dy = grads[0].to(w.scalar_type()).reshape({-1, w.size(0)});
    // The product again, differentiable in gate and up: the one pass this
    // op adds, and its own backward (the fused one on a GPU) below.
    at::AutoGradMode enable(true);
    auto g = saved[0].detach().requires_grad_(need_in);
    auto u = saved[1].detach().requires_grad_(need_in);
    auto h = silu_mul(g, u);
    const int64_t inter = h.size(-1);
    at::Tensor dg, du, dw, db;
    if (need_w) {
      dw = at::mm(dy.t(), h.detach().view({-1, inter})).to(type("w_type"));
    }
    if (need_b) {
      db = dy.sum(0).to(type("b_type"));
    }
    if (need_in) {
      const auto dh = at::mm(dy, w).view(h.sizes());
      auto d = torch::autograd::grad({h}, {g, u}, {dh});
      dg = d[0].to(type("gate_type"));
      du = d[1].to(type("up_type"));
    }
    return {dg, du, dw, db};
  }
};

} // namespace

at::Tensor silu_mul_linear_reference(
    const at::Tensor& gate,
    const at::Tensor& up,
    const at::Tensor& weight,
    const at::Tensor& bias) {
  return at::linear(silu_mul(gate, up), weight, bias);
}

at::Tensor silu_mul_linear(
    const at::Tensor& gate,
    const at::Tensor& up,
    const at::Tensor& weight,
    const at::Tensor& bias) {
  TORCH_CHECK(
      gate.dim() >= 1 && gate.sizes() == up.sizes() && weight.dim() == 2 &&
          weight.size(1) == gate.size(-1) &&
          (!bias.defined() ||
           (bias.dim() == 1 && bias.size(0) == weight.size(0))),
      "silu_mul_linear: gate and up must share a shape [..., inter], weight "
      "be [out, inter] and bias [out] or undefined; got gate ",
      gate.sizes(),
      ", up ",
      up.sizes(),
      ", weight ",
      weight.sizes());
  TORCH_CHECK(
      at::isFloatingType(gate.scalar_type()) &&
          gate.scalar_type() == up.scalar_type() &&
          gate.device() == weight.device() && up.device() == weight.device(),
      "silu_mul_linear: gate and up must be floating, of one dtype, on the "
      "weight's device; got ",
      gate.scalar_type(),
      " and ",
      up.scalar_type(),
      " on ",
      gate.device());
  return SiluMulLinear::apply(
      gate,
      up,
      weight,
      detail::bias_slot(bias, weight));
}

} // namespace kernels
} // namespace colossalai
