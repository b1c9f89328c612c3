#pragma once

// The 4-bit dequantizer's CUDA launcher (dequantize_4bit.cu), over plain
// pointers (NOTE [Kernels]); quantization::dequantize_4bit calls it for a
// tensor on a GPU.

#include "cuda_types.h"

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

/// out[i] = code[nibble i] * absmax[i / blocksize], formed in fp32 and
/// rounded once to `dtype`; value 2k is byte k's high nibble, 2k + 1 its
/// low one. `code` holds 16 fp32 values, `absmax` one per block.
cudaError_t dequantize_4bit(
    Dtype dtype,
    const uint8_t* packed,
    const float* absmax,
    const float* code,
    int64_t blocksize,
    int64_t n,
    void* out,
    cudaStream_t stream);

} // namespace cuda
} // namespace kernels
} // namespace colossalai
