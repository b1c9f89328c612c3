// The residual add + LayerNorm (NOTE [Kernels]): the reference path, and the
// fused algorithm as an autograd Function that launches layer_norm.cu's
// kernels on a GPU and ATen's LayerNorm kernels on the CPU.

#include <colossalai/kernels/layer_norm.h>

#include <colossalai/utils/compat.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "norms.h"

#include <array>
#include <tuple>

#ifdef COLOSSALAI_WITH_CUDA_KERNELS
#include "cuda_launch.h"
#include "layer_norm_cuda.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace colossalai {
namespace kernels {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// y, the sum, and the statistics the backward needs (mean, rstd).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_forward(
    const at::Tensor& x,
    const at::Tensor& residual,
    const at::Tensor& weight,
    const at::Tensor& bias,
    double eps) {
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  if (x.is_cuda()) {
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t rows = detail::norm_rows(x);
    auto sum = at::empty_like(x);
    auto y = at::empty_like(x);
    auto mean = at::empty({rows}, x.options().dtype(at::kFloat));
    auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
    cuda::check_launch(
        cuda::add_layer_norm_forward(
            cuda::dtype_of(x.scalar_type(), "add_layer_norm"),
            cuda::dtype_of(residual.scalar_type(), "add_layer_norm"),
            x.data_ptr(),
            residual.data_ptr(),
            weight.data_ptr(),
            bias.data_ptr(),
            sum.data_ptr(),
            y.data_ptr(),
            mean.data_ptr<float>(),
            rstd.data_ptr<float>(),
            rows,
            x.size(-1),
            static_cast<float>(eps),
            c10::cuda::getCurrentCUDAStream().stream()),
        "add_layer_norm",
        "the forward kernel");
    return {y, sum, mean, rstd};
  }
#endif
  auto sum = x + residual;
  auto out = at::native_layer_norm(sum, {x.size(-1)}, weight, bias, eps);
  return {std::get<0>(out), sum, std::get<1>(out), std::get<2>(out)};
}

// dx (with dsum added, where defined), dweight and dbias.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_backward(
    const at::Tensor& dy,
    const at::Tensor& sum,
    const at::Tensor& weight,
    const at::Tensor& bias,
    const at::Tensor& mean,
    const at::Tensor& rstd,
    const at::Tensor& dsum) {
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  if (sum.is_cuda()) {
    const c10::cuda::CUDAGuard guard(sum.device());
    const int64_t rows = detail::norm_rows(sum), cols = sum.size(-1);
    auto dx = at::empty_like(sum);
    auto dweight = at::empty_like(weight);
    auto dbias = at::empty_like(bias);
    if (rows == 0) {
      return {dx, dweight.zero_(), dbias.zero_()};
    }
    TORCH_INTERNAL_ASSERT(
        !dsum.defined() ||
        (dsum.is_contiguous() && dsum.scalar_type() == sum.scalar_type()));
    auto partial = at::empty(
        {2 * cuda::norm_param_chunks(rows), cols},
        sum.options().dtype(at::kFloat));
    cuda::check_launch(
        cuda::add_layer_norm_backward(
            cuda::dtype_of(sum.scalar_type(), "add_layer_norm"),
            dy.data_ptr(),
            sum.data_ptr(),
            weight.data_ptr(),
            mean.data_ptr<float>(),
            rstd.data_ptr<float>(),
            dsum.defined() ? dsum.data_ptr() : nullptr,
            dx.data_ptr(),
            partial.data_ptr<float>(),
            dweight.data_ptr(),
            dbias.data_ptr(),
            rows,
            cols,
            c10::cuda::getCurrentCUDAStream().stream()),
        "add_layer_norm",
        "the backward kernels");
    return {dx, dweight, dbias};
  }
#endif
  auto g = at::native_layer_norm_backward(
      dy, sum, {sum.size(-1)}, mean, rstd, weight, bias, {true, true, true});
  auto dx = std::get<0>(g);
  if (dsum.defined()) {
    dx = dx + dsum;
  }
  return {dx, std::get<1>(g), std::get<2>(g)};
}

// Outputs (y, sum); x and the residual both receive the sum's total
// gradient, the residual in its own dtype.
struct AddLayerNormFunction : torch::autograd::Function<AddLayerNormFunction> {
  static variable_list forward(
      AutogradContext* ctx,
      const at::Tensor& x,
      const at::Tensor& residual,
      const at::Tensor& weight,
      const at::Tensor& bias,
      double eps) {
    auto [y, sum, mean, rstd] = fused_forward(x, residual, weight, bias, eps);
    ctx->save_for_backward({sum, weight, bias, mean, rstd});
    detail::begin_residual_add(ctx, residual);
    return {y, sum};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto dsum = grads[1].defined() ? grads[1].contiguous() : at::Tensor();
    if (!grads[0].defined()) {
      auto [gx, gr] = detail::residual_add_grads(ctx, dsum);
      return {gx, gr, at::Tensor(), at::Tensor(), at::Tensor()};
    }
    auto [dx, dweight, dbias] = fused_backward(
        grads[0].contiguous(), s[0], s[1], s[2], s[3], s[4], dsum);
    auto [gx, gr] = detail::residual_add_grads(ctx, dx);
    return {gx, gr, dweight, dbias, at::Tensor()};
  }
};

} // namespace

std::pair<at::Tensor, at::Tensor> add_layer_norm_reference(
    const at::Tensor& x,
    const at::Tensor& residual,
    const at::Tensor& weight,
    const at::Tensor& bias,
    double eps) {
  auto sum = x + residual;
  return {at::layer_norm(sum, {sum.size(-1)}, weight, bias, eps), sum};
}

bool add_layer_norm_fused_applies(
    const at::Tensor& x,
    const at::Tensor& residual,
    const at::Tensor& weight,
    const at::Tensor& bias) {
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  if (!x.defined() || !residual.defined() || !weight.defined() ||
      !bias.defined() || !x.is_cuda() || x.dim() < 1) {
    return false;
  }
  const auto t = x.scalar_type();
  const auto r = residual.scalar_type();
  // Autocast runs LayerNorm in float32 (a float32 result from bf16 / fp16
  // inputs); the kernels keep x's dtype, so they take only float32 x there.
  if (t != at::kFloat && compat::autocast_dtype(at::kCUDA).has_value()) {
    return false;
  }
  const auto one_vector = [&](const at::Tensor& v) {
    return v.device() == x.device() && v.dim() == 1 &&
        v.size(0) == x.size(-1) && v.scalar_type() == t;
  };
  return (t == at::kFloat || t == at::kHalf || t == at::kBFloat16) &&
      one_vector(weight) && one_vector(bias) &&
      residual.device() == x.device() && residual.sizes().equals(x.sizes()) &&
      (r == t || (t == at::kFloat && (r == at::kHalf || r == at::kBFloat16)));
#else
  (void)x;
  (void)residual;
  (void)weight;
  (void)bias;
  return false;
#endif
}

std::pair<at::Tensor, at::Tensor> add_layer_norm(
    const at::Tensor& x,
    const at::Tensor& residual,
    const at::Tensor& weight,
    const at::Tensor& bias,
    double eps) {
  return add_layer_norm_fused_applies(x, residual, weight, bias)
      ? detail::add_layer_norm_fused(x, residual, weight, bias, eps)
      : add_layer_norm_reference(x, residual, weight, bias, eps);
}

namespace detail {

std::pair<at::Tensor, at::Tensor> add_layer_norm_fused(
    const at::Tensor& x,
    const at::Tensor& residual,
    const at::Tensor& weight,
    const at::Tensor& bias,
    double eps) {
  TORCH_CHECK(
      x.dim() >= 1 && residual.sizes().equals(x.sizes()) &&
          at::result_type(x, residual) == x.scalar_type(),
      "add_layer_norm: residual must have x's shape ",
      x.sizes(),
      " and a dtype whose sum with x keeps x's (",
      x.scalar_type(),
      "), got ",
      residual.sizes(),
      " and ",
      residual.scalar_type());
  for (const auto* v : {&weight, &bias}) {
    TORCH_CHECK(
        v->defined() && v->dim() == 1 && v->size(0) == x.size(-1) &&
            v->scalar_type() == x.scalar_type(),
        "add_layer_norm: weight and bias must be one-dimensional of x's "
        "last size (",
        x.size(-1),
        ") and x's dtype (",
        x.scalar_type(),
        "), got ",
        v->defined() ? v->sizes() : at::IntArrayRef{},
        v->defined() ? c10::toString(v->scalar_type()) : "undefined");
  }
  auto out = AddLayerNormFunction::apply(
      x.contiguous(),
      residual.contiguous(),
      weight.contiguous(),
      bias.contiguous(),
      eps);
  return {out[0], out[1]};
}

} // namespace detail

} // namespace kernels
} // namespace colossalai
