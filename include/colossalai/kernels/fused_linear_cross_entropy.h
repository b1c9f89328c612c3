#pragma once

/// Fused linear + cross-entropy (NOTE [Kernels] in rms_norm.h): the loss of
/// a language model's output projection, cross_entropy(hidden @ weight^T +
/// bias, target), computed chunk by chunk over the tokens so that the
/// [tokens x vocab] logits (and their float32 softmax) are never held
/// whole: each chunk's logits live only while its loss and its gradients
/// are taken. The gradients of hidden, weight and bias are computed in the
/// forward and scaled by the incoming gradient in the backward (the loss is
/// a graph's last node), as Liger-Kernel's and llm.c's fused classifiers do:
/// in place, handed on as the parameters' gradients without a copy, unless
/// the graph is kept for another backward (retain_graph; a further backward
/// through a loss whose gradients were handed on is refused by name).
///
/// Each chunk's loss and logits gradient come from one CUDA kernel on a GPU
/// (float32, float16, bfloat16: detail::cross_entropy_grad_, in place over
/// the chunk's logits), from the same computation in ATen elsewhere.
///
/// Numerics: the matmuls run in the compute dtype (autocast's on the
/// hidden's device when autocast is on there, else the inputs' dtype), the
/// log-sum-exp, softmax and loss in float32 (float64 for float64 inputs),
/// the logits' gradient rounded once to the compute dtype, the weight's
/// gradient summed over chunks in float32 (float64; with one chunk the
/// product in the compute dtype, as the reference's). Against the reference (the same matmul, then
/// cross-entropy in float32): float32 agrees within float32 rounding; in
/// bf16 the weight gradient is rounded once per chunk instead of once.
///
/// Example:
/// \code
///   namespace k = colossalai::kernels;
///   auto loss = k::fused_linear_cross_entropy(
///       hidden.view({-1, c}), head->weight, {}, targets.view(-1),
///       k::FusedLinearCrossEntropyOptions().ignore_index(-100));
///   loss.backward();
/// \endcode

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>

#include <cstdint>
#include <functional>

namespace colossalai {
namespace kernels {

/// Vocabulary parallelism (a VocabParallelLMHead1D's shard): where this
/// rank's `weight` rows sit in a head split over a group of ranks, and how
/// to reduce over that group. Each chunk's softmax statistics (the row
/// maximum, the sum of exponentials, the target's logit) are reduced over
/// the group; every rank returns the whole loss, the gradient of its
/// weight rows, and its part of the hidden states' gradient (summed over
/// the group by whatever gave every rank the hidden states, as
/// copy_to_group does for the head's logits).
/// shardformer::layer::vocab_parallel_fused_linear_cross_entropy fills it.
struct VocabShard {
  /// The whole vocabulary's index of this rank's first weight row.
  int64_t start = 0;
  /// The whole vocabulary; rows at or past it (padding) take no part.
  int64_t vocab_size = 0;
  /// In place over the group: elementwise maximum, elementwise sum.
  std::function<void(at::Tensor&)> all_reduce_max;
  std::function<void(at::Tensor&)> all_reduce_sum;
};

struct FusedLinearCrossEntropyOptions {
  /// Targets equal to this contribute neither loss nor gradient.
  TORCH_ARG(int64_t, ignore_index) = -100;
  /// Tokens per chunk; 0 picks the largest power of two whose logits stay
  /// within 256 MiB, or within half the weight gradient's float32 bytes
  /// where that is more (on a GPU in the compute dtype, in place; elsewhere
  /// their float32 copy, beside the logits themselves): each chunk adds
  /// to the whole gradient, so a large head takes fewer chunks.
  TORCH_ARG(int64_t, chunk_size) = 0;
  /// true: the mean over the targets that are not ignored (PyTorch's
  /// "mean", NaN when every target is ignored); false: their sum.
  TORCH_ARG(bool, mean) = true;
  /// Set: `weight` is this rank's shard of a vocabulary-parallel head (on a
  /// GPU each chunk's loss and gradient by two CUDA kernels with the
  /// group's reductions between them; ATen elsewhere). Unset: the whole
  /// head.
  TORCH_ARG(c10::optional<VocabShard>, vocab_shard) = c10::nullopt;
};

/// hidden [N, H], weight [V, H], bias [V] (optional), target [N] int64.
/// Returns the 0-dimensional loss, float32 (float64 for float64 inputs).
at::Tensor fused_linear_cross_entropy(
    const at::Tensor& hidden,
    const at::Tensor& weight,
    const c10::optional<at::Tensor>& bias,
    const at::Tensor& target,
    const FusedLinearCrossEntropyOptions& options = {});

/// Waits for the target checks of earlier fused_linear_cross_entropy calls
/// on a GPU and raises if one found a target outside [0, vocab) that is not
/// ignore_index. Each call checks its targets: where they are on the host,
/// at once; on a GPU on the device, and the next call raises, so that no
/// step waits for the device to read it back (the next call waits for the
/// check only if the device has not passed it yet; the failed call's loss
/// and gradients are not valid). The checks are the process's: the next
/// call on any thread reports them. Call this where the answer must be
/// known, e.g. before saving a checkpoint (not inside a CUDA graph's
/// capture, where it is refused). Inside a capture no check is made of
/// targets on the GPU.
void synchronize_target_checks();

/// The reference: at::linear, then cross-entropy of the logits in float32
/// (float64 for float64 inputs).
at::Tensor linear_cross_entropy_reference(
    const at::Tensor& hidden,
    const at::Tensor& weight,
    const c10::optional<at::Tensor>& bias,
    const at::Tensor& target,
    const FusedLinearCrossEntropyOptions& options = {});

namespace detail {
/// Cross-entropy's loss per row and its logits gradient, in place: for each
/// row of `logits` [N, V] (each row contiguous, rows at least V elements
/// apart: a contiguous tensor or a view of padded rows) with target t, the loss
/// logsumexp(row) - row[t], and row := (softmax(row) - one_hot(t)) * scale,
/// computed in float32 (float64 for float64 logits) and rounded once to the
/// logits' dtype. Rows whose target is `ignore_index` get loss 0 and a zero
/// gradient. `target` [N] int64 must be in [0, V) or ignore_index (the
/// caller checks; both paths give any other target's row NaN); `scale` is
/// one value on the logits' device. Returns the losses [N], float32
/// (float64). The CUDA kernel on a GPU, ATen elsewhere.
at::Tensor cross_entropy_grad_(
    at::Tensor& logits,
    const at::Tensor& target,
    int64_t ignore_index,
    const at::Tensor& scale);

/// cross_entropy_grad_ for a vocabulary-parallel head's shard: the row
/// maximum, the sum of exponentials and the target's logit reduced over
/// the shard's group (`shard`'s reductions), padding columns (at or past
/// vocab_size - start) taking no probability and a zero gradient. On a GPU
/// (float32, float16, bfloat16; unless `allow_kernel` is false) two CUDA
/// kernels with the reductions between them; ATen elsewhere.
at::Tensor sharded_cross_entropy_grad_(
    at::Tensor& logits,
    const at::Tensor& target,
    int64_t ignore_index,
    const at::Tensor& scale,
    const VocabShard& shard,
    bool allow_kernel = true);
} // namespace detail

} // namespace kernels
} // namespace colossalai
