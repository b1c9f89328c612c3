#pragma once

// Device helpers the kernels' `.cu` files share: conversions between the
// element types and float32, 16-byte packs, and the one switch over dtypes
// for launchers.

#include "cuda_types.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <initializer_list>

namespace colossalai {
namespace kernels {
namespace cuda {

__device__ __forceinline__ float to_float(float v) {
  return v;
}
__device__ __forceinline__ float to_float(__half v) {
  return __half2float(v);
}
__device__ __forceinline__ float to_float(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// 16 bytes of T: one vector load or store.
template <class T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

// What an ATen op whose result is T gives, read back as float.
template <class T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

// The sum of `v` over the block, in every thread; blockDim.x a multiple of
// 32. `shared` holds a float per warp; it is free again on return.
__device__ __forceinline__ float block_sum(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (lane == 0) {
    shared[warp] = v;
  }
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / 32) ? shared[lane] : 0.f;
  for (int o = 16; o > 0; o >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  __syncthreads(); // `shared` is free for the next sum
  return v;
}

// An elementwise kernel's loop: f(i) for every i of [0, n) (elements, or
// packs of them), spread over the grid.
template <class F>
__device__ __forceinline__ void grid_loop(int64_t n, F&& f) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n;
       i += stride) {
    f(i);
  }
}

// Whether an elementwise kernel may load and store 16 bytes at a time:
// every pointer 16-byte aligned and `n` a multiple of the pack.
inline bool aligned(
    std::initializer_list<const void*> ps,
    int64_t n,
    int64_t pack) {
  for (const void* p : ps) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
      return false;
    }
  }
  return n % pack == 0;
}

// An elementwise kernel's blocks of `threads` for `work` items: enough to
// fill the device several times over; grid_loop covers the rest.
inline unsigned grid_for(int64_t work, int threads) {
  const int64_t blocks = (work + threads - 1) / threads;
  return static_cast<unsigned>(
      blocks < 65536 ? (blocks < 1 ? 1 : blocks) : 65536);
}

// Calls `f` with a value of the element type `dtype` names (its type is
// what `f` needs): the one switch over dtypes, for every launcher.
template <class F>
cudaError_t by_dtype(Dtype dtype, F&& f) {
  switch (dtype) {
    case Dtype::kFloat:
      return f(float());
    case Dtype::kHalf:
      return f(__half());
    case Dtype::kBFloat16:
      return f(__nv_bfloat16());
  }
  return cudaErrorInvalidValue;
}

// A launcher's common shape: nothing to do for no `work`, else `launch`
// called with the element type's value (as by_dtype) and the launch's
// error returned.
template <class F>
cudaError_t launch_by_dtype(Dtype dtype, int64_t work, F&& launch) {
  if (work == 0) {
    return cudaSuccess;
  }
  return by_dtype(dtype, [&](auto t) {
    launch(t);
    return cudaGetLastError();
  });
}

} // namespace cuda
} // namespace kernels
} // namespace colossalai
