#pragma once

// Sequence-parallel matmuls with the collective overlapped chunk by chunk
// around a ring (sequence_parallelism_mode "ring"; NOTE [Ring linear]).

#include <colossalai/distributed/process_group.h>

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

namespace colossalai {
namespace shardformer {
namespace layer {
namespace detail {

/// What the sequence-parallel Functions (ring and overlapped layers) keep
/// for backward: the group and the sequence dimension, non-negative.
struct SeqGroup : torch::CustomClassHolder {
  distributed::ProcessGroupPtr group;
  int64_t seq_dim = 1;
};

/// `seq_dim` of `x` wrapped and checked (a dimension before the features),
/// with `group`; `who` names the caller in the error.
c10::intrusive_ptr<SeqGroup> seq_group(
    const at::Tensor& x,
    int64_t seq_dim,
    const distributed::ProcessGroupPtr& group,
    const char* who);

/// Column layer: this rank's sequence chunk `x` [.., T / n (seq_dim), in]
/// all-gathered along `seq_dim` and multiplied by `w_io` [in, out] ->
/// [.., T, out]; each arriving chunk is multiplied while the next travels.
/// Backward: the input gradient reduce-scattered the same way.
at::Tensor ring_gather_matmul(
    const at::Tensor& x,
    const at::Tensor& w_io,
    int64_t seq_dim,
    const distributed::ProcessGroupPtr& group);

/// Row layer: `x` [.., T, in / n] times `w_io` [in / n, out], summed over
/// the group and scattered along `seq_dim` -> [.., T / n, out]; each
/// chunk's partial product is computed while the previous sum travels.
/// Backward: the output gradient all-gathered the same way.
at::Tensor ring_matmul_reduce_scatter(
    const at::Tensor& x,
    const at::Tensor& w_io,
    int64_t seq_dim,
    const distributed::ProcessGroupPtr& group);

} // namespace detail
} // namespace layer
} // namespace shardformer
} // namespace colossalai
