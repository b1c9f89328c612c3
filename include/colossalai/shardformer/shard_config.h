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

/// Sequence parallelism's modes, as ColossalAI names them in
/// `sequence_parallelism_mode`; options keep Python's strings, code past
/// the option checks compares these.
enum class SequenceParallelMode {
  kNone,        ///< off
  kSplitGather, ///< "split_gather": over the tensor group (Megatron's)
  kRing,        ///< "ring": split_gather with ring-overlapped matmuls
  kAllToAll,    ///< "all_to_all": Ulysses, on the sp group
  kRingAttn,    ///< "ring_attn": ring attention, on the sp group
};

/// The mode `name` names ("split_gather", "ring", "all_to_all",
/// "ring_attn"); an error starting with `who` names the accepted ones.
SequenceParallelMode parse_sequence_parallel_mode(
    const std::string& name,
    const char* who);
/// The option string of a mode ("" for kNone).
const char* to_string(SequenceParallelMode mode);
/// Whether a mode splits the sequence over the tensor group (split_gather,
/// ring) rather than over its own sp group (all_to_all, ring_attn).
inline bool on_tensor_group(SequenceParallelMode mode) {
  return mode == SequenceParallelMode::kSplitGather ||
      mode == SequenceParallelMode::kRing;
}
/// Whether a mode has a group of its own (all_to_all, ring_attn).
inline bool on_sp_group(SequenceParallelMode mode) {
  return mode == SequenceParallelMode::kAllToAll ||
      mode == SequenceParallelMode::kRingAttn;
}

struct ShardConfig {
  int tp_size() const {
    return tensor_parallel_process_group_ == nullptr
        ? 1
        : tensor_parallel_process_group_->size();
  }
  /// The sequence-parallel size: the sp group's for all_to_all, the tensor
  /// group's for split_gather, 1 without sequence parallelism.
  int sp_size() const;
  /// The mode when sequence parallelism is on, kNone otherwise (an error
  /// for a mode that does not exist).
  SequenceParallelMode sp_mode() const {
    return enable_sequence_parallelism_
        ? parse_sequence_parallel_mode(
              sequence_parallelism_mode_, "ShardConfig")
        : SequenceParallelMode::kNone;
  }

  // TORCH_ARG leaves the access at private; keep the fields last.
  /// Null: no tensor parallelism (the model stays whole).
  TORCH_ARG(distributed::ProcessGroupPtr, tensor_parallel_process_group) =
      nullptr;
  /// The all_to_all (Ulysses) group; split_gather uses the tensor group.
  TORCH_ARG(distributed::ProcessGroupPtr, sequence_parallel_process_group) =
      nullptr;
  TORCH_ARG(bool, enable_sequence_parallelism) = false;
  /// "split_gather", "ring", "all_to_all" or "ring_attn".
  TORCH_ARG(std::string, sequence_parallelism_mode) = "split_gather";
  /// split_gather: the column layers' backward reduce-scatters the input
  /// gradient while it computes the weight gradients
  /// (Linear1DOptions::overlap); ring overlaps already. Needs
  /// enable_sequence_parallelism.
  TORCH_ARG(bool, enable_sequence_overlap) = false;
  /// ring_attn: inner rings of this many consecutive sp ranks joined by
  /// inter rings (layer::get_double_ring_groups); 0 or the sp size: one
  /// ring. Must divide the sp size.
  TORCH_ARG(int, inner_ring_size) = 0;
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
  /// Expert parallelism (MoeHybridParallelPlugin): the ranks that split a
  /// sparse layer's experts between them, exchanging tokens with
  /// all-to-all; null: every rank holds every expert.
  TORCH_ARG(distributed::ProcessGroupPtr, ep_group) = nullptr;
  /// Tensor- and sequence-parallel collectives and the expert-parallel
  /// token exchange travel as FP8 where their group spans nodes
  /// (distributed/functional.h's `fp8`): activations e4m3, gradients e5m2
  /// (HybridParallelPluginOptions::fp8_communication). The vocabulary-
  /// parallel loss stays float32.
  TORCH_ARG(bool, fp8_communication) = false;
};

} // namespace shardformer
} // namespace colossalai
