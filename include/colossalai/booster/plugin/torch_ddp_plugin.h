#pragma once

#include <colossalai/booster/plugin/dp_plugin_base.h>

#include <torch/arg.h>

namespace colossalai {
namespace booster {
namespace plugin {

/// Options of TorchDDPPlugin, with the meaning and defaults of ColossalAI's
/// (and torch DistributedDataParallel's).
struct TorchDDPPluginOptions {
  /// Broadcast rank 0's buffers (e.g. BatchNorm statistics) before every
  /// forward.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// Gradient bucket size in MiB; the first bucket is 1 MiB so communication
  /// starts early in backward.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Parameters that get no gradient in an iteration are reduced as zeros;
  /// without this, such a parameter is an error that names it.
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// Kept for API compatibility; deprecated in PyTorch and a no-op there too.
  TORCH_ARG(bool, check_reduction) = false;
  /// Gradients become views into the communication buckets (saves one copy
  /// and the gradients' memory).
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  /// The set of used parameters does not change between iterations: with
  /// find_unused_parameters, it is computed once and the per-iteration
  /// exchange of the used-parameter bitmap is skipped.
  TORCH_ARG(bool, static_graph) = false;
  /// Gradients all-reduce through FP8 (e5m2) where the group spans more
  /// than one node (quantization/fp8.h: a quarter of float32's bytes; each
  /// gradient within 2^-3 of itself after the sum, and the same on every
  /// rank). Needs LibTorch 2.1 or later.
  TORCH_ARG(bool, fp8_communication) = false;
};

/// Data parallelism with gradient all-reduce overlapped with backward
/// (PyTorch DDP's design, on LibTorch + c10d).
///
/// Example:
/// \code
///   colossalai::launch_from_env();
///   auto plugin = std::make_shared<TorchDDPPlugin>(
///       TorchDDPPluginOptions().bucket_cap_mb(25));
///   Booster booster(BoosterOptions().plugin(plugin));
///   auto boosted = booster.boost(model, optimizer);
/// \endcode
class TorchDDPPlugin : public DPPluginBase {
 public:
  explicit TorchDDPPlugin(TorchDDPPluginOptions options = {});

  std::string name() const override {
    return "TorchDDPPlugin";
  }
  std::vector<std::string> supported_devices() const override {
    return {"cpu", "cuda"};
  }
  std::vector<std::string> supported_precisions() const override {
    return {"fp16", "bf16", "fp32"};
  }
  bool control_precision() const override {
    return false;
  }
  bool control_device() const override {
    return true;
  }
  bool support_no_sync() const override {
    return true;
  }
  bool support_lora() const override {
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

  const TorchDDPPluginOptions& options() const {
    return options_;
  }

 private:
  TorchDDPPluginOptions options_;
};

} // namespace plugin
} // namespace booster
} // namespace colossalai
