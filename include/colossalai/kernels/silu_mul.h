#pragma once

/// SwiGLU's gate: silu(gate) * up (LLaMA's MLP between its projections),
/// forward and backward in one pass each (NOTE [Kernels]).
///
/// ATen's composition runs silu, then the product, and keeps three
/// [tokens x intermediate] tensors for backward (gate for silu, silu(gate)
/// and up for the product). The fused op keeps gate and up only, forms
/// each value in float32 and rounds it once, and recomputes the sigmoid in
/// backward: a third less activation memory in every MLP and one pass
/// instead of two forward (four backward).
///
/// Example:
/// \code
///   auto h = colossalai::kernels::silu_mul(gate_proj(x), up_proj(x));
///   auto y = down_proj(h);
/// \endcode

#include <ATen/core/Tensor.h>

namespace colossalai {
namespace kernels {

/// silu(gate) * up (same shapes, one floating dtype): the fused CUDA
/// kernels where silu_mul_fused_applies, else silu_mul_reference.
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);

/// The reference: at::silu(gate) * up, as the LLaMA family's MLP computes.
at::Tensor silu_mul_reference(const at::Tensor& gate, const at::Tensor& up);

/// Whether silu_mul runs the fused kernels: a build with CUDA kernels, both
/// on one CUDA device, one dtype of float32, float16 or bfloat16, one shape.
bool silu_mul_fused_applies(const at::Tensor& gate, const at::Tensor& up);

namespace detail {
/// The fused algorithm (values formed in float32 and rounded once; an
/// analytic backward from the saved inputs) wherever the inputs are: the
/// CUDA kernels on a GPU, the same algorithm in ATen elsewhere (for the
/// tests).
at::Tensor silu_mul_fused(const at::Tensor& gate, const at::Tensor& up);
} // namespace detail

} // namespace kernels
} // namespace colossalai
