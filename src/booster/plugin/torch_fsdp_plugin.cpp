#include <colossalai/booster/plugin/torch_fsdp_plugin.h>

#include <colossalai/quantization/fp8.h>

#include "fully_sharded_parts.h"

#include <torch/version.h>

namespace colossalai {
namespace booster {
namespace plugin {

TorchFSDPPlugin::TorchFSDPPlugin(TorchFSDPPluginOptions options)
    : options_(std::move(options)) {
  TORCH_CHECK(
      options_.hybrid_shard_size() >= 0,
      "TorchFSDPPlugin: hybrid_shard_size must be >= 0, got ",
      options_.hybrid_shard_size());
  // NOTE [Host steps overlap the backward]: the engine refuses another
  // optimizer than HybridAdam and fp16's loss scaler at boost.
  TORCH_CHECK(
      !options_.overlap_host_step() || options_.cpu_offload() ||
          options_.placement().offload_optim_fraction() > 0,
      "TorchFSDPPlugin: overlap_host_step updates the shards that live on "
      "the host during the backward, and without cpu_offload none does. Set "
      "cpu_offload or turn overlap_host_step off");
  TORCH_CHECK(
      !options_.fp8_communication() || quantization::fp8_supported(),
      "TorchFSDPPlugin: fp8_communication needs LibTorch 2.1 or later (its "
      "float8 dtypes); this is ",
      TORCH_VERSION);
  if (options_.process_group()) {
    dp_group_ = options_.process_group();
  } else {
    options_.process_group(dp_group_);
  }
}

std::shared_ptr<checkpoint_io::CheckpointIO> TorchFSDPPlugin::
    get_checkpoint_io() {
  return detail::fully_sharded_checkpoint_io(dp_group_, name());
}

void TorchFSDPPlugin::configure(
    std::shared_ptr<interface::ModelWrapper>& model,
    std::shared_ptr<interface::OptimizerWrapper>& optimizer) {
  TORCH_CHECK(model != nullptr, "TorchFSDPPlugin: boost needs a model");
  detail::shard_fully(model, optimizer, options_, {});
}

NoSyncGuard TorchFSDPPlugin::no_sync(
    interface::ModelWrapper& model,
    interface::OptimizerWrapper*) {
  return detail::fully_sharded_no_sync(model, name());
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
