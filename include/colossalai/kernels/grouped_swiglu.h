#pragma once

/// A mixture of experts' SwiGLU experts over their tokens, one grouped GEMM
/// per projection (NOTE [Kernels]).
///
/// A sparse block sorts its (token, expert) rows by expert; running each
/// expert on its rows means one GEMM per expert and projection, cut at
/// counts the host must read (a GPU's queue drains once per layer, and a
/// CUDA graph cannot capture it). This op keeps the counts on the device:
/// each expert's rows are padded to a multiple of 8 (at least 8, so no
/// group is empty; the padding rows are zeros and stay out of every
/// result) and
/// at::_grouped_mm multiplies every group by its own weight in one call,
/// forward and backward (compat::has_grouped_mm: LibTorch 2.10+, bf16 on
/// Hopper / Blackwell GPUs, float32 / 16-bit on the CPU).
///
/// The experts' weights are read in place where they lie evenly spaced in
/// one storage, as a flat buffer holds them (LowLevelZero's and Gemini's
/// parameters are its views), and stacked in one copy otherwise (autocast
/// casts each weight anyway).
///
/// Example:
/// \code
///   // rows [N, C] sorted by expert; counts [E] int64 on rows' device
///   if (colossalai::kernels::grouped_swiglu_applies(rows, gate, up, down)) {
///     auto y = colossalai::kernels::grouped_swiglu(rows, counts, gate, up,
///                                                  down);
///   }
/// \endcode

#include <ATen/core/Tensor.h>

namespace colossalai {
namespace kernels {

/// For each row of `rows` [N, C] (sorted by expert, `counts` [E] rows per
/// expert, int64 on rows' device, summing to N): down_e(silu(gate_e(x)) *
/// up_e(x)) of its expert e, [N, C]. `gate` and `up` hold E weights [I, C],
/// `down` E weights [C, I] (nn.Linear's layout, no bias). Computes in
/// autocast's dtype where autocast is on (as at::linear), else in rows'
/// dtype, which the weights then share; gradients come in each input's
/// dtype. An expert with no rows gets a zero gradient. Requires
/// grouped_swiglu_applies.
at::Tensor grouped_swiglu(
    const at::Tensor& rows,
    const at::Tensor& counts,
    at::TensorList gate,
    at::TensorList up,
    at::TensorList down);

/// Whether grouped_swiglu takes these: compat::has_grouped_mm for the
/// compute dtype on rows' device, 1 to 1023 experts' weights of one shape,
/// dtype and device per projection, C and I whole multiples of 16 bytes in
/// the compute dtype, padded rows within int32.
bool grouped_swiglu_applies(
    const at::Tensor& rows,
    at::TensorList gate,
    at::TensorList up,
    at::TensorList down);

/// The reference: each expert's rows through at::linear (counts read back
/// to the host), as a sparse block runs its expert modules.
at::Tensor grouped_swiglu_reference(
    const at::Tensor& rows,
    const at::Tensor& counts,
    at::TensorList gate,
    at::TensorList up,
    at::TensorList down);

} // namespace kernels
} // namespace colossalai
