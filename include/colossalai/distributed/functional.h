#pragma once

/// Collectives that autograd differentiates: the Megatron "f / g" operators
/// of tensor and sequence parallelism. Each returns a new tensor and, in
/// backward, applies its adjoint collective to the incoming gradient over
/// the same group. Every rank of `group` must call them in the same order
/// with tensors of the same shape (the split dimension divisible by the
/// group size). A null group or a group of one rank makes each the identity.
///
// clang-format off
/// | operator                                 | forward              | backward             |
/// |------------------------------------------|----------------------|----------------------|
/// | copy_to_group                            | identity             | all-reduce (sum)     |
/// | reduce_from_group                        | all-reduce (sum)     | identity             |
/// | split_along_dim                          | keep this rank's chunk | all-gather along dim |
/// | gather_along_dim                         | all-gather along dim | keep this rank's chunk |
/// | reduce_scatter_along_dim                 | reduce-scatter (sum) | all-gather along dim |
/// | gather_along_dim_reduce_scatter_backward | all-gather           | reduce-scatter (sum) |
/// | all_to_all_along_dims                    | all-to-all           | the reverse all-to-all |
/// | all_to_all_single                        | uneven all-to-all    | the reverse exchange |
// clang-format on
///
/// `fp8` (ColossalAI's fp8_communication): where `group` spans more than
/// one node (quantization::fp8_compresses), floating-point tensors travel
/// as FP8 with one scale per rank's message (quantization/fp8.h):
/// activations forward as e4m3, gradients backward as e5m2. Within a node
/// it changes nothing. Needs LibTorch 2.1 or later.
///
/// Example (a column- then row-parallel MLP, Megatron's layout):
/// \code
///   namespace cdf = colossalai::distributed::functional;
///   auto h = at::linear(cdf::copy_to_group(x, tp), w1_shard, b1_shard);
///   auto y = cdf::reduce_from_group(at::linear(at::gelu(h), w2_shard), tp);
/// \endcode

#include <colossalai/distributed/process_group.h>

#include <ATen/ATen.h>

#include <vector>

namespace colossalai {
namespace distributed {
namespace functional {

/// Identity; backward sums the gradient over the group (the input is used
/// by every rank's shard of the next layer).
at::Tensor copy_to_group(
    const at::Tensor& x,
    const ProcessGroupPtr& group,
    bool fp8 = false);

/// Sums the partial results of the ranks; backward passes the gradient
/// through (every rank's partial contributed with weight one).
at::Tensor reduce_from_group(
    const at::Tensor& x,
    const ProcessGroupPtr& group,
    bool fp8 = false);

/// This rank's chunk of `x` along `dim` (group-rank order); backward
/// all-gathers the chunks' gradients.
at::Tensor split_along_dim(
    const at::Tensor& x,
    int64_t dim,
    const ProcessGroupPtr& group,
    bool fp8 = false);

/// Concatenates every rank's `x` along `dim` (group-rank order); backward
/// keeps this rank's chunk of the gradient.
at::Tensor gather_along_dim(
    const at::Tensor& x,
    int64_t dim,
    const ProcessGroupPtr& group,
    bool fp8 = false);

/// Sums `x` over the group and keeps this rank's chunk along `dim`
/// (sequence parallelism leaving a row-parallel layer); backward
/// all-gathers along `dim`.
at::Tensor reduce_scatter_along_dim(
    const at::Tensor& x,
    int64_t dim,
    const ProcessGroupPtr& group,
    bool fp8 = false);

/// All-gathers along `dim` (sequence parallelism entering a column-parallel
/// layer); backward reduce-scatters the gradient along `dim`, since every
/// rank's shard of the layer used the whole gathered input.
at::Tensor gather_along_dim_reduce_scatter_backward(
    const at::Tensor& x,
    int64_t dim,
    const ProcessGroupPtr& group,
    bool fp8 = false);

/// Splits `x` along `scatter_dim` into one chunk per rank, sends chunk r to
/// rank r, and concatenates what arrives along `gather_dim` (Ulysses
/// sequence parallelism: sequence-sharded to head-sharded and back);
/// backward is the same exchange with the two dimensions swapped.
at::Tensor all_to_all_along_dims(
    const at::Tensor& x,
    int64_t scatter_dim,
    int64_t gather_dim,
    const ProcessGroupPtr& group,
    bool fp8 = false);

/// Sends rows [sum(input_splits[:r]), +input_splits[r]) of `x` to rank r
/// and concatenates what arrives, output_splits[r] rows from rank r, in
/// rank order (torch.distributed.nn.functional.all_to_all_single; the
/// dispatch and combine of expert parallelism); backward is the reverse
/// exchange. Every rank's output_splits[r] must be rank r's
/// input_splits[this rank].
at::Tensor all_to_all_single(
    const at::Tensor& x,
    const std::vector<int64_t>& output_splits,
    const std::vector<int64_t>& input_splits,
    const ProcessGroupPtr& group,
    bool fp8 = false);

/// Identity whose backward multiplies the gradient by `factor` (e.g. the
/// sequence-parallel size where every rank of a group computes the same
/// loss from gathered activations but keeps only its chunk's gradient).
at::Tensor scale_grad(const at::Tensor& x, double factor);

} // namespace functional
} // namespace distributed
} // namespace colossalai
