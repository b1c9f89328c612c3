#pragma once

/// NOTE [Kernels]
/// Fused operations live in `src/kernels/`, one operation per file set:
/// - `include/colossalai/kernels/<op>.h`: the op (this header's shape): one
///   call that runs the fused kernel where it applies and the reference path
///   elsewhere, the reference itself, and `<op>_fused_applies`.
/// - `src/kernels/<op>.cpp`: the reference path (ATen ops, the computation
///   the library's layers run today, bit for bit), and the fused algorithm
///   as an autograd Function: on the GPU it launches the kernels, on the CPU
///   it runs the same algorithm (same saved statistics, same analytic
///   backward) in ATen, so that the algorithm is tested on any machine.
/// - `src/kernels/<op>.cu`: the CUDA kernels and their launchers, over plain
///   pointers (no ATen in nvcc's translation units: quick to compile, no
///   header skew between nvcc and LibTorch), declared to the `.cpp` by
///   `src/kernels/<op>_cuda.h`. Built when LibTorch has CUDA and CMake
///   finds a CUDA compiler (COLOSSALAI_WITH_CUDA_KERNELS), for the
///   architectures of CMAKE_CUDA_ARCHITECTURES (default 90: H100 / H200;
///   TORCH_CUDA_ARCH_LIST in the environment is honoured).
/// - `tests/test_kernels.cpp`: the fused algorithm against autograd of the
///   reference on the CPU, and on a GPU the kernels against the reference
///   in every dtype they take, forward and backward.
/// A layer switches to a fused op only when a benchmark shows it faster and
/// the tests show it equal within the dtype's rounding; until then it is
/// opt-in, and nothing a layer computes moves.
///
/// RMSNorm (LLaMA's): y = weight * (x / sqrt(mean(x^2, -1) + eps)), the
/// statistics in float32 and the normalised value rounded to x's dtype
/// before the weight multiplies it, as transformers computes it.
///
/// add_rms_norm fuses the residual add before a norm (a decoder layer's
/// `h = x + attn(x); mlp(norm(h))`): one pass reads x and the residual and
/// writes both the sum and its norm, and the backward adds the sum's own
/// gradient (the residual stream's) into the norm's input gradient, where
/// the unfused ops pass over the rows once more for each.
///
/// Example:
/// \code
///   auto y = colossalai::kernels::rms_norm(x, weight, 1e-6);
///   y.sum().backward(); // fused backward on CUDA, autograd elsewhere
///   auto [normed, h] = colossalai::kernels::add_rms_norm(x, a, weight, 1e-6);
/// \endcode

#include <ATen/core/Tensor.h>

#include <utility>

namespace colossalai {
namespace kernels {

/// RMSNorm over the last dimension of `x`, `weight` of that size: the fused
/// CUDA kernels where rms_norm_fused_applies, else rms_norm_reference.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

/// The reference: ATen ops, as shardformer's RMSNorm computes it.
at::Tensor rms_norm_reference(
    const at::Tensor& x,
    const at::Tensor& weight,
    double eps);

/// Whether rms_norm runs the fused kernels for these inputs: a build with
/// CUDA kernels, both on one CUDA device, one dtype of float32, float16
/// or bfloat16, `weight` one-dimensional of x's last size.
bool rms_norm_fused_applies(const at::Tensor& x, const at::Tensor& weight);

/// The residual add and the norm: {rms_norm(x + residual), x + residual},
/// the sum as ATen's add gives it (x's dtype, or the promoted one). One
/// kernel each way where add_rms_norm_fused_applies; elsewhere the add and
/// then rms_norm (its own kernels where they apply).
std::pair<at::Tensor, at::Tensor> add_rms_norm(
    const at::Tensor& x,
    const at::Tensor& residual,
    const at::Tensor& weight,
    double eps);

/// The reference: the add, then rms_norm_reference.
std::pair<at::Tensor, at::Tensor> add_rms_norm_reference(
    const at::Tensor& x,
    const at::Tensor& residual,
    const at::Tensor& weight,
    double eps);

/// rms_norm_fused_applies(x, weight), and `residual` of x's shape on its
/// device, of x's dtype or (x in float32) bfloat16 / float16: a float32
/// residual stream plus an autocast layer's output.
bool add_rms_norm_fused_applies(
    const at::Tensor& x,
    const at::Tensor& residual,
    const at::Tensor& weight);

namespace detail {
/// The fused algorithm (one float32 statistic per row saved for an
/// analytic backward) wherever the inputs are: the CUDA kernels on a GPU,
/// the same algorithm in ATen on the CPU (for the tests).
at::Tensor rms_norm_fused(
    const at::Tensor& x,
    const at::Tensor& weight,
    double eps);

/// add_rms_norm's fused algorithm wherever the inputs are (the kernels on a
/// GPU, ATen on the CPU): the sum and one float32 statistic per row saved.
std::pair<at::Tensor, at::Tensor> add_rms_norm_fused(
    const at::Tensor& x,
    const at::Tensor& residual,
    const at::Tensor& weight,
    double eps);
} // namespace detail

} // namespace kernels
} // namespace colossalai
