#pragma once

// The dtype a linear layer inside a fused op computes in, shared by the ops
// that take a layer's weight (fused_linear_cross_entropy, gelu_linear).

#include <colossalai/utils/compat.h>

#include <ATen/core/Tensor.h>
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

} // namespace detail
} // namespace kernels
} // namespace colossalai
