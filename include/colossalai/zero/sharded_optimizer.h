#pragma once

#include <colossalai/amp/dynamic_loss_scaler.h>
#include <colossalai/checkpoint_io/state_dict.h>
#include <colossalai/distributed/process_group.h>
#include <colossalai/interface/optimizer.h>
#include <colossalai/nn/optimizer/skips_step_on_device.h>

#include <torch/arg.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace colossalai {
namespace nn {
namespace optimizer {
class HybridAdam;
} // namespace optimizer
} // namespace nn
namespace placement {
class PlacementTable;
} // namespace placement
namespace zero {

namespace detail {
struct FlatParams;
class StepsAhead;
} // namespace detail

struct ShardedOptimizerOptions {
  /// Global gradient norm limit applied in step(); 0 disables clipping.
  TORCH_ARG(double, max_norm) = 0.0;
  TORCH_ARG(double, norm_type) = 2.0;
  /// Dynamic loss scaling (fp16); unset: no scaling.
  TORCH_ARG(c10::optional<amp::DynamicLossScalerOptions>, loss_scaler) =
      c10::nullopt;
};

/// The base of every sharded optimizer (ZeRO-1/2, FSDP; Gemini next): the
/// user's optimizer steps this rank's pieces of parameter groups laid out as
/// NOTE [Flat shard layout] describes; this class adds what all of them
/// share: the global gradient norm over every rank's shards, clipping by
/// norm and by value, dynamic loss scaling with the overflow decision agreed
/// across ranks (a step with inf/nan anywhere is skipped everywhere), and
/// full optimizer states gathered from or scattered to pieces.
///
/// Loss scaling reads nothing back where the user's optimizer skips on the
/// device (nn::optimizer::SkipsStepOnDevice: FusedAdamW, FusedAdam) and
/// every gradient it steps lies on the shard group's device: the verdict
/// is agreed across ranks there, the kernel skips there, and the host
/// learns it at the next step (or synchronize_step, last_step_skipped),
/// taking the skipped step's counts back.
class ShardedOptimizer : public interface::OptimizerWrapper {
 public:
  ~ShardedOptimizer() override;

  /// Unscales (fp16), skips on overflow, clips to max_norm, steps the
  /// pieces, then lets the strategy publish the new weights.
  void step() override;
  /// Multiplies the loss by the loss scale (fp16) before backward.
  void backward(const at::Tensor& loss, bool retain_graph = false) override;
  at::Tensor scale_loss(const at::Tensor& loss) override;
  void zero_grad(bool set_to_none = true) override;
  /// Clips by the global norm across every rank's gradient shards.
  double clip_grad_by_norm(double max_norm, double norm_type = 2.0) override;
  /// At one rank without fp16 (a captured step may clip so); refused
  /// elsewhere.
  at::Tensor clip_grad_by_norm_tensor(double max_norm, double norm_type = 2.0)
      override;
  void clip_grad_by_value(double clip_value) override;

  /// Whether the last step was skipped for an inf/nan gradient (waits for
  /// a verdict left on the device).
  bool last_step_skipped() {
    synchronize_step();
    return skipped_;
  }
  void synchronize_step() override;
  /// With fp16 over FusedAdamW / FusedAdam a captured step leaves its
  /// verdict on the device as an eager one does; prepare_graph_step reads
  /// the previous replay's (waiting for it) before the optimizer's host
  /// half, after_graph_replay queues the replay's.
  void set_graph_mode(bool on) override;
  void prepare_graph_step() override;
  void after_graph_replay() override;
  /// The loss scale (1 without loss scaling; a read back once the scale
  /// lives on the device).
  double loss_scale() const;
  /// Flat groups whose new weights the strategy began to publish (upload to
  /// the device) during the last step's host update, while the optimizer
  /// still stepped the others (NOTE [Publishing during the host step]).
  int64_t groups_published_during_step() const {
    return published_during_step_;
  }
  /// Flat groups whose host update the last step took ahead, during the
  /// backward (a plugin's overlap_host_step: NOTE [Host steps overlap the
  /// backward]).
  int64_t groups_stepped_ahead() const {
    return groups_stepped_ahead_;
  }

  /// Receives one parameter's full optimizer state.
  using StateSink =
      std::function<void(int64_t id, const checkpoint_io::StateDict& state)>;
  /// Streams every parameter's full optimizer state to `sink` on rank 0 of
  /// the shard group, one flat group at a time: the pieces of one group are
  /// gathered to that rank only, handed over, and released before the next
  /// (collective: every rank must call it; `sink` runs on rank 0 only). So
  /// no rank ever holds more than one group's full states at once beyond
  /// what the sink keeps.
  void stream_full_states(const StateSink& sink);
  /// Full optimizer states by parameter id on rank 0 of the shard group
  /// (empty elsewhere); collective.
  std::map<int64_t, checkpoint_io::StateDict> full_states();
  /// Where the parameters live beside the shards (HybridParallelPlugin's
  /// tensor axis and pipeline, NOTE [Placement table]): partial gradients
  /// are summed over their axis at the start of step, the global norm
  /// counts each parameter once over the mesh, and the overflow decision
  /// combines every axis and stage.
  void set_placement(std::shared_ptr<const placement::PlacementTable> table);

  /// Keeps this rank's piece of a full state (from any world size or
  /// plugin).
  void load_full_state(
      int64_t id,
      const checkpoint_io::StateDict& state,
      const std::string& file);

 protected:
  ShardedOptimizer(
      std::shared_ptr<torch::optim::Optimizer> optimizer,
      ShardedOptimizerOptions options);

  /// Re-points the optimizer's parameters at the pieces of `groups`
  /// (pointers stay valid for the optimizer's life); `unsharded` are
  /// parameters the optimizer may hold whole (not reduced, not clipped).
  /// `group` shares the shards (null: one rank).
  void shard_param_groups(
      const std::string& plugin,
      std::vector<detail::FlatParams*> groups,
      distributed::ProcessGroupPtr group,
      const std::vector<at::Tensor>& unsharded = {});

  /// After the pieces were updated (the strategy gathers the new weights).
  virtual void after_step() {}
  /// NOTE [Publishing during the host step]
  /// With host master shards (ZeRO's cpu_offload, Gemini's host chunks)
  /// the step is the host's Adam over every shard, then one upload per
  /// group to the device: the copies wait for the whole update, and the
  /// host for the copies. Where the optimizer is HybridAdam, which reports
  /// each host parameter as it finishes it, a group whose host pieces are
  /// all updated is handed to `group_stepped_on_host` at once, so its
  /// (asynchronous, pinned) upload runs while the host updates the next
  /// group; after_step then publishes only what is left. A strategy opts
  /// in with `publishes_during_step`; the override returns whether it
  /// published group k (after_step must then skip it).
  virtual bool publishes_during_step() const {
    return false;
  }
  virtual bool group_stepped_on_host(size_t k) {
    (void)k;
    return false;
  }
  /// In zero_grad, for gradients the strategy keeps beside the shards
  /// (e.g. full gradients accumulated under no_sync).
  virtual void zero_extra_grads(bool set_to_none) {}

  /// Why `plugin`'s step cannot be captured in a CUDA graph for what this
  /// class does on the host (loss scaling, ranks, placement), or empty.
  /// max_norm clips on the device at one rank.
  std::string sharded_graph_blocker(const std::string& plugin) const;

  /// overlap_host_step (NOTE [Host steps overlap the backward]): the
  /// HybridAdam that takes host groups' updates ahead, once what it needs
  /// is checked (HybridAdam, no max_norm, no loss scaling); `plugin` names
  /// the option's owner in the errors. `ahead` is where the strategy notes
  /// the groups it hands over.
  std::shared_ptr<nn::optimizer::HybridAdam> host_step_ahead_optimizer(
      const std::string& plugin,
      std::shared_ptr<detail::StepsAhead> ahead);
  /// At the start of the strategy's step: waits for the updates taken
  /// ahead, makes `device`'s stream wait for their uploads, counts them
  /// (groups_stepped_ahead), and returns the groups whose device copies
  /// the uploads refreshed. Nothing without overlap_host_step.
  std::vector<size_t> finish_steps_ahead(const at::Device& device);

  const std::vector<detail::FlatParams*>& flat_groups() const {
    return groups_;
  }
  const distributed::ProcessGroupPtr& shard_group() const {
    return group_;
  }

 private:
  void unscale();
  bool overflow();
  /// Every group's gradient shard, in group order.
  std::vector<at::Tensor> shard_grads() const;
  double global_norm(double norm_type);
  /// The same left on the device: float32 at one rank (torch's
  /// clip_grad_norm_ arithmetic), else the float64 partials reduced.
  at::Tensor global_norm_on_device(double norm_type);
  void scale_grads(double factor);
  /// The overflow flag of this rank's gradients agreed across every rank
  /// that steps with it (a float32 one-element tensor, 1 or 0, on the
  /// last group's device).
  at::Tensor agreed_overflow(at::Tensor flag);
  /// The user's optimizer, where it can skip this step on the device and
  /// every gradient it steps lies on the shard group's device; else null.
  nn::optimizer::SkipsStepOnDevice* skipping_on_device();
  /// step()'s loss-scaled part with the verdict left on the device.
  void step_skipping_on_device(nn::optimizer::SkipsStepOnDevice& skipping);

  void sum_partial_grads();
  /// The user's optimizer's step, with group_stepped_on_host called as
  /// groups finish where the strategy publishes during the step.
  void step_optimizer();
  /// One rank holds every shard and no placement spreads the model.
  bool one_rank() const;
  /// Refuses `what` while host shards were updated ahead of the coming
  /// step (NOTE [Host steps overlap the backward]).
  void check_none_stepped_ahead(const char* what) const;
  /// After a backward that raised once host shards were updated ahead:
  /// waits for those updates and their uploads (the step stays refused).
  void settle_raised_steps_ahead();
  /// Before loading states over them: settles and forgets those updates.
  void drop_raised_steps_ahead();

  ShardedOptimizerOptions options_;
  std::unique_ptr<amp::DynamicLossScaler> scaler_;
  std::shared_ptr<const placement::PlacementTable> placement_;
  bool partials_summed_ = false;
  std::vector<detail::FlatParams*> groups_;
  distributed::ProcessGroupPtr group_;
  bool unscaled_ = false;
  bool skipped_ = false;
  // Steps that skip on the device: their verdicts, read at the next step.
  nn::optimizer::DeviceVerdict verdict_;
  // Whether this rank's gradients overflowed, taken by unscale(): a float32
  // flag on their device, before any clip.
  at::Tensor local_found_inf_;
  int64_t published_during_step_ = 0;
  int64_t groups_stepped_ahead_ = 0;
  std::shared_ptr<detail::StepsAhead> steps_ahead_; // overlap_host_step
};

} // namespace zero
} // namespace colossalai
