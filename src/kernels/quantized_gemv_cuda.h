#pragma once

// The few-row products on quantized weights (quantized_gemv.cu; NOTE
// [Few-row products on quantized weights] in quantization/bnb.h), over
// plain pointers (NOTE [Kernels]).

#include "dequantize_4bit_cuda.h"

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

/// The most rows of x one launch takes.
constexpr int64_t kGemvMaxRows = 8;

/// out [m, n] = x [m, k] times W [n, k] transposed, m <= kGemvMaxRows; W's
/// value at flat index i is code[nibble i] * scale(i / blocksize) rounded
/// to `dtype` (value 2j is byte j's high nibble), the products summed in
/// fp32, each result rounded once to `dtype`. x and out in `dtype`;
/// `blocksize_shift` as dequantize_4bit takes it.
cudaError_t gemv_4bit(
    Dtype dtype,
    const void* x,
    int64_t m,
    int64_t k,
    const uint8_t* packed,
    const BlockScales& scales,
    const float* code,
    int64_t blocksize,
    int blocksize_shift,
    int64_t n,
    void* out,
    cudaStream_t stream);

/// out [m, n] = a [m, k] times b [n, k] transposed, int8 in, exact int32
/// out, m <= kGemvMaxRows.
cudaError_t int8_gemv(
    const int8_t* a,
    int64_t m,
    int64_t k,
    const int8_t* b,
    int64_t n,
    int32_t* out,
    cudaStream_t stream);

} // namespace cuda
} // namespace kernels
} // namespace colossalai
