#pragma once

/// What a policy needs to shard a model (ColossalAI's `ShardConfig`): the
/// groups and the switches of HybridParallelPlugin. The plugin fills it from
/// its options; a user calling `shard_model` directly fills it by hand.
///
/// Example:
/// \code
///   colossalai::shardformer::ShardConfig cfg;
///   cfg.tensor_parallel_process_group(tp).enable_sequence_parallelism(true)
///       .sequence_parallelism_mode("split_gather");
///   auto info = colossalai::shardformer::shard_model(*model, cfg);
/// \endcode

#include <colossalai/distributed/process_group.h>

#include <torch/arg.h>

#include <string>

namespace colossalai {
namespace shardformer {

struct ShardConfig {
  int tp_size() const {
    return tensor_parallel_process_group_ == nullptr
        ? 1
        : tensor_parallel_process_group_->size();
  }
  /// The sequence-parallel size: the sp group's for all_to_all, the tensor
  /// group's for split_gather, 1 without sequence parallelism.
  int sp_size() const;
  /// The mode when sequence parallelism is on, "" otherwise.
  std::string sp_mode() const {
    return enable_sequence_parallelism_ ? sequence_parallelism_mode_ : "";
  }

  // TORCH_ARG leaves the access at private; keep the fields last.
  /// Null: no tensor parallelism (the model stays whole).
  TORCH_ARG(distributed::ProcessGroupPtr, tensor_parallel_process_group) =
      nullptr;
  /// The all_to_all (Ulysses) group; split_gather uses the tensor group.
  TORCH_ARG(distributed::ProcessGroupPtr, sequence_parallel_process_group) =
      nullptr;
  TORCH_ARG(bool, enable_sequence_parallelism) = false;
  /// "split_gather" or "all_to_all".
  TORCH_ARG(std::string, sequence_parallelism_mode) = "split_gather";
  /// Accepted with no effect: colossalai::models (Bloom's ALiBi aside) use
  /// at::scaled_dot_product_attention on 2.x whenever attention dropout is
  /// off (HybridParallelPluginOptions::enable_flash_attention).
  TORCH_ARG(bool, enable_flash_attention) = false;
  TORCH_ARG(bool, enable_fused_normalization) = false;
  TORCH_ARG(bool, enable_jit_fused) = false;
  /// Keep the LM head's logits split over the vocabulary (the model's loss
  /// then uses the vocabulary-parallel cross entropy).
  TORCH_ARG(bool, parallel_output) = true;
  TORCH_ARG(int64_t, make_vocab_size_divisible_by) = 64;
  /// Share of the blocks that recompute their activations in backward
  /// (ColossalAI's GradientCheckpointConfig.gradient_checkpointing_ratio).
  TORCH_ARG(double, gradient_checkpointing_ratio) = 0.0;
};

} // namespace shardformer
} // namespace colossalai
