#pragma once

/// Normalisation and dropout for tensor-parallel models.
///
/// Norm layers hold replicated weights (every rank of the tensor-parallel
/// group computes the same normalisation of a replicated activation);
/// `LayerNorm` is LibTorch's, whose ATen kernel is already fused, and
/// `RMSNorm` (LLaMA) is defined here: `kernels::rms_norm`, the fused CUDA
/// kernels on a GPU, its ATen reference (this layer's computation)
/// elsewhere.
///
/// `Dropout` draws its masks from a generator state of its own, so that
/// tensor parallelism gets the masks it needs (ColossalAI's
/// DropoutForReplicatedInput / DropoutForParallelInput, Megatron's model-
/// parallel RNG tracker): on a replicated activation every rank of the group
/// must drop the same elements, or the replicas diverge; on a sharded one
/// each rank's shard needs its own mask. The layer seeds its state with
/// `seed` (replicated) or `seed + group rank` (sharded), advances it with
/// every call, and leaves the global generator as it found it.
///
/// Example:
/// \code
///   using namespace colossalai::shardformer::layer;
///   Dropout
///   attn_drop(DropoutOptions(0.1).sharded_input(true).process_group(tp));
///   Dropout resid_drop(DropoutOptions(0.1).process_group(tp)); // replicated
/// \endcode

#include <colossalai/distributed/process_group.h>
#include <colossalai/nn/checkpoint.h>

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <map>
#include <utility>

namespace colossalai {
namespace shardformer {
namespace layer {

struct RMSNormOptions {
  /* implicit */ RMSNormOptions(int64_t hidden_size)
      : hidden_size_(hidden_size) {}
  TORCH_ARG(int64_t, hidden_size);
  TORCH_ARG(double, eps) = 1e-6;
};

/// y = x / sqrt(mean(x^2, -1) + eps) * weight, computed in fp32 and cast
/// back to the input's dtype (as LLaMA's reference implementation).
class RMSNormImpl : public torch::nn::Cloneable<RMSNormImpl> {
 public:
  explicit RMSNormImpl(RMSNormOptions options);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  /// {forward(x + residual), x + residual}: a residual add and the norm
  /// after it, in one kernel each way on a GPU (`kernels::add_rms_norm`);
  /// the same add and norm elsewhere, bit for bit.
  std::pair<at::Tensor, at::Tensor> forward_add(
      const at::Tensor& x,
      const at::Tensor& residual);

  RMSNormOptions options;
  at::Tensor weight; ///< [hidden_size], ones at construction
};
TORCH_MODULE(RMSNorm);

struct DropoutOptions {
  /* implicit */ DropoutOptions(double p = 0.5) : p_(p) {}
  TORCH_ARG(double, p);
  /// The activation is sharded over the group (each rank its own mask);
  /// false: replicated (the same mask on every rank).
  TORCH_ARG(bool, sharded_input) = false;
  TORCH_ARG(uint64_t, seed) = 1024;
  /// The group the activation is sharded or replicated over; null: none.
  TORCH_ARG(distributed::ProcessGroupPtr, process_group) = nullptr;
};

class DropoutImpl : public torch::nn::Cloneable<DropoutImpl>,
                    public nn::RandomStateOwner {
 public:
  explicit DropoutImpl(DropoutOptions options = {});
  void reset() override;
  /// Identity in eval mode or with p = 0.
  at::Tensor forward(const at::Tensor& x);
  /// Activation checkpointing replays the same masks with it.
  std::function<void()> snapshot_random_state() override;

  DropoutOptions options;

 private:
  // The generator state per device type (CPU, CUDA), created on first use.
  std::map<c10::DeviceType, at::Tensor> states_;
  uint64_t seed_ = 0;
};
TORCH_MODULE(Dropout);

} // namespace layer
} // namespace shardformer
} // namespace colossalai
