#pragma once

/// Losses over the tokens of several ranks.
///
/// NOTE [Token-mean losses]
/// A language model's loss is the mean over the non-ignored tokens (targets
/// other than -100). When the tokens of one batch are spread over ranks that
/// hold different numbers of them (a sequence split over sp ranks: the
/// shifted labels' last position and padding are ignored; rows split over
/// data-parallel ranks with padding), the mean of each rank's own mean is
/// not that mean. `token_mean` carries the count with the partial sums: its
/// value is sum / count over the whole group, and its gradient is this
/// rank's sum's times group size / total count, so that the ranks'
/// gradients *averaged* over the group (what DDP, ZeRO and the
/// sequence-parallel gradient reduction do) are the whole mean's gradient.
///
/// Data parallelism keeps PyTorch DDP's semantics by default: every rank's
/// loss is the mean over its own rows, and the gradients are averaged over
/// ranks, so a rank with fewer real tokens weighs as much as one with more.
/// For padded data, pass the data-parallel group to make the loss the global
/// token mean (one all-reduce of two numbers per call).
///
/// Example (token-weighted data parallelism, any plugin):
/// \code
///   auto logits = boosted.model(ids);
///   auto n = targets.ne(-100).sum();
///   auto loss = colossalai::nn::token_mean(
///       model->loss(logits, targets) * n, n, plugin->dp_group());
///   booster.backward(loss, *boosted.optimizer);
/// \endcode

#include <colossalai/distributed/process_group.h>

#include <ATen/core/Tensor.h>

namespace colossalai {
namespace nn {

/// The mean over every rank of `group` of the per-token losses, from this
/// rank's `sum` (a scalar that may require grad) and `count` (a scalar
/// number of tokens, any dtype). Value: sum(sums) / sum(counts) (0 when no
/// rank has a token); gradient: d sum x group size / sum(counts). A null
/// group or a group of one rank gives sum / count. The result is at least
/// float32. No host synchronisation beyond the all-reduce.
at::Tensor token_mean(
    const at::Tensor& sum,
    const at::Tensor& count,
    const distributed::ProcessGroupPtr& group);

} // namespace nn
} // namespace colossalai
