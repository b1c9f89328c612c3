#pragma once

// The fused loss's check of its targets against the vocabulary, without
// making the host wait for a GPU (NOTE [Deferred target check] in
// target_check.cpp).

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>

namespace colossalai {
namespace kernels {
namespace detail {

/// Refuses a target outside [0, vocab) that is not ignore_index, naming
/// `op`: at once where `target` is on the CPU; on a GPU at the next call
/// (this one reports the earlier calls' checks, waiting for the device to
/// have passed them). Inside a CUDA graph's capture on `device` (where the
/// op computes) or the target's, it checks nothing on the GPU.
void check_targets(
    const char* op,
    const at::Tensor& target,
    const at::Device& device,
    int64_t vocab,
    int64_t ignore_index);

} // namespace detail
} // namespace kernels
} // namespace colossalai
