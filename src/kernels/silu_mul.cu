// silu(gate) * up and its gradients, elementwise: 16-byte loads and stores
// where every pointer is aligned and the length a multiple of the pack,
// else one element at a time. Each value is formed in float32 and rounded
// once.

#include "silu_mul_cuda.h"

#include "cuda_device.cuh"

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float sigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}

template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads) forward_kernel(
    const T* __restrict__ gate,
    const T* __restrict__ up,
    T* __restrict__ out,
    int64_t n) {
  if (kVec) {
    using P = Pack<T>;
    grid_loop(n / P::kSize, [&](int64_t p) {
      const P g = reinterpret_cast<const P*>(gate)[p];
      const P u = reinterpret_cast<const P*>(up)[p];
      P o;
#pragma unroll
      for (int k = 0; k < P::kSize; ++k) {
        const float x = to_float(g.v[k]);
        o.v[k] = from_float<T>(x * sigmoid(x) * to_float(u.v[k]));
      }
      reinterpret_cast<P*>(out)[p] = o;
    });
  } else {
    grid_loop(n, [&](int64_t i) {
      const float x = to_float(gate[i]);
      out[i] = from_float<T>(x * sigmoid(x) * to_float(up[i]));
    });
  }
}

template <class T>
__device__ __forceinline__ void grads_of(T dy, T g, T u, T& dg, T& du) {
  const float d = to_float(dy), x = to_float(g), s = sigmoid(x);
  dg = from_float<T>(d * to_float(u) * s * (1.0f + x * (1.0f - s)));
  du = from_float<T>(d * x * s);
}

template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads) backward_kernel(
    const T* __restrict__ dout,
    const T* __restrict__ gate,
    const T* __restrict__ up,
    T* __restrict__ d_gate,
    T* __restrict__ d_up,
    int64_t n) {
  if (kVec) {
    using P = Pack<T>;
    grid_loop(n / P::kSize, [&](int64_t p) {
      const P dy = reinterpret_cast<const P*>(dout)[p];
      const P g = reinterpret_cast<const P*>(gate)[p];
      const P u = reinterpret_cast<const P*>(up)[p];
      P dg, du;
#pragma unroll
      for (int k = 0; k < P::kSize; ++k) {
        grads_of(dy.v[k], g.v[k], u.v[k], dg.v[k], du.v[k]);
      }
      reinterpret_cast<P*>(d_gate)[p] = dg;
      reinterpret_cast<P*>(d_up)[p] = du;
    });
  } else {
    grid_loop(n, [&](int64_t i) {
      grads_of(dout[i], gate[i], up[i], d_gate[i], d_up[i]);
    });
  }
}

} // namespace

cudaError_t silu_mul_forward(
    Dtype dtype,
    const void* gate,
    const void* up,
    void* out,
    int64_t n,
    cudaStream_t stream) {
  if (n == 0) {
    return cudaSuccess;
  }
  return by_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    const auto* g = static_cast<const T*>(gate);
    const auto* u = static_cast<const T*>(up);
    auto* o = static_cast<T*>(out);
    constexpr int64_t pack = Pack<T>::kSize;
    if (aligned({gate, up, out}, n, pack)) {
      forward_kernel<T, true>
          <<<grid_for(n / pack, kThreads), kThreads, 0, stream>>>(g, u, o, n);
    } else {
      forward_kernel<T, false>
          <<<grid_for(n, kThreads), kThreads, 0, stream>>>(g, u, o, n);
    }
    return cudaGetLastError();
  });
}

cudaError_t silu_mul_backward(
    Dtype dtype,
    const void* dout,
    const void* gate,
    const void* up,
    void* d_gate,
    void* d_up,
    int64_t n,
    cudaStream_t stream) {
  if (n == 0) {
    return cudaSuccess;
  }
  return by_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    const auto* dy = static_cast<const T*>(dout);
    const auto* g = static_cast<const T*>(gate);
    const auto* u = static_cast<const T*>(up);
    auto* dg = static_cast<T*>(d_gate);
    auto* du = static_cast<T*>(d_up);
    constexpr int64_t pack = Pack<T>::kSize;
    if (aligned({dout, gate, up, d_gate, d_up}, n, pack)) {
      backward_kernel<T, true>
          <<<grid_for(n / pack, kThreads), kThreads, 0, stream>>>(
              dy, g, u, dg, du, n);
    } else {
      backward_kernel<T, false>
          <<<grid_for(n, kThreads), kThreads, 0, stream>>>(dy, g, u, dg, du, n);
    }
    return cudaGetLastError();
  });
}

} // namespace cuda
} // namespace kernels
} // namespace colossalai
