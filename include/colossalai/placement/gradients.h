#pragma once

// The operations over a model's gradients that depend on where its
// parameters live: the sum of partial gradients and the global norm. One
// implementation for every optimizer that shards or splits parameters.

#include <colossalai/placement/placement.h>

#include <vector>

namespace colossalai {
namespace placement {

/// Sums `tensors` over `group` in place, in one all-reduce of their
/// concatenation (on the group's device). Collective over `group`. `fp8`:
/// through quantization::all_reduce_fp8 (e5m2) where the group spans
/// nodes.
void sum_flat(
    const std::vector<at::Tensor>& tensors,
    const distributed::ProcessGroup& group,
    bool fp8 = false);

/// Sums over each axis the gradients that are Partial over it, in one
/// all-reduce of their concatenation per axis. `grads[i]` is (the part this
/// rank steps of) `params[i]`'s gradient, laid out alike on every rank of
/// the axis (a partial one must be defined; empty ones are skipped).
/// Collective over every
/// axis holding a partial gradient.
void sum_partial_grads(
    const PlacementTable& table,
    const std::vector<at::Tensor>& params,
    const std::vector<at::Tensor>& grads);

/// The global norm of the gradients, as torch.nn.utils.clip_grad_norm_
/// computes it on the whole model: `grads[i]` belongs to `params[i]`; each
/// counts once over the mesh (PlacementTable::counts_once). `pieces`
/// (ZeRO's shard group: disjoint pieces of the same parameters) is
/// combined first, then the table's axes and pipeline; partials are
/// combined in double precision. Collective over those groups.
double global_grad_norm(
    const PlacementTable& table,
    const std::vector<at::Tensor>& params,
    const std::vector<at::Tensor>& grads,
    double norm_type,
    const distributed::ProcessGroup* pieces = nullptr);
/// The same norm left on the device (interface::total_norm_on_device), to
/// clip by without reading it back.
at::Tensor global_grad_norm_on_device(
    const PlacementTable& table,
    const std::vector<at::Tensor>& params,
    const std::vector<at::Tensor>& grads,
    double norm_type,
    const distributed::ProcessGroup* pieces = nullptr);

} // namespace placement
} // namespace colossalai
