#pragma once

// The few-row products on quantized weights (quantized_gemv.cu; NOTE
// [Few-row products on quantized weights] in quantization/bnb.h), over
// plain pointers (NOTE [Kernels]).

#include "cuda_types.h"

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

/// The most rows of x one launch takes.
constexpr int64_t kGemvMaxRows = 8;

/// Where a 4-bit weight's per-block scales come from: `absmax` (fp32, one
/// per block), or with `nested_absmax` (uint8, one per block) the value
/// fl(fl(code2[q] * absmax2[block / blocksize2]) + *offset).
struct BlockScales {
  const float* absmax = nullptr;
  const uint8_t* nested_absmax = nullptr;
  const float* code2 = nullptr;   // 256 values
  const float* absmax2 = nullptr; // one per blocksize2 blocks
  const float* offset = nullptr;  // one value, on the device
  int64_t blocksize2 = 256;
};

/// out [m, n] = x [m, k] times W [n, k] transposed, m <= kGemvMaxRows; W's
/// value at flat index i is code[nibble i] * scale(i / blocksize) rounded
/// to `dtype` (value 2j is byte j's high nibble), the products summed in
/// fp32, each result rounded once to `dtype`. x and out in `dtype`.
cudaError_t gemv_4bit(
    Dtype dtype,
    const void* x,
    int64_t m,
    int64_t k,
    const uint8_t* packed,
    const BlockScales& scales,
    const float* code,
    int64_t blocksize,
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
