#pragma once

// What the norm ops share (rms_norm, add_rms_norm, add_layer_norm): the
// rows they normalise, and the fused residual add's autograd side (both
// outputs' gradients may be undefined, an unused output's; x and the
// residual receive the sum's total gradient, the residual in its own dtype:
// a bf16 layer output on a float32 stream).

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/custom_function.h>

#include <utility>

namespace colossalai {
namespace kernels {
namespace detail {

/// Rows of `x` normalised over its last dimension (0 for a width of 0).
inline int64_t norm_rows(const at::Tensor& x) {
  const int64_t cols = x.size(-1);
  return cols == 0 ? 0 : x.numel() / cols;
}

/// In forward: keeps the residual's dtype, and leaves an unused output's
/// gradient undefined (with the norm unused its parameters get none, as
/// through the unfused add and norm).
inline void begin_residual_add(
    torch::autograd::AutogradContext* ctx,
    const at::Tensor& residual) {
  ctx->saved_data["residual_dtype"] =
      static_cast<int64_t>(residual.scalar_type());
  ctx->set_materialize_grads(false);
}

/// In backward: x's and the residual's gradients from the sum's total
/// gradient `d` (undefined: none).
inline std::pair<at::Tensor, at::Tensor> residual_add_grads(
    torch::autograd::AutogradContext* ctx,
    const at::Tensor& d) {
  if (!d.defined()) {
    return {};
  }
  const auto rtype =
      static_cast<at::ScalarType>(ctx->saved_data["residual_dtype"].toInt());
  return {d, d.to(rtype)};
}

} // namespace detail
} // namespace kernels
} // namespace colossalai
