#pragma once

// add_layer_norm's CUDA launchers (layer_norm.cu), over plain pointers:
// nvcc's translation unit includes no ATen (NOTE [Kernels]). Each returns
// the launch's error.

#include "cuda_types.h"

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

/// sum = round(x + residual) (x's dtype; `residual` of it, or bf16 / fp16
/// with x in float32), written out; then LayerNorm of each row of sums:
/// y = (sum - mean) * rstd * weight + bias in float32, rounded once, with
/// the row's mean and rstd = 1 / sqrt(var + eps) saved (float32, one per
/// row). Contiguous rows of `cols`.
cudaError_t add_layer_norm_forward(
    Dtype dtype,
    Dtype residual_dtype,
    const void* x,
    const void* residual,
    const void* weight,
    const void* bias,
    void* sum,
    void* y,
    float* mean,
    float* rstd,
    int64_t rows,
    int64_t cols,
    float eps,
    cudaStream_t stream);

/// dx of the LayerNorm at the saved sums and statistics, plus `dsum` where
/// not null (rounded once, added, rounded again: autograd's accumulation);
/// dweight and dbias summed over rows through `partial` (float32,
/// 2 x norm_param_chunks(rows) x cols).
cudaError_t add_layer_norm_backward(
    Dtype dtype,
    const void* dy,
    const void* sum,
    const void* weight,
    const float* mean,
    const float* rstd,
    const void* dsum,
    void* dx,
    float* partial,
    void* dweight,
    void* dbias,
    int64_t rows,
    int64_t cols,
    cudaStream_t stream);

} // namespace cuda
} // namespace kernels
} // namespace colossalai
