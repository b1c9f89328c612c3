// use_fp8's scale-and-cast in one pass: each element read once in its
// dtype, multiplied by the tensor's scale in float32 and written as one
// FP8 byte (ATen's composition reads and writes a float32 copy between
// the two). 16-byte loads where the input is aligned and the length a
// multiple of the pack, else one element at a time.

#include "fp8_cast_cuda.h"

#include "cuda_device.cuh"

#include <cuda_fp8.h>

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

namespace {

constexpr int kThreads = 256;

template <bool kE4m3>
__device__ __forceinline__ uint8_t to_fp8(float v) {
  // Round to nearest even; no saturation, as ATen's cast (the scale keeps
  // every finite value in range).
  return static_cast<uint8_t>(
      __nv_cvt_float_to_fp8(v, __NV_NOSAT, kE4m3 ? __NV_E4M3 : __NV_E5M2));
}

template <class T, bool kE4m3, bool kVec>
__global__ void __launch_bounds__(kThreads) scale_cast_kernel(
    const T* __restrict__ x,
    const float* __restrict__ amax,
    uint8_t* __restrict__ out,
    int64_t n) {
  // IEEE division, as ATen's largest / amax on float32.
  const float scale = (kE4m3 ? 448.0f : 57344.0f) / *amax;
  if (kVec) {
    using P = Pack<T>;
    grid_loop(n / P::kSize, [&](int64_t p) {
      const P v = reinterpret_cast<const P*>(x)[p];
#pragma unroll
      for (int j = 0; j < P::kSize; ++j) {
        out[p * P::kSize + j] = to_fp8<kE4m3>(to_float(v.v[j]) * scale);
      }
    });
  } else {
    grid_loop(
        n, [&](int64_t i) { out[i] = to_fp8<kE4m3>(to_float(x[i]) * scale); });
  }
}

template <class T, bool kE4m3>
void launch(
    const T* x,
    const float* amax,
    uint8_t* out,
    int64_t n,
    cudaStream_t stream) {
  constexpr int64_t pack = Pack<T>::kSize;
  if (aligned({x}, n, pack)) {
    scale_cast_kernel<T, kE4m3, true>
        <<<grid_for(n / pack, kThreads), kThreads, 0, stream>>>(
            x, amax, out, n);
  } else {
    scale_cast_kernel<T, kE4m3, false>
        <<<grid_for(n, kThreads), kThreads, 0, stream>>>(x, amax, out, n);
  }
}

} // namespace

cudaError_t scale_cast_fp8(
    Dtype dtype,
    const void* x,
    const float* amax,
    uint8_t* out,
    int64_t n,
    bool e4m3,
    cudaStream_t stream) {
  return launch_by_dtype(dtype, n, [&](auto t) {
    using T = decltype(t);
    const auto* xt = static_cast<const T*>(x);
    if (e4m3) {
      launch<T, true>(xt, amax, out, n, stream);
    } else {
      launch<T, false>(xt, amax, out, n, stream);
    }
  });
}

} // namespace cuda
} // namespace kernels
} // namespace colossalai
