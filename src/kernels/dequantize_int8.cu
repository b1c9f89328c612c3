// LLM.int8's 8-bit base weights dequantized in one pass: one byte in and
// one value out per element (the ATen composition writes the widened
// weight, then the product, and scales the rows on the way).

#include "dequantize_int8_cuda.h"

#include "cuda_device.cuh"

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 4;

template <class T>
__global__ void __launch_bounds__(kThreads) dequantize_int8_kernel(
    const int8_t* __restrict__ q,
    const float* __restrict__ scb,
    float inv127,
    int64_t cols,
    int64_t n,
    T* __restrict__ out) {
  // Element k of this block's share is read by thread k % kThreads: a warp
  // reads 32 neighbouring bytes.
  const int64_t first =
      static_cast<int64_t>(blockIdx.x) * kThreads * kPerThread + threadIdx.x;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int64_t i = first + static_cast<int64_t>(k) * kThreads;
    if (i >= n) {
      break;
    }
    const float s = round_to<T>(scb[i / cols] * inv127);
    out[i] = from_float<T>(static_cast<float>(q[i]) * s);
  }
}

} // namespace

cudaError_t dequantize_int8(
    Dtype dtype,
    const int8_t* q,
    const float* scb,
    float inv127,
    int64_t rows,
    int64_t cols,
    void* out,
    cudaStream_t stream) {
  const int64_t n = rows * cols;
  const int64_t per_block = static_cast<int64_t>(kThreads) * kPerThread;
  const auto grid = static_cast<unsigned>((n + per_block - 1) / per_block);
  return launch_by_dtype(dtype, n, [&](auto t) {
    using T = decltype(t);
    dequantize_int8_kernel<T><<<grid, kThreads, 0, stream>>>(
        q, scb, inv127, cols, n, static_cast<T*>(out));
  });
}

} // namespace cuda
} // namespace kernels
} // namespace colossalai
