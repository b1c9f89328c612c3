#pragma once

// The fused CPU Adam update (internal): one pass over param, grad, exp_avg and
// exp_avg_sq (and an optional low-precision copy of the param), vectorized for
// AVX-512 / AVX2 with a scalar fallback. Every path performs the same IEEE
// operations in the same order without fused multiply-adds, so all of them
// give bit-identical results, independent of how the range is split.

#include <colossalai/nn/optimizer/hybrid_adam.h>

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace colossalai {
namespace nn {
namespace optimizer {
namespace detail {

/// Per-parameter constants, already rounded to fp32 the way LibTorch's
/// Adam/AdamW round their double hyperparameters when applying them.
struct AdamScalars {
  float beta1 = 0.9f;
  float one_minus_beta1 = 0.1f;
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float eps = 1e-8f;
  /// sqrt(1 - beta2^t), or 1 without bias correction.
  float sqrt_bias_correction2 = 1.f;
  /// -lr / (1 - beta1^t), or -lr without bias correction.
  float neg_step_size = -1e-3f;
  /// 1 - lr * weight_decay in AdamW mode, else 1.
  float decay = 1.f;
  /// weight_decay in Adam (L2) mode, else 0.
  float l2 = 0.f;
};

struct AdamBuffers {
  float* param = nullptr;
  const void* grad = nullptr;
  at::ScalarType grad_dtype = at::kFloat; // kFloat, kBFloat16 or kHalf
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  void* copy = nullptr;                      // nullptr: no copy
  at::ScalarType copy_dtype = at::kBFloat16; // kFloat, kBFloat16 or kHalf
  int64_t numel = 0;
};

/// Updates elements [begin, end) with `isa`, which the CPU must support.
void adam_update_range(
    const AdamBuffers& b,
    const AdamScalars& s,
    int64_t begin,
    int64_t end,
    CpuAdamIsa isa);

/// Updates all elements with `cpu_adam_isa()`, split over at::parallel_for.
void adam_update(const AdamBuffers& b, const AdamScalars& s);

} // namespace detail
} // namespace optimizer
} // namespace nn
} // namespace colossalai
