// AdamW over float32 masters with the working-dtype copy written in the same
// pass (adamw_step_): one launch for every tensor of a step. Each block
// updates one chunk of one tensor, as a table built on the host says, so
// tensors of any size share the launch and no block idles.

#include "adamw_cuda.h"

#include "cuda_device.cuh"

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4; // independent elements in flight per thread

// torch.optim.AdamW's single-tensor update, in its order of operations:
// param *= decay; exp_avg.lerp_(grad, 1 - beta1); exp_avg_sq * beta2 +
// (1 - beta2) * grad^2; param.addcdiv_(exp_avg, sqrt(exp_avg_sq) /
// bias_correction2_sqrt + eps, -step_size).
template <class G, class W>
__global__ void __launch_bounds__(kThreads) adamw_kernel(
    const AdamWTensor* __restrict__ tensors,
    const AdamWBlock* __restrict__ blocks,
    float w1,
    float beta2,
    float w2,
    float eps,
    const float* __restrict__ found_inf) {
  // An overflowing step (uniform over the launch) writes nothing.
  if (found_inf != nullptr && *found_inf != 0.0f) {
    return;
  }
  const AdamWBlock b = blocks[blockIdx.x];
  const AdamWTensor t = tensors[b.tensor];
  const int64_t begin = static_cast<int64_t>(b.chunk) * kAdamWChunk;
  const int64_t len =
      t.numel - begin < kAdamWChunk ? t.numel - begin : kAdamWChunk;
  float* __restrict__ p = t.param + begin;
  const G* __restrict__ g = static_cast<const G*>(t.grad) + begin;
  float* __restrict__ m = t.exp_avg + begin;
  float* __restrict__ v = t.exp_avg_sq + begin;
  // Null: this tensor has no copy (uniform over the block).
  W* __restrict__ w =
      t.working == nullptr ? nullptr : static_cast<W*>(t.working) + begin;
  for (int64_t base = 0; base < len; base += kThreads * kUnroll) {
    float pr[kUnroll], gr[kUnroll], mr[kUnroll], vr[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t i = base + k * kThreads + threadIdx.x;
      if (i < len) {
        pr[k] = p[i];
        gr[k] = to_float(g[i]);
        mr[k] = m[i];
        vr[k] = v[i];
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t i = base + k * kThreads + threadIdx.x;
      if (i < len) {
        const float pk = pr[k] * t.decay;
        const float mk = mr[k] + w1 * (gr[k] - mr[k]);
        const float vk = vr[k] * beta2 + w2 * gr[k] * gr[k];
        const float denom = sqrtf(vk) / t.bias_correction2_sqrt + eps;
        const float out = pk + (-t.step_size) * (mk / denom);
        p[i] = out;
        m[i] = mk;
        v[i] = vk;
        if (w != nullptr) {
          w[i] = from_float<W>(out);
        }
      }
    }
  }
}

} // namespace

cudaError_t adamw_step(
    Dtype grad_dtype,
    Dtype working_dtype,
    const AdamWTensor* tensors,
    const AdamWBlock* blocks,
    int64_t num_blocks,
    float one_minus_beta1,
    float beta2,
    float one_minus_beta2,
    float eps,
    const float* found_inf,
    cudaStream_t stream) {
  if (num_blocks == 0) {
    return cudaSuccess;
  }
  return by_dtype(grad_dtype, [&](auto g) {
    using G = decltype(g);
    return by_dtype(working_dtype, [&](auto w) {
      using W = decltype(w);
      adamw_kernel<G, W>
          <<<static_cast<unsigned>(num_blocks), kThreads, 0, stream>>>(
              tensors,
              blocks,
              one_minus_beta1,
              beta2,
              one_minus_beta2,
              eps,
              found_inf);
      return cudaGetLastError();
    });
  });
}

} // namespace cuda
} // namespace kernels
} // namespace colossalai
