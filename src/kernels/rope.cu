// Rotary position embedding, one thread per pair (i, i + D/2) of one head
// of one token: each value formed in float32 and rounded once. The inverse
// rotation is the backward: for out_i = x_i c_i - x_j s_i and
// out_j = x_j c_j + x_i s_j (j = i + D/2), dx_i = dy_i c_i + dy_j s_j and
// dx_j = dy_j c_j - dy_i s_i.

#include "rope_cuda.h"

#include "cuda_device.cuh"

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

namespace {

constexpr int kThreads = 256;

template <class T, bool kInverse>
__global__ void __launch_bounds__(kThreads) rope_kernel(
    const T* __restrict__ x,
    const T* __restrict__ cos,
    const T* __restrict__ sin,
    T* __restrict__ out,
    int64_t pairs,
    int64_t seq,
    int64_t heads,
    int64_t dim,
    bool tables_per_batch) {
  const int64_t half = dim / 2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       p < pairs;
       p += stride) {
    const int64_t i = p % half;
    const int64_t row = p / half; // (b, t, h) flattened
    const int64_t bt = row / heads;
    const int64_t table = (tables_per_batch ? bt : bt % seq) * dim;
    const int64_t at = row * dim + i;
    const float a = to_float(x[at]), b = to_float(x[at + half]);
    const float ci = to_float(cos[table + i]),
                cj = to_float(cos[table + i + half]);
    const float si = to_float(sin[table + i]),
                sj = to_float(sin[table + i + half]);
    if (kInverse) {
      out[at] = from_float<T>(a * ci + b * sj);
      out[at + half] = from_float<T>(b * cj - a * si);
    } else {
      out[at] = from_float<T>(a * ci - b * si);
      out[at + half] = from_float<T>(b * cj + a * sj);
    }
  }
}

} // namespace

cudaError_t rope(
    Dtype dtype,
    const void* x,
    const void* cos,
    const void* sin,
    void* out,
    int64_t batch,
    int64_t seq,
    int64_t heads,
    int64_t dim,
    bool tables_per_batch,
    bool inverse,
    cudaStream_t stream) {
  const int64_t pairs = batch * seq * heads * (dim / 2);
  if (pairs == 0) {
    return cudaSuccess;
  }
  const int64_t blocks = (pairs + kThreads - 1) / kThreads;
  const auto grid = static_cast<unsigned>(blocks < 65536 ? blocks : 65536);
  return by_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    const auto* xp = static_cast<const T*>(x);
    const auto* cp = static_cast<const T*>(cos);
    const auto* sp = static_cast<const T*>(sin);
    auto* op = static_cast<T*>(out);
    if (inverse) {
      rope_kernel<T, true><<<grid, kThreads, 0, stream>>>(
          xp, cp, sp, op, pairs, seq, heads, dim, tables_per_batch);
    } else {
      rope_kernel<T, false><<<grid, kThreads, 0, stream>>>(
          xp, cp, sp, op, pairs, seq, heads, dim, tables_per_batch);
    }
    return cudaGetLastError();
  });
}

} // namespace cuda
} // namespace kernels
} // namespace colossalai
