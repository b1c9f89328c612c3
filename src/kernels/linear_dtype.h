#pragma once

// What the ops that take a layer's weight share (fused_linear_cross_entropy,
// gelu_linear, silu_mul_linear): the dtype their linear computes in, and
// the slot an optional bias takes in an autograd Function.

#include <colossalai/utils/compat.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

namespace colossalai {
namespace kernels {
namespace detail {

/// Autocast's dtype where it is on for x's device (as at::linear would be
/// cast), else x's own, which weight and bias (if defined) must then share
/// (as at::linear requires); the error names `op`.
inline at::ScalarType linear_compute_dtype(
    const char* op,
    const at::Tensor& x,
    const at::Tensor& weight,
    const at::Tensor& bias) {
  const auto autocast = compat::autocast_dtype(x.device().type());
  TORCH_CHECK(
      autocast.has_value() ||
          (weight.scalar_type() == x.scalar_type() &&
           (!bias.defined() || bias.scalar_type() == x.scalar_type())),
      op,
      ": the input (",
      x.scalar_type(),
      "), weight (",
      weight.scalar_type(),
      ") and bias differ in dtype outside autocast");
  return autocast.value_or(x.scalar_type());
}

/// A Function's tensor inputs must be defined: no bias travels as an empty
/// tensor (bias_slot), and bias_of gives it back as undefined.
inline at::Tensor bias_slot(const at::Tensor& bias, const at::Tensor& like) {
  return bias.defined() ? bias : at::empty({0}, like.options());
}
inline at::Tensor bias_of(const at::Tensor& slot) {
  return slot.numel() > 0 ? slot : at::Tensor();
}

} // namespace detail
} // namespace kernels
} // namespace colossalai
