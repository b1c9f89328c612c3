// gelu_linear (NOTE [Kernels]): linear(gelu(h)) as an autograd Function
// that keeps h and the weight, and forms gelu(h) again in backward. ATen
// ops on every device: the saving is memory, and the matmuls are cuBLAS's.

#include <colossalai/kernels/gelu_linear.h>

#include "linear_dtype.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <string>

namespace colossalai {
namespace kernels {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct GeluLinear : public torch::autograd::Function<GeluLinear> {
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& h,
      const at::Tensor& weight,
      const at::Tensor& bias_or_empty,
      const std::string& approximate) {
    const at::Tensor bias = detail::bias_of(bias_or_empty);
    const auto compute =
        detail::linear_compute_dtype("gelu_linear", h, weight, bias);
    const auto hc = h.to(compute).contiguous();
    const auto w = weight.to(compute);
    const auto b = bias.defined() ? bias.to(compute) : at::Tensor();
    const int64_t in = hc.size(-1);
    const auto h2 = hc.view({-1, in});
    const auto a = at::gelu(h2, approximate);
    auto y = b.defined() ? at::addmm(b, a, w.t()) : at::mm(a, w.t());
    // Only h and the (cast) weight are kept; `a` dies with this frame.
    ctx->save_for_backward({hc, w});
    ctx->saved_data["approximate"] = approximate;
    ctx->saved_data["h_type"] = static_cast<int64_t>(h.scalar_type());
    ctx->saved_data["w_type"] = static_cast<int64_t>(weight.scalar_type());
    ctx->saved_data["b_type"] =
        bias.defined() ? static_cast<int64_t>(bias.scalar_type()) : int64_t{-1};
    ctx->saved_data["need_h"] = h.requires_grad();
    ctx->saved_data["need_w"] = weight.requires_grad();
    ctx->saved_data["need_b"] = bias.defined() && bias.requires_grad();
    auto shape = h.sizes().vec();
    shape.back() = w.size(0);
    return y.view(shape);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& hc = saved[0];
    const auto& w = saved[1];
    const auto approximate = ctx->saved_data["approximate"].toStringRef();
    auto type = [&](const char* k) {
      return static_cast<at::ScalarType>(ctx->saved_data[k].toInt());
    };
    const bool need_h = ctx->saved_data["need_h"].toBool();
    const bool need_w = ctx->saved_data["need_w"].toBool();
    const bool need_b = ctx->saved_data["need_b"].toBool();
    const int64_t in = hc.size(-1);
    const auto h2 = hc.view({-1, in});
    const auto dy = grads[0].to(w.scalar_type()).reshape({-1, w.size(0)});

    at::Tensor dh, dw, db;
    if (need_w) {
      // gelu(h) again: the one pass this op adds, freed after the product.
      dw = at::mm(dy.t(), at::gelu(h2, approximate)).to(type("w_type"));
    }
    if (need_b) {
      db = dy.sum(0).to(type("b_type"));
    }
    if (need_h) {
      dh = at::gelu_backward(at::mm(dy, w), h2, approximate)
               .view(hc.sizes())
               .to(type("h_type"));
    }
    return {dh, dw, db, at::Tensor()};
  }
};

void check_approximate(c10::string_view approximate) {
  TORCH_CHECK(
      approximate == "none" || approximate == "tanh",
      "gelu_linear: approximate must be \"none\" or \"tanh\", got \"",
      std::string(approximate.data(), approximate.size()),
      "\"");
}

} // namespace

at::Tensor gelu_linear_reference(
    const at::Tensor& h,
    const at::Tensor& weight,
    const at::Tensor& bias,
    c10::string_view approximate) {
  check_approximate(approximate);
  return at::linear(at::gelu(h, approximate), weight, bias);
}

at::Tensor gelu_linear(
    const at::Tensor& h,
    const at::Tensor& weight,
    const at::Tensor& bias,
    c10::string_view approximate) {
  check_approximate(approximate);
  TORCH_CHECK(
      h.dim() >= 1 && weight.dim() == 2 && weight.size(1) == h.size(-1) &&
          (!bias.defined() ||
           (bias.dim() == 1 && bias.size(0) == weight.size(0))),
      "gelu_linear: weight must be [out, ",
      h.dim() >= 1 ? h.size(-1) : 0,
      "] and bias [out] or undefined, got weight ",
      weight.sizes(),
      bias.defined() ? " and bias " : "",
      bias.defined() ? bias.sizes() : c10::IntArrayRef());
  TORCH_CHECK(
      at::isFloatingType(h.scalar_type()) && h.device() == weight.device(),
      "gelu_linear: h must be floating and on weight's device, got ",
      h.scalar_type(),
      " on ",
      h.device(),
      " and ",
      weight.device());
  return GeluLinear::apply(
      h,
      weight,
      detail::bias_slot(bias, weight),
      std::string(approximate.data(), approximate.size()));
}

} // namespace kernels
} // namespace colossalai
