#pragma once

// silu_mul's CUDA launchers (silu_mul.cu), over plain pointers (NOTE
// [Kernels]). Each returns the launch's error.

#include "cuda_types.h"

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

/// out = silu(gate) * up over n contiguous elements.
cudaError_t silu_mul_forward(
    Dtype dtype,
    const void* gate,
    const void* up,
    void* out,
    int64_t n,
    cudaStream_t stream);

/// d_gate = dout * up * s * (1 + gate * (1 - s)), d_up = dout * gate * s,
/// s = sigmoid(gate), over n contiguous elements.
cudaError_t silu_mul_backward(
    Dtype dtype,
    const void* dout,
    const void* gate,
    const void* up,
    void* d_gate,
    void* d_up,
    int64_t n,
    cudaStream_t stream);

} // namespace cuda
} // namespace kernels
} // namespace colossalai
