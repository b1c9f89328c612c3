#pragma once

#include <colossalai/amp/grad_scaler.h>
#include <colossalai/booster/mixed_precision/mixed_precision_base.h>
#include <colossalai/nn/optimizer/skips_step_on_device.h>

namespace colossalai {
namespace booster {
namespace mixed_precision {

/// The optimizer side of fp16 autocast training: scales the loss in
/// backward, unscales and checks the gradients for inf/nan before step or
/// clipping, skips the step on overflow and updates the scale.
///
/// Over an optimizer that skips on the device (nn::optimizer::FusedAdamW,
/// FusedAdam, HybridAdam: SkipsStepOnDevice) a step reads nothing back: the verdict
/// and the scale stay on the device, and the host learns the verdict at
/// the next step (or last_step_skipped, synchronize_step), when it takes
/// back a skipped step's step counts. Over any other optimizer the verdict
/// is read on the host before the step, as ColossalAI's does.
///
/// Such a step can be captured in a CUDA graph (booster::GraphedStep) over
/// FusedAdamW / FusedAdam: the captured step scales, unscales, skips and
/// updates the scale on the device, and before each replay the host reads
/// the previous replay's verdict (prepare_graph_step), which waits for that
/// replay to end: the device idles between replays for as long as the
/// host prepares the next (the step counts the replay's bias corrections
/// use depend on that verdict).
class TorchAMPOptimizer : public interface::OptimizerWrapper {
 public:
  TorchAMPOptimizer(
      std::shared_ptr<torch::optim::Optimizer> optim,
      amp::GradScalerOptions options = {});

  void backward(const at::Tensor& loss, bool retain_graph = false) override;
  at::Tensor scale_loss(const at::Tensor& loss) override;
  /// Returns after updating the scale; the step is skipped on overflow (see
  /// `last_step_skipped`).
  void step() override;
  void synchronize_step() override;
  double clip_grad_by_norm(double max_norm, double norm_type = 2.0) override;
  /// Over an optimizer that skips on the device (as step()); refused over
  /// others, whose gradients are unscaled after a host-side overflow check.
  at::Tensor clip_grad_by_norm_tensor(double max_norm, double norm_type = 2.0)
      override;
  void clip_grad_by_value(double clip_value) override;
  /// Refused over an optimizer that cannot skip on the device.
  std::string graph_capture_blocker() const override;
  /// Reads a pending verdict before the mode changes.
  void set_graph_mode(bool on) override;
  /// Reads the previous replay's verdict (waiting for that replay), then
  /// the optimizer's host half.
  void prepare_graph_step() override;
  /// Queues the replay's verdict for the next prepare_graph_step.
  void after_graph_replay() override;

  /// Whether the last step was skipped (waits for a verdict left on the
  /// device).
  bool last_step_skipped() {
    synchronize_step();
    return last_step_skipped_;
  }
  amp::GradScaler& scaler() {
    return scaler_;
  }

 private:
  amp::GradScaler scaler_;
  bool last_step_skipped_ = false;
  // Steps that skip on the device: their verdicts, read at the next step.
  nn::optimizer::DeviceVerdict verdict_;
};

/// ColossalAI's "fp16" mixed precision: fp16 autocast + dynamic loss scaling
/// (init_scale 2^16, growth_factor 2, backoff_factor 0.5, growth_interval
/// 2000). Needs CUDA: CPU LibTorch cannot multiply fp16 matrices.
///
/// Example (the scaler's options, as `FP16TorchMixedPrecision(init_scale=...)`):
/// \code
///   auto fp16 = std::make_shared<FP16TorchMixedPrecision>(
///       amp::GradScalerOptions().init_scale(1024).growth_interval(100));
///   Booster booster(BoosterOptions().plugin(plugin).mixed_precision(fp16));
/// \endcode
class FP16TorchMixedPrecision : public MixedPrecision {
 public:
  /// `device`: unset follows the Booster's device (which must be CUDA).
  explicit FP16TorchMixedPrecision(
      amp::GradScalerOptions options = {},
      std::optional<at::DeviceType> device = std::nullopt);
  std::string name() const override {
    return "fp16";
  }
  void configure(
      std::shared_ptr<interface::ModelWrapper>& model,
      std::shared_ptr<interface::OptimizerWrapper>& optimizer) override;

 private:
  amp::GradScalerOptions options_;
};

} // namespace mixed_precision
} // namespace booster
} // namespace colossalai
