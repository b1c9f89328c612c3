#pragma once

#include <ATen/ATen.h>
#include <torch/arg.h>

#include <vector>

namespace colossalai {
namespace amp {

/// Options of the one dynamic loss scaler every fp16 path uses (the
/// mixed-precision GradScaler, ZeRO, FSDP), with ColossalAI's names; the
/// defaults are its DynamicGradScaler's, bounded as LowLevelZeroPlugin's.
struct DynamicLossScalerOptions {
  TORCH_ARG(double, initial_scale) = 65536.0;
  TORCH_ARG(double, min_scale) = 1.0;
  TORCH_ARG(double, max_scale) = 4294967296.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Clean steps before the scale grows.
  TORCH_ARG(int64_t, growth_interval) = 1000;
  /// Overflowing steps tolerated before the scale backs off (1: at once,
  /// as torch.cuda.amp.GradScaler).
  TORCH_ARG(int64_t, hysteresis) = 2;
};

/// The scale of the loss and its update rule: an overflowing step resets
/// the growth count and, after `hysteresis` of them, multiplies the scale
/// by `backoff_factor` (not below `min_scale`); `growth_interval` clean
/// steps in a row multiply it by `growth_factor` (not above `max_scale`)
/// and restore the hysteresis. Deciding whether a step overflowed (and
/// agreeing on it across ranks) is the caller's part.
///
/// Example:
/// \code
///   DynamicLossScaler scaler(DynamicLossScalerOptions().hysteresis(1));
///   (loss * scaler.scale()).backward();
///   bool inf = ...;  // any non-finite gradient, agreed across ranks
///   if (!inf) { /* unscale by 1 / scale, step */ }
///   scaler.update(inf);
/// \endcode
class DynamicLossScaler {
 public:
  explicit DynamicLossScaler(DynamicLossScalerOptions options = {});

  double scale() const {
    return scale_;
  }
  void update(bool found_inf);

  int64_t growth_tracker() const {
    return growth_tracker_;
  }
  const DynamicLossScalerOptions& options() const {
    return options_;
  }

 private:
  DynamicLossScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
  int64_t hysteresis_left_;
};

/// Whether any of `tensors` (undefined ones skipped) holds an inf or nan,
/// as a one-element float tensor (1 or 0) on their device: one host sync
/// for all of them, none until the caller reads it.
at::Tensor any_non_finite(const std::vector<at::Tensor>& tensors);

} // namespace amp
} // namespace colossalai
