#pragma once

// The 4-bit dequantizer's CUDA launcher (dequantize_4bit.cu), over plain
// pointers (NOTE [Kernels]); quantization::dequantize_4bit calls it for a
// tensor on a GPU. The per-block scales' description is shared with the
// few-row products (quantized_gemv_cuda.h).

#include "cuda_types.h"

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

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
  int shift2 = -1; // log2(blocksize2) where a power of two, else -1
};

/// out[i] = code[nibble i] * scale(i / blocksize), formed in fp32 and
/// rounded once to `dtype`; value 2k is byte k's high nibble, 2k + 1 its
/// low one. `code` holds 16 fp32 values; `blocksize_shift` is
/// log2(blocksize) where that is a power of two, else -1 (a shift then
/// replaces a 64-bit divide, a long instruction sequence on a GPU).
cudaError_t dequantize_4bit(
    Dtype dtype,
    const uint8_t* packed,
    const BlockScales& scales,
    const float* code,
    int64_t blocksize,
    int blocksize_shift,
    int64_t n,
    void* out,
    cudaStream_t stream);

} // namespace cuda
} // namespace kernels
} // namespace colossalai
