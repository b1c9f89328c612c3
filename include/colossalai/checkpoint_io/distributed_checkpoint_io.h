#pragma once

#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/distributed/process_group.h>

#include <functional>
#include <memory>
#include <string>

namespace colossalai {
namespace checkpoint_io {

/// Checkpoint IO of a data-parallel group, composed of three parts: the
/// formats (GeneralCheckpointIO's files, which any world size and plugin
/// loads), who writes (rank 0 of `group`, with a barrier after each save and
/// before each load so no reader sees half-written files; or, where `access`
/// names part writers, one rank per pipeline stage writing its own shards in
/// parallel under one index) and how state is reached (`access`). Every
/// plugin returns one of these.
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
  void load_in_model_scope(
      interface::ModelWrapper& model,
      const std::function<void()>& load) override;
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
  c10::impl::GenericList optimizer_param_groups(
      interface::OptimizerWrapper& optimizer) override;
  void load_optimizer_groups(
      interface::OptimizerWrapper& optimizer,
      const c10::IValue& groups,
      const std::string& file) override;
  int num_parts() override;
  int my_part() override;
  void stream_model_part(interface::ModelWrapper& model, const TensorSink& sink)
      override;
  void stream_optimizer_part(
      interface::OptimizerWrapper& optimizer,
      const StateSink& sink) override;
  std::vector<std::string> exchange(const std::string& bytes) override;

 private:
  distributed::ProcessGroupPtr group_;
  std::shared_ptr<StateAccess> access_;
};

} // namespace checkpoint_io
} // namespace colossalai
