#include "fully_sharded_parts.h"

#include <colossalai/checkpoint_io/distributed_checkpoint_io.h>

namespace colossalai {
namespace booster {
namespace plugin {
namespace detail {

namespace {

zero::FullyShardedModel& fsdp_of(
    interface::ModelWrapper& model,
    const std::string& plugin) {
  auto* m = interface::find_wrapper<zero::FullyShardedModel>(model);
  TORCH_CHECK(
      m != nullptr, plugin, " checkpoints need the model the plugin boosted");
  return *m;
}

zero::FullyShardedOptimizer& fsdp_of(
    interface::OptimizerWrapper& o,
    const std::string& plugin) {
  auto* z = dynamic_cast<zero::FullyShardedOptimizer*>(&o);
  TORCH_CHECK(
      z != nullptr,
      plugin,
      " checkpoints need the optimizer the plugin boosted");
  return *z;
}

// Full tensors in the GeneralCheckpointIO layout: each unit's full fp32
// value is gathered to rank 0 alone and written a shard file at a time
// (NOTE [Streamed sharded saves]); loading writes this rank's range back
// into its shards.
class FsdpStateAccess : public checkpoint_io::StateAccess {
 public:
  explicit FsdpStateAccess(std::string plugin) : plugin_(std::move(plugin)) {}

  void stream_model(
      interface::ModelWrapper& model,
      const checkpoint_io::TensorSink& sink) override {
    fsdp_of(model, plugin_).stream_full_state(sink);
  }
  void stream_optimizer(
      interface::OptimizerWrapper& optimizer,
      const checkpoint_io::StateSink& sink) override {
    fsdp_of(optimizer, plugin_).stream_full_states(sink);
  }
  void load_model(
      interface::ModelWrapper& model,
      const std::function<void()>& load) override {
    auto full = fsdp_of(model, plugin_).summon_full_params(/*writeback=*/true);
    load();
  }
  void load_optimizer_param(
      interface::OptimizerWrapper& optimizer,
      int64_t id,
      const checkpoint_io::StateDict& state,
      const std::string& file) override {
    fsdp_of(optimizer, plugin_).load_full_state(id, state, file);
  }

 private:
  std::string plugin_;
};

} // namespace

void shard_fully(
    std::shared_ptr<interface::ModelWrapper>& model,
    std::shared_ptr<interface::OptimizerWrapper>& optimizer,
    const zero::FullyShardedOptions& options,
    const zero::ShardedOptimizerOptions& optimizer_options) {
  auto fsdp = std::make_shared<zero::FullyShardedModel>(model, options);
  if (optimizer != nullptr) {
    optimizer =
        fsdp->shard_optimizer(optimizer->optimizer_ptr(), optimizer_options);
  }
  model = fsdp;
}

std::shared_ptr<checkpoint_io::CheckpointIO> fully_sharded_checkpoint_io(
    distributed::ProcessGroupPtr group,
    const std::string& plugin) {
  return std::make_shared<checkpoint_io::DistributedCheckpointIO>(
      std::move(group), std::make_shared<FsdpStateAccess>(plugin));
}

NoSyncGuard fully_sharded_no_sync(
    interface::ModelWrapper& model,
    const std::string& plugin) {
  auto* m = interface::find_wrapper<zero::FullyShardedModel>(model);
  TORCH_CHECK(m != nullptr, plugin, ".no_sync: pass the boosted model");
  m->set_require_sync(false);
  return NoSyncGuard([m]() { m->set_require_sync(true); });
}

} // namespace detail
} // namespace plugin
} // namespace booster
} // namespace colossalai
