#pragma once

/// Rotary position embedding (LLaMA's apply_rotary_pos_emb) in one pass
/// each way (NOTE [Kernels]): out = x * cos + rotate_half(x) * sin, with
/// rotate_half(x) = (-x2, x1) over the halves of the head dimension.
///
/// ATen's composition runs five kernels forward (two products, a negation,
/// a concatenation, a sum) and more backward over every query and key. The
/// fused op reads x and the tables once, forms each value in float32 and
/// rounds it once; its backward is the inverse rotation of the gradient.
/// The tables are the reference's: cos and sin already in x's dtype.
///
/// Example:
/// \code
///   // q [B, T, H, D]; cos, sin [T, D] (or [B, T, D]) in q's dtype
///   auto q_rot = colossalai::kernels::rope(q, cos, sin);
/// \endcode

#include <ATen/core/Tensor.h>

namespace colossalai {
namespace kernels {

/// x [B, T, H, D] rotated by the angles whose cosines and sines `cos` and
/// `sin` hold ([T, D] for every batch row, or [B, T, D]): the fused kernels
/// where rope_fused_applies, else rope_reference.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

/// The reference: x * cos + rotate_half(x) * sin in ATen ops, as the LLaMA
/// family computes it.
at::Tensor rope_reference(
    const at::Tensor& x,
    const at::Tensor& cos,
    const at::Tensor& sin);

/// Whether rope runs the fused kernels: a build with CUDA kernels, all on
/// one CUDA device in one dtype of float32, float16 or bfloat16, x
/// contiguous [B, T, H, D] with D even, the tables contiguous [T, D] or
/// [B, T, D].
bool rope_fused_applies(
    const at::Tensor& x,
    const at::Tensor& cos,
    const at::Tensor& sin);

namespace detail {
/// The fused algorithm (each value formed in float32 and rounded once; the
/// backward the inverse rotation) wherever the inputs are: the CUDA kernels
/// on a GPU, the same algorithm in ATen elsewhere (for the tests).
at::Tensor rope_fused(
    const at::Tensor& x,
    const at::Tensor& cos,
    const at::Tensor& sin);
} // namespace detail

} // namespace kernels
} // namespace colossalai
