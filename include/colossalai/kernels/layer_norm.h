#pragma once

/// The residual add before a LayerNorm, fused with it (NOTE [Kernels] in
/// `rms_norm.h`): a GPT block's `h = x + attn(ln_1(x)); mlp(ln_2(h))`. On a
/// GPU one pass reads x and the residual and writes the sum and its norm,
/// and the backward adds the sum's own gradient (the residual stream's) to
/// the norm's input gradient, where the unfused ops pass over the rows once
/// more for each. LayerNorm's arithmetic is ATen's: float32 statistics and
/// intermediates, each output rounded once.
///
/// Example:
/// \code
///   auto [normed, h] = colossalai::kernels::add_layer_norm(
///       x, attn_out, ln_2->weight, ln_2->bias, ln_2->options.eps());
///   auto out = h + mlp(normed);
/// \endcode

#include <ATen/core/Tensor.h>

#include <utility>

namespace colossalai {
namespace kernels {

/// {layer_norm(x + residual) over the last dimension, x + residual}, the
/// sum as ATen's add gives it. The fused kernels where
/// add_layer_norm_fused_applies; elsewhere add_layer_norm_reference.
std::pair<at::Tensor, at::Tensor> add_layer_norm(
    const at::Tensor& x,
    const at::Tensor& residual,
    const at::Tensor& weight,
    const at::Tensor& bias,
    double eps);

/// The reference: ATen's add, then at::layer_norm (torch::nn::LayerNorm's
/// computation).
std::pair<at::Tensor, at::Tensor> add_layer_norm_reference(
    const at::Tensor& x,
    const at::Tensor& residual,
    const at::Tensor& weight,
    const at::Tensor& bias,
    double eps);

/// A build with CUDA kernels; x, residual, weight and bias on one CUDA
/// device; x float32, float16 or bfloat16 with weight and bias
/// one-dimensional of its last size and dtype; the residual of x's shape
/// and dtype, or (x in float32) bfloat16 / float16. Under CUDA autocast
/// only a float32 x (autocast computes LayerNorm in float32).
bool add_layer_norm_fused_applies(
    const at::Tensor& x,
    const at::Tensor& residual,
    const at::Tensor& weight,
    const at::Tensor& bias);

namespace detail {
/// The fused algorithm wherever the inputs are: the CUDA kernels on a GPU,
/// ATen's LayerNorm forward and backward kernels on the CPU (the sum and
/// the statistics saved, the sum's gradient added to the input gradient).
std::pair<at::Tensor, at::Tensor> add_layer_norm_fused(
    const at::Tensor& x,
    const at::Tensor& residual,
    const at::Tensor& weight,
    const at::Tensor& bias,
    double eps);
} // namespace detail

} // namespace kernels
} // namespace colossalai
