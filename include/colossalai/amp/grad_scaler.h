#pragma once

#include <colossalai/amp/dynamic_loss_scaler.h>

#include <ATen/ATen.h>
#include <torch/arg.h>

#include <vector>

namespace colossalai {
namespace amp {

/// Options of the dynamic loss scaler, with torch.cuda.amp.GradScaler's
/// meaning and the defaults ColossalAI's fp16 mixed precision uses.
struct GradScalerOptions {
  TORCH_ARG(double, init_scale) = 65536.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 2000;
};

/// Dynamic loss scaling for fp16 training: the loss is multiplied by `scale`
/// before backward; gradients are divided by it before the step; a step whose
/// gradients hold inf/nan is skipped and the scale backs off; after
/// `growth_interval` clean steps the scale grows. The update rule is
/// `DynamicLossScaler`'s with hysteresis 1 and no bounds.
///
/// unscale_ reads the verdict on the host. unscale_on_device_ leaves it on
/// the device for an optimizer that skips there (PyTorch's fused
/// optimizers' found_inf): from then on the scale lives on the device and
/// scale(), unscale and update() read nothing back.
///
/// Example:
/// \code
///   GradScaler scaler;
///   scaler.scale(loss).backward();
///   if (!scaler.unscale_(params)) optimizer.step();  // false: no overflow
///   scaler.update();
/// \endcode
class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  /// The loss times the scale, in float32 (DynamicLossScaler::scale_loss).
  at::Tensor scale(const at::Tensor& loss) const;
  /// Divides the gradients by the scale (once per step) and returns whether
  /// any of them is inf or nan.
  bool unscale_(const std::vector<at::Tensor>& params);
  /// unscale_ without a read back: the gradients (all on one device)
  /// divided by the scale there, and the verdict returned as a float32
  /// 0-dim tensor on that device (1: some gradient is inf or nan). Once per
  /// step, as unscale_ (after it, its verdict as a tensor).
  at::Tensor unscale_on_device_(const std::vector<at::Tensor>& params);
  /// Whether the current step saw an overflow (after unscale_; a read back
  /// after unscale_on_device_).
  bool found_inf() const;
  /// Adjusts the scale after a step (skipped or not) and resets the step
  /// state; on the device where unscale_on_device_ gave the verdict.
  void update();

  /// The scale (a read back once it lives on a device).
  double get_scale() const {
    return scaler_.scale();
  }
  int64_t growth_tracker() const {
    return scaler_.growth_tracker();
  }
  /// Whether the scale lives on `device` (DynamicLossScaler::lives_on).
  bool scale_lives_on(const at::Device& device) const {
    return scaler_.lives_on(device);
  }
  const GradScalerOptions& options() const {
    return options_;
  }

 private:
  GradScalerOptions options_;
  DynamicLossScaler scaler_;
  bool unscaled_ = false;
  bool found_inf_ = false;
  at::Tensor device_found_inf_; // unscale_on_device_'s verdict
};

} // namespace amp
} // namespace colossalai
