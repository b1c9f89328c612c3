#pragma once

/// GELU followed by a linear layer, with the activation recomputed in
/// backward instead of kept (NOTE [Kernels]; llm.c's GELU recompute).
///
/// In a transformer MLP, out(gelu(fc(x))), autograd keeps two
/// [tokens x 4 * width] tensors per layer: fc's output (for GELU's
/// backward) and GELU's output (for the weight gradient of `out`). This op
/// keeps only the first and forms gelu(h) again in backward, one
/// elementwise pass: at GPT-2 medium's batch 8 x 1024 in bf16, 64 MiB less
/// per layer, 1.5 GiB over its 24 layers.
///
/// Under autocast the op computes in autocast's dtype, as at::linear would,
/// and returns gradients in each input's own dtype.
///
/// Example:
/// \code
///   auto y = colossalai::kernels::gelu_linear(
///       at::linear(x, fc_weight, fc_bias), out_weight, out_bias, "tanh");
///   y.sum().backward(); // gelu(h) formed again here, not saved
/// \endcode

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

namespace colossalai {
namespace kernels {

/// at::linear(at::gelu(h, approximate), weight, bias): `h` [..., in],
/// `weight` [out, in], `bias` [out] or undefined; `approximate` "none"
/// (the exact erf form) or "tanh". The backward recomputes gelu(h).
at::Tensor gelu_linear(
    const at::Tensor& h,
    const at::Tensor& weight,
    const at::Tensor& bias,
    c10::string_view approximate = "none");

/// The reference: at::linear(at::gelu(h, approximate), weight, bias), which
/// autograd differentiates keeping gelu(h).
at::Tensor gelu_linear_reference(
    const at::Tensor& h,
    const at::Tensor& weight,
    const at::Tensor& bias,
    c10::string_view approximate = "none");

} // namespace kernels
} // namespace colossalai
