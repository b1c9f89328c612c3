#include <colossalai/booster/plugin/torch_fsdp_plugin.h>
#include <colossalai/checkpoint_io/distributed_checkpoint_io.h>

namespace colossalai {
namespace booster {
namespace plugin {

namespace {

zero::FullyShardedModel& fsdp_of(interface::ModelWrapper& model) {
  auto* m = interface::find_wrapper<zero::FullyShardedModel>(model);
  TORCH_CHECK(
      m != nullptr,
      "TorchFSDPPlugin checkpoints need the model the plugin boosted");
  return *m;
}

zero::FullyShardedOptimizer& fsdp_of(interface::OptimizerWrapper& o) {
  auto* z = dynamic_cast<zero::FullyShardedOptimizer*>(&o);
  TORCH_CHECK(
      z != nullptr,
      "TorchFSDPPlugin checkpoints need the optimizer the plugin boosted");
  return *z;
}

// Full tensors in the GeneralCheckpointIO layout: each unit's full fp32
// value is gathered to rank 0 alone and written a shard file at a time
// (NOTE [Streamed sharded saves]); loading writes this rank's range back
// into its shards.
class FsdpStateAccess : public checkpoint_io::StateAccess {
 public:
  void stream_model(
      interface::ModelWrapper& model,
      const checkpoint_io::TensorSink& sink) override {
    fsdp_of(model).stream_full_state(sink);
  }
  void stream_optimizer(
      interface::OptimizerWrapper& optimizer,
      const checkpoint_io::StateSink& sink) override {
    fsdp_of(optimizer).stream_full_states(sink);
  }
  void load_model(
      interface::ModelWrapper& model,
      const std::function<void()>& load) override {
    auto full = fsdp_of(model).summon_full_params(/*writeback=*/true);
    load();
  }
  void load_optimizer_param(
      interface::OptimizerWrapper& optimizer,
      int64_t id,
      const checkpoint_io::StateDict& state,
      const std::string& file) override {
    fsdp_of(optimizer).load_full_state(id, state, file);
  }
};

} // namespace

TorchFSDPPlugin::TorchFSDPPlugin(TorchFSDPPluginOptions options)
    : options_(std::move(options)) {
  TORCH_CHECK(
      options_.hybrid_shard_size() >= 0,
      "TorchFSDPPlugin: hybrid_shard_size must be >= 0, got ",
      options_.hybrid_shard_size());
  if (options_.process_group()) {
    dp_group_ = options_.process_group();
  } else {
    options_.process_group(dp_group_);
  }
}

std::shared_ptr<checkpoint_io::CheckpointIO> TorchFSDPPlugin::
    get_checkpoint_io() {
  return std::make_shared<checkpoint_io::DistributedCheckpointIO>(
      dp_group_, std::make_shared<FsdpStateAccess>());
}

void TorchFSDPPlugin::configure(
    std::shared_ptr<interface::ModelWrapper>& model,
    std::shared_ptr<interface::OptimizerWrapper>& optimizer) {
  TORCH_CHECK(model != nullptr, "TorchFSDPPlugin: boost needs a model");
  shard(model, optimizer, {});
}

void TorchFSDPPlugin::shard(
    std::shared_ptr<interface::ModelWrapper>& model,
    std::shared_ptr<interface::OptimizerWrapper>& optimizer,
    const zero::ShardedOptimizerOptions& optimizer_options) {
  auto fsdp = std::make_shared<zero::FullyShardedModel>(model, options_);
  if (optimizer != nullptr) {
    optimizer =
        fsdp->shard_optimizer(optimizer->optimizer_ptr(), optimizer_options);
  }
  model = fsdp;
}

NoSyncGuard TorchFSDPPlugin::no_sync(
    interface::ModelWrapper& model,
    interface::OptimizerWrapper*) {
  auto* m = interface::find_wrapper<zero::FullyShardedModel>(model);
  TORCH_CHECK(m != nullptr, "TorchFSDPPlugin.no_sync: pass the boosted model");
  m->set_require_sync(false);
  return NoSyncGuard([m]() { m->set_require_sync(true); });
}

std::string TorchFSDPPlugin::precision() const {
  switch (options_.param_dtype()) {
    case at::kHalf:
      return "fp16";
    case at::kBFloat16:
      return "bf16";
    default:
      return "fp32";
  }
}

} // namespace plugin
} // namespace booster
} // namespace colossalai
