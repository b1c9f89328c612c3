#pragma once

#include <colossalai/booster/plugin/dp_plugin_base.h>
#include <colossalai/placement/placement.h>
#include <colossalai/shardformer/policy.h>

#include <torch/arg.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

namespace colossalai {
namespace pipeline {
class PipelineStageManager;
class PipelineSchedule;
} // namespace pipeline
namespace zero {
class LowLevelZeroOptimizer;
} // namespace zero
namespace booster {
namespace plugin {
struct HybridState; // what boost learned, shared with the checkpoint IO
class TorchDDPModel;
namespace detail {
class PipelineGuardModel;
} // namespace detail

/// Options of HybridParallelPlugin, with ColossalAI's names and defaults.
struct HybridParallelPluginOptions {
  /// Tensor-parallel size: the model's ParallelModules are split over it.
  TORCH_ARG(int, tp_size) = 1;
  /// Pipeline stages (the mesh's pp axis). With more than one, each stage
  /// holds its share of the layers and a step runs through
  /// `Booster::execute_pipeline`.
  TORCH_ARG(int, pp_size) = 1;
  /// Micro-batches per pipeline step; 0: batch size / microbatch_size. One
  /// of the two is needed with pp_size > 1.
  TORCH_ARG(int, num_microbatches) = 0;
  /// Samples per micro-batch; 0: batch size / num_microbatches.
  TORCH_ARG(int, microbatch_size) = 0;
  /// "1f1b", "interleaved" (num_model_chunks > 1) or "zbv" (zero-bubble V:
  /// num_model_chunks 2, backward split into input and weight passes).
  TORCH_ARG(std::string, pp_style) = "1f1b";
  /// Model chunks per pipeline rank (interleaved, zbv).
  TORCH_ARG(int, num_model_chunks) = 1;
  /// Layers of each virtual stage (pp_size x num_model_chunks entries);
  /// empty: an even split.
  TORCH_ARG(std::vector<int>, num_layers_per_stage) = {};
  /// Send the shape / dtype of each stream between stages once and reuse
  /// it (every micro-batch then has the same shape).
  TORCH_ARG(bool, enable_metadata_cache) = true;
  /// Post each receive before the action ahead of it computes.
  TORCH_ARG(bool, overlap_p2p) = true;
  /// A schedule of one's own instead of pp_style's generated one: every
  /// stage's actions (ColossalAI's scheduler_nodes for zbv), e.g.
  /// pipeline::zero_bubble_v(pp, m, costs) for measured pass costs. Any
  /// pp_style takes one for its layout; it is checked at construction
  /// (pipeline::check_schedule: it must finish and receive in send order)
  /// and fixes the micro-batch count. Empty: generated.
  TORCH_ARG(std::vector<std::vector<pipeline::Action>>, scheduler_nodes) = {};
  /// Sequence-parallel size of all_to_all and ring_attn (their own mesh
  /// axis); 0 = unset (1). split_gather and ring use the tensor group and
  /// refuse an sp_size other than 0 or 1.
  TORCH_ARG(int, sp_size) = 0;
  /// "fp16" (needs CUDA), "bf16" or "fp32".
  TORCH_ARG(std::string, precision) = "fp16";
  /// 0: DDP over the data-parallel group; 1, 2: ZeRO-1/2 over it.
  TORCH_ARG(int, zero_stage) = 0;
  /// Turns on fused normalization and flash attention (not the JIT fusion,
  /// which LibTorch lacks).
  TORCH_ARG(bool, enable_all_optimization) = false;
  /// Accepted: LibTorch's LayerNorm is one fused ATen kernel already.
  TORCH_ARG(bool, enable_fused_normalization) = false;
  /// Accepted with no effect: the models' attention runs through
  /// at::scaled_dot_product_attention on LibTorch 2.x whenever attention
  /// dropout is off (dropout needs the probabilities, for masks that follow
  /// the tensor-parallel layout); 1.13 has no fused kernel (matmul +
  /// softmax).
  TORCH_ARG(bool, enable_flash_attention) = false;
  /// Refused when true: LibTorch has no TorchScript fusion of bias, dropout
  /// and residual add.
  TORCH_ARG(bool, enable_jit_fused) = false;
  TORCH_ARG(bool, enable_sequence_parallelism) = false;
  /// "split_gather" or "ring" (the sequence split over the tensor group
  /// between blocks; ring overlaps each gather / reduce-scatter chunk with
  /// its matmul), "all_to_all" (Ulysses: heads exchanged around attention)
  /// or "ring_attn" (ring attention: key / value chunks passed around the
  /// sp group; no attention dropout). "" = all_to_all, ColossalAI's default.
  TORCH_ARG(std::string, sequence_parallelism_mode) = "";
  /// split_gather: each block's column layers reduce-scatter their input
  /// gradient while they compute their weight gradients, one collective
  /// per shared input (NOTE [Sequence overlap]); ring overlaps already and
  /// takes it as is. Needs enable_sequence_parallelism; all_to_all and
  /// ring_attn refuse it (their collectives are not the column layers').
  TORCH_ARG(bool, enable_sequence_overlap) = false;
  /// ring_attn across hosts: the sp group as inner rings of this many
  /// consecutive sp ranks (one host's, ideally) joined by inter rings, so
  /// every rank sends across hosts once per inner round, hidden behind the
  /// round's blocks (ColossalAI's 2D ring attention). 0 (unset) or sp_size:
  /// one ring. Must divide sp_size; other modes refuse it.
  TORCH_ARG(int, inner_ring_size) = 0;
  /// Keep the LM head's logits split over the vocabulary.
  TORCH_ARG(bool, parallel_output) = true;
  TORCH_ARG(double, initial_scale) = 65536.0;
  TORCH_ARG(double, min_scale) = 1.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 1000;
  TORCH_ARG(int64_t, hysteresis) = 2;
  TORCH_ARG(double, max_scale) = 4294967296.0;
  /// Global gradient-norm clipping inside step (tensor-parallel aware);
  /// 0 = off.
  TORCH_ARG(double, max_norm) = 0.0;
  TORCH_ARG(bool, broadcast_buffers) = true;
  TORCH_ARG(double, ddp_bucket_cap_mb) = 25;
  TORCH_ARG(bool, find_unused_parameters) = false;
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  TORCH_ARG(bool, static_graph) = false;
  /// ZeRO gradient bucket size in units of 2^20 elements.
  TORCH_ARG(double, zero_bucket_size_in_m) = 12;
  /// ZeRO: master weights, gradients and optimizer states on the host.
  TORCH_ARG(bool, cpu_offload) = false;
  /// "" (the working dtype), "fp32", "bf16" or "fp16" (ZeRO).
  TORCH_ARG(std::string, communication_dtype) = "";
  TORCH_ARG(bool, overlap_communication) = true;
  /// ZeRO (zero_stage 1-2): leave the parameter all-gathers of step() in
  /// flight for the next forward to wait for block by block, as
  /// LowLevelZeroPluginOptions::overlap_allgather (NOTE [All-gathers overlap
  /// the next forward]).
  TORCH_ARG(bool, overlap_allgather) = false;
  /// Traffic that crosses nodes travels as FP8 (quantization/fp8.h, as
  /// ColossalAI's fp8_communication): the data-parallel gradient
  /// all-reduce (e5m2) or ZeRO's gradient reduce-scatters (e5m2) and
  /// parameter all-gathers (e4m3), activations (e4m3) and their gradients
  /// (e5m2) between pipeline stages, and the tensor- and sequence-parallel
  /// collectives and MoeHybridParallelPlugin's expert token exchange (e4m3
  /// forward, e5m2 backward; ShardConfig::fp8_communication), and the tied
  /// embedding's gradients between the first and last stage. Ring layers'
  /// overlapped transfers and the vocabulary-parallel loss stay full
  /// precision.
  /// Needs LibTorch 2.1 or later.
  TORCH_ARG(bool, fp8_communication) = false;
  /// FP8 mixed precision (ColossalAI's use_fp8): inside the model's
  /// forward, each linear layer whose weight trains multiplies in FP8
  /// (e4m3 operands, e5m2 output gradients, one scale per tensor, float32
  /// accumulation; quantization/fp8_linear.h). Layers of
  /// colossalai::shardformer::layer and models and
  /// colossalai::quantization::linear take part; LibTorch's own
  /// torch::nn::Linear cannot (a warning after the first forward says when
  /// nothing took part). Needs precision bf16 or fp16, LibTorch 2.1 or
  /// later, and on a GPU compute capability 8.9 or later.
  TORCH_ARG(bool, use_fp8) = false;
  /// How to shard the model; null: the model's own (ShardableModel) or the
  /// base Policy (every ParallelModule over the tensor group).
  TORCH_ARG(std::shared_ptr<shardformer::Policy>, custom_policy) = nullptr;
  /// Share of blocks that recompute their activations in backward
  /// (ColossalAI's GradientCheckpointConfig: the first int(ratio x blocks)
  /// blocks), in [0, 1]; colossalai::models honour it, custom models read it
  /// from ShardConfig.
  TORCH_ARG(double, gradient_checkpointing_ratio) = 0.0;
  TORCH_ARG(int64_t, make_vocab_size_divisible_by) = 64;
  /// Mesh axis order: (dp, pp, sp, tp) when true, (pp, dp, sp, tp) else.
  TORCH_ARG(bool, dp_outside) = true;
  /// Expert-parallel size (MoeHybridParallelPlugin only; HybridParallelPlugin
  /// refuses more than 1): each sparse layer's experts are split over ep_size
  /// data-parallel ranks, which exchange tokens by all-to-all. It divides
  /// the data-parallel size; the ranks holding the same experts
  /// (dp / ep_size of them) average those experts' gradients.
  TORCH_ARG(int, ep_size) = 1;
};

/// Tensor, sequence, pipeline and data parallelism combined
/// (`colossalai.booster.plugin.HybridParallelPlugin`).
///
/// NOTE [Hybrid parallel layout]
/// The ranks form a mesh (dp, pp, sp, tp) (tp fastest: a tensor group is
/// neighbouring ranks). At boost, rank 0's whole model is broadcast, then
/// the policy shards it in place (ShardInfo says how every parameter
/// splits). Data parallelism runs over the dp x sp group: DDP (zero_stage 0)
/// or ZeRO-1/2 (the shared sharded-optimizer core), so sequence-parallel
/// ranks, which see different tokens of the same samples, average their
/// gradients like data-parallel ones. Tensor-split parameters differ per
/// tensor rank and are reduced only over dp x sp; replicated ones
/// (norms, row-parallel biases) get identical gradients on every tensor
/// rank, except under split_gather / ring, where they see one sequence chunk
/// each and are summed over the tensor group before the step. The global norm
/// counts split parameters on every tensor rank and replicated ones once.
///
/// NOTE [Hybrid pipeline]
/// With pp_size > 1 the policy says how the model splits
/// (`num_pipeline_layers`, `held_layers`, `stage_forward`). At boost each
/// rank keeps the parameters of its chunks' layers and releases the rest
/// (their storage is freed, they leave the optimizer), as ColossalAI's
/// shardformer does. A step (`execute_pipeline`) runs the schedule with
/// data-parallel synchronisation off, then once: the tied parameters'
/// gradients are summed between the first and last stage, and the
/// data-parallel gradients are reduced (DDP's or ZeRO-1's buckets); zero
/// stage 2 is refused, as in ColossalAI. The optimizer's global norm and
/// overflow decision combine every stage, counting a tied parameter once.
/// Checkpoints: each tensor and optimizer state is written by the first
/// stage holding it, optimizer states under the whole model's parameter ids
/// (as the optimizer held them before the release), so they load at any
/// layout. A sharded save has every stage write its own shards under one
/// index (NOTE [Sharded saves in parts]); a single file and a background
/// save go through one writer, one tensor at a time.
///
/// Example:
/// \code
///   auto plugin = std::make_shared<HybridParallelPlugin>(
///       HybridParallelPluginOptions().tp_size(2).zero_stage(1)
///           .precision("bf16"));
///   Booster booster(BoosterOptions().plugin(plugin));
///   auto model = models::from_pretrained<models::LlamaForCausalLM>(dir);
///   auto boosted = booster.boost(model, optimizer);
///   auto loss = model->loss(boosted.model(ids), targets);
///   // With pp_size(2).num_microbatches(4): one step on every rank
///   auto out = booster.execute_pipeline(
///       [&] { return pipeline::Batch{ids, targets}; }, boosted.model,
///       [&](const at::Tensor& logits, const pipeline::Batch& mb) {
///         return model->loss(logits, mb[1]);
///       },
///       boosted.optimizer.get());
/// \endcode
class HybridParallelPlugin : public DPPluginBase {
 public:
  explicit HybridParallelPlugin(HybridParallelPluginOptions options = {})
      : HybridParallelPlugin(std::move(options), /*experts=*/false) {}

  std::string name() const override {
    return "HybridParallelPlugin";
  }
  std::vector<std::string> supported_devices() const override {
    return {"cpu", "cuda"};
  }
  std::vector<std::string> supported_precisions() const override {
    return {"fp16", "bf16", "fp32"};
  }
  bool control_precision() const override {
    return true;
  }
  std::string precision() const override {
    return options_.precision();
  }
  bool control_device() const override {
    return true;
  }
  bool support_no_sync() const override {
    return options_.zero_stage() < 2;
  }
  bool shards_lazy_models() const override {
    return true;
  }
  /// As in ColossalAI, LoRA needs tp_size 1 (adapters are not
  /// tensor-parallel) and pp_size 1 (a pipeline stage's forward bypasses the
  /// wrapper that refreshes reparametrised layers).
  bool support_lora() const override {
    return options_.tp_size() == 1 && options_.pp_size() == 1 &&
        options_.ep_size() == 1;
  }
  std::string lora_refusal() const override;
  bool control_checkpoint_io() const override {
    return true;
  }
  std::shared_ptr<checkpoint_io::CheckpointIO> get_checkpoint_io() override;
  void configure(
      std::shared_ptr<interface::ModelWrapper>& model,
      std::shared_ptr<interface::OptimizerWrapper>& optimizer) override;
  NoSyncGuard no_sync(
      interface::ModelWrapper& model,
      interface::OptimizerWrapper* optimizer) override;
  bool support_pipeline() const override {
    return options_.pp_size() > 1;
  }
  pipeline::PipelineOutput execute_pipeline(
      const pipeline::DataIterator& data_iter,
      interface::ModelWrapper& model,
      const pipeline::PipelineCriterion& criterion,
      interface::OptimizerWrapper* optimizer,
      bool return_loss,
      bool return_outputs) override;

  const HybridParallelPluginOptions& options() const {
    return options_;
  }
  int tp_size() const {
    return options_.tp_size();
  }
  int sp_size() const {
    return sp_size_;
  }
  const distributed::ProcessGroupPtr& tp_group() const {
    return tp_group_;
  }
  const distributed::ProcessGroupPtr& sp_group() const {
    return sp_group_;
  }
  const distributed::ProcessGroupPtr& pp_group() const {
    return pp_group_;
  }
  /// The pipeline's stage manager and schedule (null with pp_size 1, or
  /// before boost).
  const std::shared_ptr<pipeline::PipelineStageManager>& stage_manager() const {
    return stage_manager_;
  }
  const std::shared_ptr<pipeline::PipelineSchedule>& schedule() const {
    return schedule_;
  }
  /// The group gradients are averaged over: dp x sp.
  const distributed::ProcessGroupPtr& mixed_dp_group() const {
    return mixed_dp_group_;
  }
  int ep_size() const {
    return options_.ep_size();
  }
  /// The expert-parallel group (ranks splitting the experts; null when
  /// ep_size is 1).
  const distributed::ProcessGroupPtr& ep_group() const {
    return ep_group_;
  }
  /// The ranks holding the same experts, over which their gradients are
  /// averaged (the data-parallel group when ep_size is 1).
  const distributed::ProcessGroupPtr& moe_dp_group() const {
    return moe_dp_group_;
  }
  /// What sharding the boosted model left (specs, partial gradients).
  const shardformer::ShardInfo& shard_info() const {
    return info_;
  }
  /// Where each parameter this rank holds lives over the tensor axis
  /// ("tp") and the pipeline, after `boost` (NOTE [Placement table]).
  const std::shared_ptr<const placement::PlacementTable>& placement() const {
    return placement_;
  }

 protected:
  // `experts`: MoeHybridParallelPlugin (ep_size may exceed 1).
  HybridParallelPlugin(HybridParallelPluginOptions options, bool experts);

 private:
  // NOTE [Parallel steps]
  // configure composes steps over the mesh's groups; each reads what the
  // ones before it built:
  //   apply_tensor_parallel  the policy shards layers in place -> info_
  //   apply_pipeline         this stage's layers kept -> held names
  //   build_placement        PlacementTable: each parameter's Placement
  //                          per mesh axis, stage, tie owner
  //   apply_data_parallel    DDP or ZeRO over dp x sp, reading the table
  //                          (partial gradients, the global norm)
  // The table is the one description later steps, the optimizers and the
  // checkpoint IO read. Expert parallelism (MoeHybridParallelPlugin) is
  // one more step: apply_expert_parallel keeps this rank's experts (the
  // policy set the sparse layers' all-to-all over ep), and
  // apply_data_parallel reduces their gradients over moe_dp, the ranks
  // holding the same experts, the rest over dp x sp.
  //
  // configure's steps, in order (each fills the members it names).
  // Tensor (and sequence) parallelism: shards the layers as the policy
  // says (info_, policy_; the policy also splits the experts over ep).
  void apply_tensor_parallel(torch::nn::Module& module);
  // Splits the model over the stages: the names of this rank's layers'
  // parameters (stage_manager_, schedule_, chunk_layers_, chunk_params_,
  // shared_params_, each parameter's stage in state_->owner).
  std::set<std::string> apply_pipeline(torch::nn::Module& module);
  // Leaves out of `held` (every parameter, or this stage's) the experts
  // other expert-parallel ranks hold.
  void apply_expert_parallel(
      torch::nn::Module& module,
      std::set<std::string>& held);
  // Under pipelines or expert parallelism: releases the parameters this
  // rank does not hold (storage freed, no gradient, out of the optimizer,
  // as ColossalAI's shardformer does) and records the parts checkpoints
  // write (state_).
  void release_other_parts(
      torch::nn::Module& module,
      interface::OptimizerWrapper& optimizer,
      const std::set<std::string>& held);
  // Where each held parameter lives (placement_, NOTE [Placement table]),
  // and the optimizer's parameters by id for checkpoints.
  void build_placement(
      torch::nn::Module& module,
      const std::set<std::string>& held,
      interface::OptimizerWrapper& optimizer);
  // Data parallelism over dp x sp: DDP with bf16 autocast and the naive
  // optimizer at zero_stage 0, LowLevelZero above (ddp_, guard_,
  // state_->zero).
  void apply_data_parallel(
      std::shared_ptr<interface::ModelWrapper>& model,
      std::shared_ptr<interface::OptimizerWrapper>& optimizer);
  void sync_shared_grads();
  // The handles configure kept, when `model` / `optimizer` are the boosted
  // ones (pointer comparisons, no type lookups on the step path); else null.
  detail::PipelineGuardModel* boosted_guard(
      interface::ModelWrapper& model) const;
  TorchDDPModel* boosted_ddp(interface::ModelWrapper& model) const;
  // The ZeRO optimizer is the one the checkpoint IO shares (state_->zero).
  zero::LowLevelZeroOptimizer* boosted_zero(
      interface::OptimizerWrapper* optimizer) const;

  HybridParallelPluginOptions options_;
  at::ScalarType dtype_;
  shardformer::SequenceParallelMode sp_mode_ =
      shardformer::SequenceParallelMode::kNone;
  int sp_size_ = 1;
  distributed::ProcessGroupPtr tp_group_, sp_group_, mixed_dp_group_, pp_group_;
  distributed::ProcessGroupPtr ep_group_, moe_dp_group_;
  int pp_axis_ = 1, ep_axis_ = -1;
  // This rank's expert parameters (reduced over moe_dp_group_).
  std::vector<at::Tensor> expert_params_;
  shardformer::ShardInfo info_;
  std::shared_ptr<const placement::PlacementTable> placement_;
  std::shared_ptr<HybridState> state_; // shared with the checkpoint IO
  // The wrappers configure built (null where it built none).
  std::weak_ptr<detail::PipelineGuardModel> guard_;
  std::weak_ptr<TorchDDPModel> ddp_;
  // Pipelines: the stage split, the schedule and the parameters both the
  // first and the last stage hold (their group, when they are two ranks).
  std::shared_ptr<pipeline::PipelineStageManager> stage_manager_;
  std::shared_ptr<pipeline::PipelineSchedule> schedule_;
  std::shared_ptr<shardformer::Policy> policy_;
  std::vector<shardformer::StageLayers> chunk_layers_;
  std::vector<std::vector<at::Tensor>> chunk_params_;
  std::vector<at::Tensor> shared_params_;
  distributed::ProcessGroupPtr shared_group_;
  bool configured_ = false;
};

} // namespace plugin
} // namespace booster
} // namespace colossalai
