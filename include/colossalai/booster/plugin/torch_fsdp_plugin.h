#pragma once

#include <colossalai/booster/plugin/dp_plugin_base.h>
#include <colossalai/zero/fully_sharded.h>

namespace colossalai {
namespace booster {
namespace plugin {

/// Options of TorchFSDPPlugin: PyTorch FSDP's (as ColossalAI passes them
/// through), with mixed_precision as param_dtype / reduce_dtype /
/// buffer_dtype and cpu_offload as a flag. See zero::FullyShardedOptions.
using TorchFSDPPluginOptions = zero::FullyShardedOptions;

/// Fully sharded data parallelism (ZeRO-3): parameters, gradients and
/// optimizer states sharded over the data-parallel ranks; each unit's
/// parameters are gathered just before it computes. See NOTE [FSDP units] for
/// how units are declared in C++ (the whole model by default; finer units
/// from `auto_wrap_policy` over modules that derive from
/// `colossalai::nn::HookableModule`, such as the GPT-2 blocks of
/// `colossalai::models`).
///
/// Checkpoints hold full tensors (rank 0 writes; sharded files are the
/// size-limited Hugging Face layout), so they load at any world size and
/// under every other plugin, and theirs load here.
///
/// no_sync keeps full gradients on every rank until the next synchronized
/// backward: it costs one full gradient (4 bytes per parameter in fp32) per
/// rank, which is what sharding gradients saves.
///
/// Example:
/// \code
///   namespace cz = colossalai::zero;
///   using colossalai::models::GPT2BlockImpl;
///   auto plugin = std::make_shared<TorchFSDPPlugin>(
///       TorchFSDPPluginOptions()
///           .auto_wrap_policy(cz::module_type_wrap_policy<GPT2BlockImpl>())
///           .param_dtype(at::kBFloat16)
///           .reduce_dtype(at::kFloat));
///   Booster booster(BoosterOptions().plugin(plugin));
///   auto boosted = booster.boost(model, optimizer, criterion);
/// \endcode
class TorchFSDPPlugin : public DPPluginBase {
 public:
  explicit TorchFSDPPlugin(TorchFSDPPluginOptions options = {});

  std::string name() const override {
    return "TorchFSDPPlugin";
  }
  std::vector<std::string> supported_devices() const override {
    return {"cpu", "cuda"};
  }
  /// Precision is set with the options' param_dtype; a Booster
  /// mixed_precision that differs is refused so it cannot be ignored.
  std::vector<std::string> supported_precisions() const override {
    return {"fp16", "bf16", "fp32"};
  }
  bool control_precision() const override {
    return true;
  }
  std::string precision() const override;
  bool control_device() const override {
    return true;
  }
  bool support_no_sync() const override {
    return true;
  }
  bool shards_lazy_models() const override {
    return true;
  }
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

  const TorchFSDPPluginOptions& options() const {
    return options_;
  }

 private:
  TorchFSDPPluginOptions options_;
};

} // namespace plugin
} // namespace booster
} // namespace colossalai
