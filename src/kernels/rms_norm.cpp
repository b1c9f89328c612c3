// RMSNorm (NOTE [Kernels]): the reference path, and the fused algorithm as
// an autograd Function that launches rms_norm.cu's kernels on a GPU and
// runs the same algorithm in ATen on the CPU.

#include <colossalai/kernels/rms_norm.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "norms.h"

#include <tuple>

#ifdef COLOSSALAI_WITH_CUDA_KERNELS
#include "cuda_launch.h"
#include "rms_norm_cuda.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace colossalai {
namespace kernels {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The forward's output and the float32 statistic per row it saves.
std::pair<at::Tensor, at::Tensor> fused_forward(
    const at::Tensor& x,
    const at::Tensor& weight,
    double eps) {
  const int64_t cols = x.size(-1);
  const int64_t rows = detail::norm_rows(x);
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  if (x.is_cuda()) {
    const c10::cuda::CUDAGuard guard(x.device());
    auto y = at::empty_like(x);
    auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
    if (rows > 0) {
      cuda::check_launch(
          cuda::rms_norm_forward(
              cuda::dtype_of(x.scalar_type(), "rms_norm"),
              x.data_ptr(),
              weight.data_ptr(),
              y.data_ptr(),
              rstd.data_ptr<float>(),
              rows,
              cols,
              static_cast<float>(eps),
              c10::cuda::getCurrentCUDAStream().stream()),
          "rms_norm",
          "the forward kernel");
    }
    return {y, rstd};
  }
#endif
  const auto xf = x.reshape({rows, cols}).to(at::kFloat);
  auto rstd = at::rsqrt(xf.pow(2).mean(-1) + eps);
  auto normed = (xf * rstd.unsqueeze(-1)).to(x.scalar_type());
  return {(weight * normed).reshape(x.sizes()), rstd};
}

// dx and dweight from dy, the inputs and the saved statistic; `dsum`
// (undefined: none) is added to dx, rounded as autograd accumulates it.
std::pair<at::Tensor, at::Tensor> fused_backward(
    const at::Tensor& dy,
    const at::Tensor& x,
    const at::Tensor& weight,
    const at::Tensor& rstd,
    const at::Tensor& dsum) {
  const int64_t cols = x.size(-1);
  const int64_t rows = rstd.numel();
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  if (x.is_cuda()) {
    const c10::cuda::CUDAGuard guard(x.device());
    auto dx = at::empty_like(x);
    auto dweight = at::empty_like(weight);
    if (rows == 0) {
      return {dx, dweight.zero_()};
    }
    TORCH_INTERNAL_ASSERT(
        !dsum.defined() ||
        (dsum.is_contiguous() && dsum.scalar_type() == x.scalar_type()));
    auto partial = at::empty(
        {cuda::norm_param_chunks(rows), cols}, x.options().dtype(at::kFloat));
    cuda::check_launch(
        cuda::rms_norm_backward(
            cuda::dtype_of(x.scalar_type(), "rms_norm"),
            dy.data_ptr(),
            x.data_ptr(),
            weight.data_ptr(),
            rstd.data_ptr<float>(),
            dsum.defined() ? dsum.data_ptr() : nullptr,
            dx.data_ptr(),
            partial.data_ptr<float>(),
            dweight.data_ptr(),
            rows,
            cols,
            c10::cuda::getCurrentCUDAStream().stream()),
        "rms_norm",
        "the backward kernels");
    return {dx, dweight};
  }
#endif
  const auto type = x.scalar_type();
  const auto xf = x.reshape({rows, cols}).to(at::kFloat);
  const auto dyr = dy.reshape({rows, cols});
  const auto r = rstd.unsqueeze(-1);
  // Rounded where the reference's ops round (results of dtype `type`).
  const auto normed = (xf * r).to(type);
  auto dweight = (dyr * normed).sum(0);
  const auto dn = (dyr * weight).to(at::kFloat);
  const auto dot = (dn * xf).sum(-1, true);
  auto dx = (r * dn - r.pow(3) * xf * dot / static_cast<double>(cols))
                .to(type)
                .reshape(x.sizes());
  if (dsum.defined()) {
    dx = dx + dsum;
  }
  return {dx, dweight};
}

struct RmsNormFunction : torch::autograd::Function<RmsNormFunction> {
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& x,
      const at::Tensor& weight,
      double eps) {
    auto out = fused_forward(x, weight, eps);
    ctx->save_for_backward({x, weight, out.second});
    return out.first;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto dy = grads[0].contiguous();
    auto g = fused_backward(dy, saved[0], saved[1], saved[2], at::Tensor());
    return {g.first, g.second, at::Tensor()};
  }
};

// The sum x + residual and its norm, as ATen's add (the promoted dtype,
// which add_rms_norm_fused requires to be x's) and then fused_forward.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_forward(
    const at::Tensor& x,
    const at::Tensor& residual,
    const at::Tensor& weight,
    double eps) {
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  if (x.is_cuda()) {
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t rows = detail::norm_rows(x);
    auto sum = at::empty_like(x);
    auto y = at::empty_like(x);
    auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
    if (rows > 0) {
      cuda::check_launch(
          cuda::add_rms_norm_forward(
              cuda::dtype_of(x.scalar_type(), "add_rms_norm"),
              cuda::dtype_of(residual.scalar_type(), "add_rms_norm"),
              x.data_ptr(),
              residual.data_ptr(),
              weight.data_ptr(),
              sum.data_ptr(),
              y.data_ptr(),
              rstd.data_ptr<float>(),
              rows,
              x.size(-1),
              static_cast<float>(eps),
              c10::cuda::getCurrentCUDAStream().stream()),
          "add_rms_norm",
          "the forward kernel");
    }
    return {y, sum, rstd};
  }
#endif
  auto sum = x + residual;
  auto out = fused_forward(sum, weight, eps);
  return {out.first, sum, out.second};
}

// Outputs (y, sum). The sum's own upstream gradient (the residual stream's)
// joins the norm's in the input-gradient kernel; x and residual both
// receive the total, the residual in its own dtype.
struct AddRmsNormFunction : torch::autograd::Function<AddRmsNormFunction> {
  static variable_list forward(
      AutogradContext* ctx,
      const at::Tensor& x,
      const at::Tensor& residual,
      const at::Tensor& weight,
      double eps) {
    auto [y, sum, rstd] = fused_add_forward(x, residual, weight, eps);
    ctx->save_for_backward({sum, weight, rstd});
    detail::begin_residual_add(ctx, residual);
    return {y, sum};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto dsum = grads[1].defined() ? grads[1].contiguous() : at::Tensor();
    if (!grads[0].defined()) {
      auto [gx, gr] = detail::residual_add_grads(ctx, dsum);
      return {gx, gr, at::Tensor(), at::Tensor()};
    }
    auto g = fused_backward(
        grads[0].contiguous(), saved[0], saved[1], saved[2], dsum);
    auto [gx, gr] = detail::residual_add_grads(ctx, g.first);
    return {gx, gr, g.second, at::Tensor()};
  }
};

} // namespace

at::Tensor rms_norm_reference(
    const at::Tensor& x,
    const at::Tensor& weight,
    double eps) {
  auto xf = x.to(at::kFloat);
  auto normed = xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps);
  return weight * normed.to(x.scalar_type());
}

bool rms_norm_fused_applies(const at::Tensor& x, const at::Tensor& weight) {
#ifdef COLOSSALAI_WITH_CUDA_KERNELS
  const auto t = x.scalar_type();
  return x.defined() && weight.defined() && x.is_cuda() &&
      weight.device() == x.device() && x.dim() >= 1 && weight.dim() == 1 &&
      weight.size(0) == x.size(-1) && weight.scalar_type() == t &&
      (t == at::kFloat || t == at::kHalf || t == at::kBFloat16);
#else
  (void)x;
  (void)weight;
  return false;
#endif
}

std::pair<at::Tensor, at::Tensor> add_rms_norm_reference(
    const at::Tensor& x,
    const at::Tensor& residual,
    const at::Tensor& weight,
    double eps) {
  auto sum = x + residual;
  return {rms_norm_reference(sum, weight, eps), sum};
}

bool add_rms_norm_fused_applies(
    const at::Tensor& x,
    const at::Tensor& residual,
    const at::Tensor& weight) {
  if (!rms_norm_fused_applies(x, weight) || !residual.defined() ||
      residual.device() != x.device() || !residual.sizes().equals(x.sizes())) {
    return false;
  }
  const auto r = residual.scalar_type();
  return r == x.scalar_type() ||
      (x.scalar_type() == at::kFloat && (r == at::kHalf || r == at::kBFloat16));
}

std::pair<at::Tensor, at::Tensor> add_rms_norm(
    const at::Tensor& x,
    const at::Tensor& residual,
    const at::Tensor& weight,
    double eps) {
  if (add_rms_norm_fused_applies(x, residual, weight)) {
    return detail::add_rms_norm_fused(x, residual, weight, eps);
  }
  // Unfused: the add, then the norm as rms_norm picks it.
  auto sum = x + residual;
  return {rms_norm(sum, weight, eps), sum};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_fused_applies(x, weight)
      ? detail::rms_norm_fused(x, weight, eps)
      : rms_norm_reference(x, weight, eps);
}

namespace detail {

namespace {
void check_weight(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(
      x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1) &&
          weight.scalar_type() == x.scalar_type(),
      "rms_norm: weight must be one-dimensional of x's last size (",
      x.dim() >= 1 ? x.size(-1) : 0,
      ") and x's dtype (",
      x.scalar_type(),
      "), got shape ",
      weight.sizes(),
      " and ",
      weight.scalar_type());
}
} // namespace

at::Tensor rms_norm_fused(
    const at::Tensor& x,
    const at::Tensor& weight,
    double eps) {
  check_weight(x, weight);
  return RmsNormFunction::apply(x.contiguous(), weight.contiguous(), eps);
}

std::pair<at::Tensor, at::Tensor> add_rms_norm_fused(
    const at::Tensor& x,
    const at::Tensor& residual,
    const at::Tensor& weight,
    double eps) {
  TORCH_CHECK(
      residual.sizes().equals(x.sizes()) &&
          at::result_type(x, residual) == x.scalar_type(),
      "add_rms_norm: residual must have x's shape ",
      x.sizes(),
      " and a dtype whose sum with x keeps x's (",
      x.scalar_type(),
      "), got ",
      residual.sizes(),
      " and ",
      residual.scalar_type());
  check_weight(x, weight);
  auto out = AddRmsNormFunction::apply(
      x.contiguous(), residual.contiguous(), weight.contiguous(), eps);
  return {out[0], out[1]};
}

} // namespace detail

} // namespace kernels
} // namespace colossalai
