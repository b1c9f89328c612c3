#pragma once

// Sequence-parallel column layers whose backward reduce-scatters the input
// gradient while it computes the weight gradients (split_gather with
// enable_sequence_overlap; NOTE [Sequence overlap]).

#include <colossalai/distributed/process_group.h>

#include <ATen/core/Tensor.h>

#include <vector>

namespace colossalai {
namespace shardformer {
namespace layer {
namespace detail {

/// Column layers that read one input: this rank's sequence chunk `x`
/// [.., T / n (seq_dim), in] all-gathered along `seq_dim` once, then
/// y_i = x W_i^T + b_i for each weight `w_out_in[i]` [out_i, in] and bias
/// `biases[i]` (undefined: none). Backward: the input gradient, summed over
/// the layers, is reduce-scattered while the weight and bias gradients are
/// computed. Under autocast the operands are cast first, so the gather
/// carries 16-bit values.
std::vector<at::Tensor> gather_linears_overlapped(
    const at::Tensor& x,
    const std::vector<at::Tensor>& w_out_in,
    const std::vector<at::Tensor>& biases,
    int64_t seq_dim,
    const distributed::ProcessGroupPtr& group);

} // namespace detail
} // namespace layer
} // namespace shardformer
} // namespace colossalai
