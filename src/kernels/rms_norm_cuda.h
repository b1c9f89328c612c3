#pragma once

// rms_norm's CUDA launchers (rms_norm.cu), over plain pointers: nvcc's
// translation unit includes no ATen (NOTE [Kernels]). Each returns the
// launch's error.

#include "cuda_types.h"

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

/// y = weight * round(x * rstd), rstd = 1 / sqrt(mean(x^2) + eps) per row,
/// saved in `rstd` (float32, one per row). Contiguous rows of `cols`.
cudaError_t rms_norm_forward(
    Dtype dtype,
    const void* x,
    const void* weight,
    void* y,
    float* rstd,
    int64_t rows,
    int64_t cols,
    float eps,
    cudaStream_t stream);

/// The norm of sum = x + residual, each sum rounded once to x's dtype and
/// written to `sum`, then as rms_norm_forward over the sums. `residual` is
/// of x's dtype, or bfloat16 / float16 with x in float32.
cudaError_t add_rms_norm_forward(
    Dtype dtype,
    Dtype residual_dtype,
    const void* x,
    const void* residual,
    const void* weight,
    void* sum,
    void* y,
    float* rstd,
    int64_t rows,
    int64_t cols,
    float eps,
    cudaStream_t stream);

/// dx, and dweight summed over rows through `partial` (float32,
/// norm_param_chunks(rows) x cols). `dsum`, where not null, is added
/// to dx: the gradient a fused residual's sum receives besides the norm's.
cudaError_t rms_norm_backward(
    Dtype dtype,
    const void* dy,
    const void* x,
    const void* weight,
    const float* rstd,
    const void* dsum,
    void* dx,
    float* partial,
    void* dweight,
    int64_t rows,
    int64_t cols,
    cudaStream_t stream);

} // namespace cuda
} // namespace kernels
} // namespace colossalai
