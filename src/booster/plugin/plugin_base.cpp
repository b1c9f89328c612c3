#include <colossalai/booster/plugin/dp_plugin_base.h>

namespace colossalai {
namespace booster {
namespace plugin {

std::shared_ptr<checkpoint_io::CheckpointIO> Plugin::get_checkpoint_io() {
  unsupported("checkpoint IO");
}

NoSyncGuard Plugin::no_sync(
    interface::ModelWrapper&,
    interface::OptimizerWrapper*) {
  unsupported("no_sync");
}

pipeline::PipelineOutput Plugin::execute_pipeline(
    const pipeline::DataIterator&,
    interface::ModelWrapper&,
    const pipeline::PipelineCriterion&,
    interface::OptimizerWrapper*,
    bool,
    bool) {
  unsupported(
      "execute_pipeline (pipeline parallelism: HybridParallelPlugin with "
      "pp_size > 1)");
}

std::shared_ptr<torch::nn::Module> Plugin::enable_lora(
    std::shared_ptr<torch::nn::Module>,
    const std::string&) {
  unsupported("LoRA");
}

void Plugin::unsupported(const std::string& feature) const {
  TORCH_CHECK(false, name(), " does not support ", feature);
}

DPPluginBase::DPPluginBase() {
  TORCH_CHECK(
      distributed::is_initialized(),
      "data-parallel plugins need the ",
      "distributed runtime: call colossalai::launch() or "
      "colossalai::launch_from_env() before creating the plugin");
  mesh_ = std::make_unique<cluster::ProcessGroupMesh>(
      std::vector<int>{distributed::get_world_size()});
  dp_group_ = mesh_->get_group_along_axis(0);
}

} // namespace plugin
} // namespace booster
} // namespace colossalai
