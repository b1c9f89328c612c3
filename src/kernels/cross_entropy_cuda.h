#pragma once

// The cross-entropy gradient kernel's launcher (cross_entropy.cu), over
// plain pointers (NOTE [Kernels]). Returns the launch's error.

#include "cuda_types.h"

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

/// Per row r of `logits` (contiguous, rows x cols, in place): with
/// lse = log(sum_j exp(x_j)) in float32 and t = target[r],
///   row_loss[r] = lse - x_t, and x_j := (exp(x_j - lse) - [j == t]) * scale[0],
/// each value rounded once to the element type; a row whose target is
/// `ignore_index` gets loss 0 and a zero gradient, one whose target is
/// outside [0, cols) a NaN loss and NaN gradient.
cudaError_t cross_entropy_grad(
    Dtype dtype,
    void* logits,
    const int64_t* target,
    int64_t ignore_index,
    const float* scale,
    float* row_loss,
    int64_t rows,
    int64_t cols,
    cudaStream_t stream);

} // namespace cuda
} // namespace kernels
} // namespace colossalai
