// add_layer_norm's CUDA kernels: the forward (one block per row: the sum
// x + residual written, then its mean and variance in two passes over the
// row, then the normalised row) and the backward (dx one block per row with
// the sum's own gradient added; dweight and dbias by column tiles, then over
// row blocks). Every intermediate is float32 and each output is rounded
// once, as ATen's LayerNorm kernels do; the sum and the accumulation of dx
// with the sum's gradient round as ATen's add and autograd's accumulation.

#include "layer_norm_cuda.h"

#include "cuda_device.cuh"

#include <type_traits>

namespace colossalai {
namespace kernels {
namespace cuda {

namespace {

constexpr int kRowThreads = 256;
constexpr int kTileCols = 32;
constexpr int kTileRows = 8;

template <class T, class R>
__global__ void __launch_bounds__(kRowThreads) forward_kernel(
    const T* __restrict__ x,
    const R* __restrict__ residual,
    const T* __restrict__ weight,
    const T* __restrict__ bias,
    T* __restrict__ sum,
    T* __restrict__ y,
    float* __restrict__ mean_out,
    float* __restrict__ rstd_out,
    int64_t cols,
    float eps) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  const R* rr = residual + row * cols;
  T* sr = sum + row * cols; // each thread reads back only what it wrote
  T* yr = y + row * cols;
  float total = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const T h = from_float<T>(to_float(xr[c]) + to_float(rr[c]));
    sr[c] = h;
    total += to_float(h);
  }
  const float mean = block_sum(total, shared) / static_cast<float>(cols);
  float squares = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float d = to_float(sr[c]) - mean;
    squares += d * d;
  }
  const float var = block_sum(squares, shared) / static_cast<float>(cols);
  const float r = rsqrtf(var + eps);
  if (threadIdx.x == 0) {
    mean_out[row] = mean;
    rstd_out[row] = r;
  }
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float xhat = (to_float(sr[c]) - mean) * r;
    yr[c] = from_float<T>(xhat * to_float(weight[c]) + to_float(bias[c]));
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * weight.
template <class T>
__global__ void __launch_bounds__(kRowThreads) input_grad_kernel(
    const T* __restrict__ dy,
    const T* __restrict__ sum,
    const T* __restrict__ weight,
    const float* __restrict__ mean,
    const float* __restrict__ rstd,
    const T* __restrict__ dsum,
    T* __restrict__ dx,
    int64_t cols) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const T* dyr = dy + row * cols;
  const T* hr = sum + row * cols;
  const T* dsr = dsum == nullptr ? nullptr : dsum + row * cols;
  T* dxr = dx + row * cols;
  const float mu = mean[row];
  const float r = rstd[row];
  float g_sum = 0.f, gx_sum = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = to_float(dyr[c]) * to_float(weight[c]);
    g_sum += g;
    gx_sum += g * (to_float(hr[c]) - mu) * r;
  }
  const float n = static_cast<float>(cols);
  const float g_mean = block_sum(g_sum, shared) / n;
  const float gx_mean = block_sum(gx_sum, shared) / n;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = to_float(dyr[c]) * to_float(weight[c]);
    const float xhat = (to_float(hr[c]) - mu) * r;
    const float d = r * (g - g_mean - xhat * gx_mean);
    dxr[c] = dsr == nullptr ? from_float<T>(d)
                            : from_float<T>(round_to<T>(d) + to_float(dsr[c]));
  }
}

// partial[0][chunk][c] = sum over the chunk's rows of dy * xhat, and
// partial[1][chunk][c] of dy: a block of kTileCols consecutive columns
// (coalesced along a warp) and kTileRows row lanes; gridDim.y chunks stride
// over the rows.
template <class T>
__global__ void param_grad_kernel(
    const T* __restrict__ dy,
    const T* __restrict__ sum,
    const float* __restrict__ mean,
    const float* __restrict__ rstd,
    float* __restrict__ partial,
    int64_t rows,
    int64_t cols) {
  __shared__ float part_w[kTileRows][kTileCols + 1];
  __shared__ float part_b[kTileRows][kTileCols + 1];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kTileCols + threadIdx.x;
  float acc_w = 0.f, acc_b = 0.f;
  if (c < cols) {
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * kTileRows + threadIdx.y;
         r < rows;
         r += static_cast<int64_t>(gridDim.y) * kTileRows) {
      const int64_t i = r * cols + c;
      const float d = to_float(dy[i]);
      acc_w += d * (to_float(sum[i]) - mean[r]) * rstd[r];
      acc_b += d;
    }
  }
  part_w[threadIdx.y][threadIdx.x] = acc_w;
  part_b[threadIdx.y][threadIdx.x] = acc_b;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float sw = 0.f, sb = 0.f;
    for (int i = 0; i < kTileRows; ++i) {
      sw += part_w[i][threadIdx.x];
      sb += part_b[i][threadIdx.x];
    }
    const int64_t chunks = gridDim.y;
    partial[static_cast<int64_t>(blockIdx.y) * cols + c] = sw;
    partial[(chunks + blockIdx.y) * cols + c] = sb;
  }
}

template <class T>
__global__ void sum_chunks_kernel(
    const float* __restrict__ partial,
    int64_t chunks,
    T* __restrict__ dweight,
    T* __restrict__ dbias,
    int64_t cols) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) {
    return;
  }
  float sw = 0.f, sb = 0.f;
  for (int64_t i = 0; i < chunks; ++i) {
    sw += partial[i * cols + c];
    sb += partial[(chunks + i) * cols + c];
  }
  dweight[c] = from_float<T>(sw);
  dbias[c] = from_float<T>(sb);
}

} // namespace

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
    cudaStream_t stream) {
  if (rows == 0) {
    return cudaSuccess;
  }
  return by_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    return by_dtype(residual_dtype, [&](auto rt) {
      using R = decltype(rt);
      // The sum keeps x's dtype: a residual of it, or a narrower one added
      // to a float32 stream (bf16 / fp16 outputs under autocast).
      if constexpr (std::is_same_v<T, R> || std::is_same_v<T, float>) {
        forward_kernel<T, R>
            <<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(
                static_cast<const T*>(x),
                static_cast<const R*>(residual),
                static_cast<const T*>(weight),
                static_cast<const T*>(bias),
                static_cast<T*>(sum),
                static_cast<T*>(y),
                mean,
                rstd,
                cols,
                eps);
        return cudaGetLastError();
      } else {
        return cudaErrorInvalidValue;
      }
    });
  });
}

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
    cudaStream_t stream) {
  if (rows == 0) {
    return cudaSuccess;
  }
  return by_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    input_grad_kernel<T>
        <<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(
            static_cast<const T*>(dy),
            static_cast<const T*>(sum),
            static_cast<const T*>(weight),
            mean,
            rstd,
            static_cast<const T*>(dsum),
            static_cast<T*>(dx),
            cols);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
      return e;
    }
    const int64_t chunks = norm_param_chunks(rows);
    const dim3 tiles(
        static_cast<unsigned>((cols + kTileCols - 1) / kTileCols),
        static_cast<unsigned>(chunks));
    param_grad_kernel<T><<<tiles, dim3(kTileCols, kTileRows), 0, stream>>>(
        static_cast<const T*>(dy),
        static_cast<const T*>(sum),
        mean,
        rstd,
        partial,
        rows,
        cols);
    e = cudaGetLastError();
    if (e != cudaSuccess) {
      return e;
    }
    sum_chunks_kernel<T>
        <<<static_cast<unsigned>((cols + 255) / 256), 256, 0, stream>>>(
            partial,
            chunks,
            static_cast<T*>(dweight),
            static_cast<T*>(dbias),
            cols);
    return cudaGetLastError();
  });
}

} // namespace cuda
} // namespace kernels
} // namespace colossalai
