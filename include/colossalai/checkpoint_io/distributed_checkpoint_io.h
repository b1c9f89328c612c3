#pragma once

#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/distributed/process_group.h>

#include <functional>
#include <memory>
#include <string>

namespace colossalai {
namespace checkpoint_io {

/// How a plugin's model and optimizer state reach a checkpoint and come
/// back: the one part of checkpoint IO a sharding plugin changes. The
/// defaults read and write the module's and optimizer's own tensors (one
/// process, DDP); ZeRO and FSDP gather their shards to the writer one bucket
/// or unit at a time and keep their own slice on load.
class StateAccess {
 public:
  virtual ~StateAccess() = default;

  /// Hands the model's full tensors to `sink` (collective where sharded;
  /// the sink may run on the writer only).
  virtual void stream_model(
      interface::ModelWrapper& model,
      const TensorSink& sink);
  /// Hands full per-parameter optimizer states to `sink` (as stream_model).
  virtual void stream_optimizer(
      interface::OptimizerWrapper& optimizer,
      const StateSink& sink);
  /// Runs `load`, which copies checkpoint tensors into the module's own
  /// tensors, in the scope the plugin needs (FSDP: parameters gathered, then
  /// written back to the shards; ZeRO: master weights re-read after).
  virtual void load_model(
      interface::ModelWrapper& model,
      const std::function<void()>& load);
  /// Restores one parameter's full state (a sharding plugin keeps its part).
  virtual void load_optimizer_param(
      interface::OptimizerWrapper& optimizer,
      int64_t id,
      const StateDict& state,
      const std::string& file);
};

/// Checkpoint IO of a data-parallel group, composed of three parts: the
/// formats (GeneralCheckpointIO's files, which any world size and plugin
/// loads), who writes (rank 0 of `group`, with a barrier after each save and
/// before each load so no reader sees half-written files) and how state is
/// reached (`access`). Every data-parallel plugin returns one of these.
///
/// Example:
/// \code
///   auto io = std::make_shared<DistributedCheckpointIO>(
///       distributed::world_group());  // DDP: default StateAccess
///   io->save_model(*boosted.model.wrapper(), "ckpt/model",
///                  SaveModelOptions().shard(true));
/// \endcode
class DistributedCheckpointIO : public GeneralCheckpointIO {
 public:
  explicit DistributedCheckpointIO(
      distributed::ProcessGroupPtr group,
      std::shared_ptr<StateAccess> access = std::make_shared<StateAccess>());

 protected:
  bool is_writer() const override;
  void sync_point() override;
  void stream_model_state(
      interface::ModelWrapper& model,
      const TensorSink& sink) override;
  void stream_optimizer_states(
      interface::OptimizerWrapper& optimizer,
      const StateSink& sink) override;
  void load_unsharded_model(
      interface::ModelWrapper& model,
      const std::string& checkpoint,
      bool strict) override;
  void load_sharded_model(
      interface::ModelWrapper& model,
      const std::string& index_file,
      bool strict) override;
  void load_optimizer_state(
      interface::OptimizerWrapper& optimizer,
      int64_t id,
      const StateDict& state,
      const std::string& file) override;

 private:
  distributed::ProcessGroupPtr group_;
  std::shared_ptr<StateAccess> access_;
};

} // namespace checkpoint_io
} // namespace colossalai
