// Cross-entropy's loss and logits gradient in one kernel, in place (the
// classifier of llm.c and Liger-Kernel): one block per row reads the row
// twice, for its log-sum-exp (an online max and sum, one exp per element)
// and for the gradient it writes over the logits, so a row moves 3 x its
// bytes instead of the float32 copies and passes of the ATen composition.
// Rows sit `ld` elements apart (ld >= cols: the fused loss pads them to 16
// bytes). Rows of a vocabulary such as GPT-2's 50257 laid end to end are not
// 16-byte aligned: each pass reads the row's unaligned head and tail element
// by element and the rest 16 bytes at a time. A vocabulary-parallel head's
// shard takes two kernels, its rows' statistics and then the gradient, with
// the group's reductions of the statistics between them.

#include "cross_entropy_cuda.h"

#include "cuda_device.cuh"

#include <cmath>
#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

namespace {

constexpr int kThreads = 512;

// Calls f(j, x) for every element j of the row, x a reference to it; with
// kWrite the values f leaves are stored back.
template <bool kWrite, class T, class F>
__device__ __forceinline__ void each(T* row, int64_t cols, F&& f) {
  constexpr int kVec = Pack<T>::kSize;
  const auto misaligned = reinterpret_cast<uintptr_t>(row) % 16;
  int64_t head = misaligned == 0 ? 0 : static_cast<int64_t>((16 - misaligned) / sizeof(T));
  head = head < cols ? head : cols;
  for (int64_t j = threadIdx.x; j < head; j += blockDim.x) {
    f(j, row[j]);
  }
  const int64_t packs = (cols - head) / kVec;
  auto* p = reinterpret_cast<Pack<T>*>(row + head);
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    Pack<T> v = p[i];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      f(head + i * kVec + k, v.v[k]);
    }
    if (kWrite) {
      p[i] = v;
    }
  }
  for (int64_t j = head + packs * kVec + threadIdx.x; j < cols; j += blockDim.x) {
    f(j, row[j]);
  }
}

// A running maximum and the sum of exp(x - max) over what it has seen.
struct MaxSum {
  float m;
  float s;
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  if (a.m == -INFINITY) {
    return b;
  }
  if (b.m == -INFINITY) {
    return a;
  }
  const float m = fmaxf(a.m, b.m);
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

// The merge over the block, in every thread.
__device__ MaxSum block_merge(MaxSum v, MaxSum* shared) {
  for (int o = 16; o > 0; o >>= 1) {
    v = merge(v, {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
  }
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (lane == 0) {
    shared[warp] = v;
  }
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / 32) ? shared[lane] : MaxSum{-INFINITY, 0.f};
  for (int o = 16; o > 0; o >>= 1) {
    v = merge(v, {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
  }
  return v;
}

// The online maximum and sum of exponentials of a row's first `cols`
// elements, merged over the block (in every thread).
template <class T>
__device__ __forceinline__ MaxSum row_max_sum(const T* row, int64_t cols, MaxSum* shared) {
  MaxSum acc{-INFINITY, 0.f};
  each<false>(const_cast<T*>(row), cols, [&](int64_t, const T& v) {
    const float x = to_float(v);
    if (x > acc.m) {
      acc.s = acc.s * expf(acc.m - x) + 1.f; // 0 * 0 while acc.m is -inf
      acc.m = x;
    } else if (x != -INFINITY) {
      acc.s += expf(x - acc.m); // NaN stays NaN
    }
  });
  return block_merge(acc, shared);
}

template <class T>
__global__ void __launch_bounds__(kThreads) grad_kernel(
    T* __restrict__ logits,
    const int64_t* __restrict__ target,
    int64_t ignore_index,
    const float* __restrict__ scale,
    float* __restrict__ row_loss,
    int64_t cols,
    int64_t ld) {
  __shared__ MaxSum shared[32];
  const int64_t r = blockIdx.x;
  T* row = logits + r * ld;
  const MaxSum acc = row_max_sum(row, cols, shared);
  const float lse = acc.m + logf(acc.s);
  const int64_t t = target[r];
  const bool ignored = t == ignore_index;
  const bool in_range = t >= 0 && t < cols;
  // Every thread has read the row (block_merge synchronised) before any
  // writes it.
  const float picked = in_range ? to_float(row[t]) : NAN;
  __syncthreads();
  if (threadIdx.x == 0) {
    row_loss[r] = ignored ? 0.f : lse - picked;
  }
  // As the ATen path's valid * scale: 0 * inf is NaN (every target ignored).
  const float k = (ignored ? 0.f : 1.f) * (in_range || ignored ? scale[0] : NAN);
  each<true>(row, cols, [&](int64_t j, T& v) {
    const float p = expf(to_float(v) - lse) - (j == t ? 1.f : 0.f);
    v = from_float<T>(p * k);
  });
}

// A vocabulary shard's statistics of each row: over its first `real`
// columns (the rest pad the head), the maximum, the sum of exponentials
// relative to it, and the target's logit where this shard holds it (0
// elsewhere).
template <class T>
__global__ void __launch_bounds__(kThreads) shard_stats_kernel(
    const T* __restrict__ logits,
    const int64_t* __restrict__ target,
    int64_t ignore_index,
    int64_t start,
    int64_t real,
    float* __restrict__ row_max,
    float* __restrict__ row_sum,
    float* __restrict__ picked,
    int64_t ld) {
  __shared__ MaxSum shared[32];
  const int64_t r = blockIdx.x;
  const T* row = logits + r * ld;
  const MaxSum acc = row_max_sum(row, real, shared);
  if (threadIdx.x == 0) {
    const int64_t t = target[r];
    const bool mine = t != ignore_index && t >= start && t < start + real;
    row_max[r] = acc.m;
    row_sum[r] = acc.s;
    picked[r] = mine ? to_float(row[t - start]) : 0.f;
  }
}

// x_j := (exp(x_j - lse[r]) - [j is the target here]) * k[r] for j < real,
// 0 for the padding columns.
template <class T>
__global__ void __launch_bounds__(kThreads) shard_grad_kernel(
    T* __restrict__ logits,
    const int64_t* __restrict__ target,
    int64_t ignore_index,
    int64_t start,
    int64_t real,
    const float* __restrict__ lse,
    const float* __restrict__ k,
    int64_t cols,
    int64_t ld) {
  const int64_t r = blockIdx.x;
  T* row = logits + r * ld;
  const int64_t t = target[r];
  const int64_t here = t != ignore_index && t >= start && t < start + real ? t - start : -1;
  const float l = lse[r], kr = k[r];
  each<true>(row, cols, [&](int64_t j, T& v) {
    const float p = j < real ? expf(to_float(v) - l) - (j == here ? 1.f : 0.f) : 0.f;
    v = from_float<T>(p * kr);
  });
}

} // namespace

cudaError_t cross_entropy_shard_stats(
    Dtype dtype,
    const void* logits,
    const int64_t* target,
    int64_t ignore_index,
    int64_t start,
    int64_t real,
    float* row_max,
    float* row_sum,
    float* picked,
    int64_t rows,
    int64_t ld,
    cudaStream_t stream) {
  return launch_by_dtype(dtype, rows, [&](auto t) {
    using T = decltype(t);
    shard_stats_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        static_cast<const T*>(logits), target, ignore_index, start, real, row_max, row_sum, picked, ld);
  });
}

cudaError_t cross_entropy_shard_grad(
    Dtype dtype,
    void* logits,
    const int64_t* target,
    int64_t ignore_index,
    int64_t start,
    int64_t real,
    const float* lse,
    const float* k,
    int64_t rows,
    int64_t cols,
    int64_t ld,
    cudaStream_t stream) {
  return launch_by_dtype(dtype, rows, [&](auto t) {
    using T = decltype(t);
    shard_grad_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        static_cast<T*>(logits), target, ignore_index, start, real, lse, k, cols, ld);
  });
}

cudaError_t cross_entropy_grad(
    Dtype dtype,
    void* logits,
    const int64_t* target,
    int64_t ignore_index,
    const float* scale,
    float* row_loss,
    int64_t rows,
    int64_t cols,
    int64_t ld,
    cudaStream_t stream) {
  return launch_by_dtype(dtype, rows, [&](auto t) {
    using T = decltype(t);
    grad_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        static_cast<T*>(logits), target, ignore_index, scale, row_loss, cols, ld);
  });
}

} // namespace cuda
} // namespace kernels
} // namespace colossalai
