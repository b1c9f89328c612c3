#pragma once

// The int8 row dequantizer's CUDA launcher (dequantize_int8.cu), over plain
// pointers (NOTE [Kernels]); QuantizedWeight::dequantize calls it for an
// 8-bit weight on a GPU.

#include "cuda_types.h"

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

/// out[r, c] = q[r, c] * s_r, s_r = scb[r] * inv127 rounded to `dtype`,
/// the product formed in fp32 and rounded once to `dtype`: the ATen
/// composition's arithmetic (LLM.int8's row scale, bitsandbytes' CB * SCB /
/// 127). `q` is contiguous [rows, cols].
cudaError_t dequantize_int8(
    Dtype dtype,
    const int8_t* q,
    const float* scb,
    float inv127,
    int64_t rows,
    int64_t cols,
    void* out,
    cudaStream_t stream);

} // namespace cuda
} // namespace kernels
} // namespace colossalai
