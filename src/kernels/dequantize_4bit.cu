// QLoRA's 4-bit base weights (NF4 / FP4, bitsandbytes' packing) dequantized
// in one pass: each thread reads 4 packed bytes and writes their 8 values,
// so the kernel moves 4 bits in and 16 bits out per bf16 value (the ATen
// composition widens the bytes to int32 and the indices to int64 on the
// way), a double-quantized absmax decoded as it is read.

#include "dequantize_4bit_cuda.h"

#include "block_scales.cuh"
#include "cuda_device.cuh"

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kBytes = 4; // packed bytes per thread

template <class T>
__global__ void __launch_bounds__(kThreads) dequantize_4bit_kernel(
    const uint8_t* __restrict__ packed,
    BlockScales scales,
    const float* __restrict__ code,
    int64_t blocksize,
    int shift,
    int64_t n,
    T* __restrict__ out) {
  __shared__ float table[16];
  load_code_table(table, code);
  const int64_t bytes = (n + 1) / 2;
  // Byte k of this block's share is read by thread k % kThreads: a warp
  // reads 32 neighbouring bytes and writes their 64 neighbouring values.
  const int64_t first =
      static_cast<int64_t>(blockIdx.x) * kThreads * kBytes + threadIdx.x;
#pragma unroll
  for (int k = 0; k < kBytes; ++k) {
    const int64_t b = first + static_cast<int64_t>(k) * kThreads;
    if (b >= bytes) {
      break;
    }
    const uint8_t byte = packed[b];
    const int64_t i = 2 * b;
    const int64_t block = block_of(i, blocksize, shift);
    const float scale = block_scale(scales, block);
    out[i] = from_float<T>(table[byte >> 4] * scale);
    if (i + 1 < n) { // an odd blocksize may start a block at i + 1
      out[i + 1] = from_float<T>(
          table[byte & 15] *
          (i + 1 == (block + 1) * blocksize ? block_scale(scales, block + 1)
                                            : scale));
    }
  }
}

} // namespace

cudaError_t dequantize_4bit(
    Dtype dtype,
    const uint8_t* packed,
    const BlockScales& scales,
    const float* code,
    int64_t blocksize,
    int blocksize_shift,
    int64_t n,
    void* out,
    cudaStream_t stream) {
  const int64_t bytes = (n + 1) / 2;
  const int64_t per_block = static_cast<int64_t>(kThreads) * kBytes;
  const auto grid = static_cast<unsigned>((bytes + per_block - 1) / per_block);
  return launch_by_dtype(dtype, bytes, [&](auto t) {
    using T = decltype(t);
    dequantize_4bit_kernel<T><<<grid, kThreads, 0, stream>>>(
        packed,
        scales,
        code,
        blocksize,
        blocksize_shift,
        n,
        static_cast<T*>(out));
  });
}

} // namespace cuda
} // namespace kernels
} // namespace colossalai
