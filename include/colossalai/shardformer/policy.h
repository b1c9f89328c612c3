#pragma once

/// Policies: how a model built from the parallel layers is sharded
/// (ColossalAI's `shardformer.policies`). A model is always built whole, as
/// it would run on one process (with Hugging Face parameter names, so its
/// checkpoints load directly); `shard_model` then shards it in place for a
/// ShardConfig and reports what the data-parallel and checkpoint layers need
/// to know: how every parameter splits, and which replicated parameters get
/// only a partial gradient on each tensor-parallel rank.
///
/// The base `Policy` shards any model: every ParallelModule (Linear1D_Col,
/// Linear1D_Row, the embeddings, the LM head) over the tensor group, without
/// sequence parallelism. A model whose forward must change with the
/// configuration (attention heads per rank, sequence parallelism) provides
/// its own policy, as colossalai::models' families do, or the user passes one
/// as HybridParallelPlugin's `custom_policy`.
///
/// Example (a custom model: an MLP built from the parallel layers):
/// \code
///   struct MLPImpl : torch::nn::Module {
///     MLPImpl() {
///       fc = register_module("fc", Linear1D_Col(Linear1DOptions(64, 256)));
///       proj = register_module("proj", Linear1D_Row(Linear1DOptions(256,
///       64)));
///     }
///     at::Tensor forward(at::Tensor x) { return proj(at::gelu(fc(x))); }
///     Linear1D_Col fc{nullptr};
///     Linear1D_Row proj{nullptr};
///   };
///   // HybridParallelPlugin(...tp_size(2)) shards it with the base Policy.
/// \endcode

#include <colossalai/shardformer/layer/parallel_module.h>
#include <colossalai/shardformer/shard_config.h>

#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace colossalai {
namespace shardformer {

/// What sharding left behind, for the plugin.
struct ShardInfo {
  /// Every parameter's split, by its name in `model.named_parameters()`;
  /// parameters not listed are replicated over the tensor group.
  std::map<std::string, layer::ShardSpec> specs;
  /// Replicated parameters used on sequence chunks (split_gather): each
  /// tensor rank's gradient is a partial sum, summed over the tensor group
  /// before the optimizer step.
  std::set<std::string> partial_grad_params;
  /// Under expert parallelism (ShardConfig::ep_group): each expert
  /// parameter's name and the expert-parallel rank that holds it (the
  /// others release it); parameters not listed are held by every rank.
  std::map<std::string, int> expert_owner;
};

/// One pipeline model chunk's share of a model: layers (blocks)
/// [begin, end) of the policy's `num_pipeline_layers`, and whether it is
/// the first (embeddings, reads the micro-batch) or the last (final norm,
/// head) of the pipeline. The default is the whole model.
struct StageLayers {
  int64_t begin = 0;
  int64_t end = -1; ///< -1: every layer
  bool first = true;
  bool last = true;
};

class Policy {
 public:
  virtual ~Policy() = default;
  virtual std::string name() const {
    return "Policy";
  }
  /// Shards `model` in place for `config` and says what it did. The base
  /// shards every ParallelModule over the tensor group and refuses sequence
  /// parallelism (only a policy that knows the model's forward can split
  /// its sequence).
  virtual ShardInfo shard(torch::nn::Module& model, const ShardConfig& config);

  // Pipeline parallelism (ColossalAI's get_held_layers, get_shared_params
  // and the per-stage forwards its policies install). The base policy
  // knows no split: pp_size > 1 needs a policy that overrides these.

  /// The layers that split over stages (transformer blocks); 0: the model
  /// cannot be split (the base).
  virtual int64_t num_pipeline_layers(const torch::nn::Module& model) const {
    return 0;
  }
  /// Names of the modules (as in `named_modules()`) that `layers` holds.
  virtual std::vector<std::string> held_layers(
      const torch::nn::Module& model,
      const StageLayers& layers) const;
  /// Parameters both the first and the last stage hold (a head tied to the
  /// embedding): their gradients are summed between the two.
  virtual std::vector<std::string> shared_params(
      const torch::nn::Module& model) const {
    return {};
  }
  /// Runs `layers` on one micro-batch: the first stage reads `micro_batch`
  /// (what `Booster::execute_pipeline`'s data iterator gives, cut to one
  /// micro-batch), the others `hidden`, the previous stage's output; every
  /// stage sees the micro-batch. The last returns the model's output (the
  /// criterion's input), the others what the next stage reads.
  virtual at::Tensor stage_forward(
      torch::nn::Module& model,
      const StageLayers& layers,
      const std::vector<at::Tensor>& micro_batch,
      const at::Tensor& hidden) const;
  /// How many items (tokens) the criterion's mean loss of `micro_batch`
  /// runs over: a pipeline step weighs micro-batch i's loss by n_i / sum n,
  /// so the step's loss is the mean over the whole batch's items, as one
  /// process computes it (NOTE [Token-mean losses]). -1 (the base): not
  /// known, every micro-batch weighs 1 / num_microbatches (ColossalAI's
  /// rule, right for a criterion that averages over samples).
  virtual int64_t loss_items(const std::vector<at::Tensor>& micro_batch) const {
    return -1;
  }
  /// Refuses a micro-batch that `stage_forward` cannot take whole (a tensor
  /// it would drop, a wrong shape). Called on every rank before a pipeline
  /// step, so such a batch fails on all of them at once rather than on the
  /// first stage while the others wait for its activations. The base takes
  /// anything.
  virtual void check_micro_batch(
      const std::vector<at::Tensor>& micro_batch) const {}
};

/// A model that knows its policy (colossalai::models' families): the plugin
/// uses it unless the user passes a custom_policy.
class ShardableModel {
 public:
  virtual ~ShardableModel() = default;
  virtual std::shared_ptr<Policy> default_policy() const = 0;
};

/// `policy`, else the model's own (ShardableModel), else the base Policy.
std::shared_ptr<Policy> resolve_policy(
    torch::nn::Module& model,
    std::shared_ptr<Policy> policy = nullptr);

/// Shards `model` in place with `policy` (default: the model's own when it
/// is a ShardableModel, else the base Policy), after
/// checking the config, and fills in the specs of every ParallelModule the
/// policy did not describe.
ShardInfo shard_model(
    torch::nn::Module& model,
    const ShardConfig& config,
    std::shared_ptr<Policy> policy = nullptr);

/// The split of every parameter of `model`, from its ParallelModules.
std::map<std::string, layer::ShardSpec> collect_shard_specs(
    const torch::nn::Module& model);

/// Splits `blocks` layers evenly over `num_stages` pipeline stages (the
/// remainder to the middle stages: the first and the last hold the
/// embeddings and the head besides): the half-open block range of `stage`.
std::pair<int64_t, int64_t> stage_block_range(
    int64_t blocks,
    int stage,
    int num_stages);

} // namespace shardformer
} // namespace colossalai
