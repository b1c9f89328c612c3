// RMSNorm's CUDA kernels: the forward (one block per row, the row's
// statistic kept for the backward) and the backward (dx one block per row;
// dweight summed over rows by column tiles, then over row blocks). Each
// rounds where the reference's ATen ops round: the normalised value to the
// input's dtype before the weight, dy * weight and dy * normalised to it.
// With a residual the forward first forms the sum x + residual (rounded
// once, as ATen's add) and writes it out, and the backward adds the sum's
// own upstream gradient to dx (rounded as autograd's accumulation).

#include "rms_norm_cuda.h"

#include "cuda_device.cuh"

#include <type_traits>

namespace colossalai {
namespace kernels {
namespace cuda {

namespace {

constexpr int kRowThreads = 256;
constexpr int kTileCols = 32;
constexpr int kTileRows = 8;

// `residual` and `sum` null: the plain norm of x. Otherwise the norm of
// sum = round(x + residual), which the first pass writes and the second
// reads back (each thread its own columns).
template <class T, class R>
__global__ void __launch_bounds__(kRowThreads) forward_kernel(
    const T* __restrict__ x,
    const R* __restrict__ residual,
    const T* __restrict__ weight,
    T* __restrict__ sum,
    T* __restrict__ y,
    float* __restrict__ rstd,
    int64_t cols,
    float eps) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  const R* rr = residual == nullptr ? nullptr : residual + row * cols;
  T* sr = sum == nullptr ? nullptr : sum + row * cols;
  T* yr = y + row * cols;
  float squares = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float v = to_float(xr[c]);
    if (rr != nullptr) {
      const T h = from_float<T>(v + to_float(rr[c]));
      sr[c] = h;
      v = to_float(h);
    }
    squares += v * v;
  }
  squares = block_sum(squares, shared);
  const float r = rsqrtf(squares / static_cast<float>(cols) + eps);
  if (threadIdx.x == 0) {
    rstd[row] = r;
  }
  const T* in = sr == nullptr ? xr : sr;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float normed = round_to<T>(to_float(in[c]) * r);
    yr[c] = from_float<T>(to_float(weight[c]) * normed);
  }
}

// dx = r * dn - r^3 * x * sum(dn * x) / cols, dn = round(dy * weight),
// plus dsum (rounded, then added and rounded again) where it is not null.
template <class T>
__global__ void __launch_bounds__(kRowThreads) input_grad_kernel(
    const T* __restrict__ dy,
    const T* __restrict__ x,
    const T* __restrict__ weight,
    const float* __restrict__ rstd,
    const T* __restrict__ dsum,
    T* __restrict__ dx,
    int64_t cols) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const T* dyr = dy + row * cols;
  const T* xr = x + row * cols;
  const T* dsr = dsum == nullptr ? nullptr : dsum + row * cols;
  T* dxr = dx + row * cols;
  const float r = rstd[row];
  float dot = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    dot +=
        round_to<T>(to_float(dyr[c]) * to_float(weight[c])) * to_float(xr[c]);
  }
  dot = block_sum(dot, shared);
  const float k = r * r * r * dot / static_cast<float>(cols);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float dn = round_to<T>(to_float(dyr[c]) * to_float(weight[c]));
    const float d = r * dn - k * to_float(xr[c]);
    dxr[c] = dsr == nullptr ? from_float<T>(d)
                            : from_float<T>(round_to<T>(d) + to_float(dsr[c]));
  }
}

// partial[chunk][c] = sum over the chunk's rows of round(dy * normed): a
// block of kTileCols consecutive columns (coalesced along a warp) and
// kTileRows row lanes; gridDim.y chunks stride over the rows.
template <class T>
__global__ void weight_grad_kernel(
    const T* __restrict__ dy,
    const T* __restrict__ x,
    const float* __restrict__ rstd,
    float* __restrict__ partial,
    int64_t rows,
    int64_t cols) {
  __shared__ float part[kTileRows][kTileCols + 1];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kTileCols + threadIdx.x;
  float acc = 0.f;
  if (c < cols) {
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * kTileRows + threadIdx.y;
         r < rows;
         r += static_cast<int64_t>(gridDim.y) * kTileRows) {
      const int64_t i = r * cols + c;
      const float normed = round_to<T>(to_float(x[i]) * rstd[r]);
      acc += round_to<T>(to_float(dy[i]) * normed);
    }
  }
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float sum = 0.f;
    for (int i = 0; i < kTileRows; ++i) {
      sum += part[i][threadIdx.x];
    }
    partial[static_cast<int64_t>(blockIdx.y) * cols + c] = sum;
  }
}

template <class T>
__global__ void sum_chunks_kernel(
    const float* __restrict__ partial,
    int64_t chunks,
    T* __restrict__ dweight,
    int64_t cols) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) {
    return;
  }
  float sum = 0.f;
  for (int64_t i = 0; i < chunks; ++i) {
    sum += partial[i * cols + c];
  }
  dweight[c] = from_float<T>(sum);
}

template <class T, class R>
cudaError_t forward(
    const void* x,
    const void* residual,
    const void* weight,
    void* sum,
    void* y,
    float* rstd,
    int64_t rows,
    int64_t cols,
    float eps,
    cudaStream_t stream) {
  forward_kernel<T, R><<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(
      static_cast<const T*>(x),
      static_cast<const R*>(residual),
      static_cast<const T*>(weight),
      static_cast<T*>(sum),
      static_cast<T*>(y),
      rstd,
      cols,
      eps);
  return cudaGetLastError();
}

template <class T>
cudaError_t backward(
    const void* dy,
    const void* x,
    const void* weight,
    const float* rstd,
    const void* dsum,
    void* dx,
    float* partial,
    void* dweight,
    int64_t rows,
    int64_t cols,
    cudaStream_t stream) {
  input_grad_kernel<T><<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(
      static_cast<const T*>(dy),
      static_cast<const T*>(x),
      static_cast<const T*>(weight),
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
  weight_grad_kernel<T><<<tiles, dim3(kTileCols, kTileRows), 0, stream>>>(
      static_cast<const T*>(dy),
      static_cast<const T*>(x),
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
          partial, chunks, static_cast<T*>(dweight), cols);
  return cudaGetLastError();
}

} // namespace

cudaError_t rms_norm_forward(
    Dtype dtype,
    const void* x,
    const void* weight,
    void* y,
    float* rstd,
    int64_t rows,
    int64_t cols,
    float eps,
    cudaStream_t stream) {
  return by_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    return forward<T, T>(
        x, nullptr, weight, nullptr, y, rstd, rows, cols, eps, stream);
  });
}

cudaError_t add_rms_norm_forward(
    Dtype dtype,
    Dtype residual_dtype,
    const void* x,
    const void* residual,
    const void* weight,
    void* sum,
    void* y,
    float* rstd,
    int64_t rows,
    int64_t cols,
    float eps,
    cudaStream_t stream) {
  return by_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    return by_dtype(residual_dtype, [&](auto r) {
      using R = decltype(r);
      // The sum keeps x's dtype: a residual of it, or a narrower one
      // added to a float32 stream (bf16 / fp16 outputs under autocast).
      if constexpr (std::is_same_v<T, R> || std::is_same_v<T, float>) {
        return forward<T, R>(
            x, residual, weight, sum, y, rstd, rows, cols, eps, stream);
      } else {
        return cudaErrorInvalidValue;
      }
    });
  });
}

cudaError_t rms_norm_backward(
    Dtype dtype,
    const void* dy,
    const void* x,
    const void* weight,
    const float* rstd,
    const void* dsum,
    void* dx,
    float* partial,
    void* dweight,
    int64_t rows,
    int64_t cols,
    cudaStream_t stream) {
  return by_dtype(dtype, [&](auto t) {
    return backward<decltype(t)>(
        dy, x, weight, rstd, dsum, dx, partial, dweight, rows, cols, stream);
  });
}

} // namespace cuda
} // namespace kernels
} // namespace colossalai
