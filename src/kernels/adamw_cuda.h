#pragma once

// adamw_step_'s CUDA launcher (adamw.cu), over plain pointers: nvcc's
// translation unit includes no ATen (NOTE [Kernels]).

#include "cuda_types.h"

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace cuda {

/// One tensor of a multi-tensor AdamW step, with its bias-corrected scalars.
struct AdamWTensor {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* working; // null: no copy
  int64_t numel;
  float decay;     // 1 - lr * weight_decay
  float step_size; // lr / (1 - beta1^step)
  float bias_correction2_sqrt;
  float pad_;
};

/// Elements one block updates: a tensor is cut into chunks of this size.
constexpr int64_t kAdamWChunk = 65536;

/// Which tensor and which of its chunks a block updates.
struct AdamWBlock {
  int32_t tensor;
  int32_t chunk;
};

/// Updates `blocks` chunks (one block each) of the tensors `tensors` points
/// to; both arrays in device memory. Every grad has `grad_dtype`, every
/// working copy `working_dtype`. 1 - beta1 and 1 - beta2 come taken in
/// double and rounded once, as torch.optim.AdamW passes them to ATen (1 -
/// 0.999f in float is 1.3e-5 away from float(1 - 0.999)). `found_inf`:
/// null, or a device float that, where nonzero, makes every block return
/// without writing (a loss scaler's overflow verdict).
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
    cudaStream_t stream);

} // namespace cuda
} // namespace kernels
} // namespace colossalai
