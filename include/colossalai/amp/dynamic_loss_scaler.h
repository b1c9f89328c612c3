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
/// The state lives on the host until scale_tensor() or update(found_inf)
/// moves it to a device, where it stays: the scale in float32 (as PyTorch's
/// GradScaler keeps it), the rule applied there without a read back, so a
/// step that leaves the overflow verdict on the device never waits for it.
/// From then on scale() and growth_tracker() read the device's values.
///
/// Example:
/// \code
///   DynamicLossScaler scaler(DynamicLossScalerOptions().hysteresis(1));
///   (loss * scaler.scale()).backward();
///   bool inf = ...;  // any non-finite gradient, agreed across ranks
///   if (!inf) { /* unscale by 1 / scale, step */ }
///   scaler.update(inf);
///   // Or on the device, nothing read back:
///   (loss * scaler.scale_tensor(device)).backward();
///   at::Tensor found_inf = ...;  // 0 or 1, a one-element tensor there
///   scaler.update(found_inf);
/// \endcode
class DynamicLossScaler {
 public:
  explicit DynamicLossScaler(DynamicLossScalerOptions options = {});

  /// The scale (a read back where the state is on a device).
  double scale() const;
  void update(bool found_inf);

  /// The scale as a float32 0-dim tensor on `device`, the state moved
  /// there first if it is elsewhere.
  at::Tensor scale_tensor(const at::Device& device);
  /// 1 / scale on `device` (the state moved there): taken in double and
  /// rounded to float32 once, the factor a host-side 1.0 / scale() is.
  at::Tensor inv_scale_tensor(const at::Device& device);
  /// The update rule on found_inf's device (the state moved there first):
  /// `found_inf` a one-element tensor, nonzero where the step overflowed;
  /// nothing is read back.
  void update(const at::Tensor& found_inf);
  /// Whether the state lives on a device (scale_tensor / update(tensor)).
  bool on_device() const {
    return scale_t_.defined();
  }
  /// Whether the state lives on `device`.
  bool lives_on(const at::Device& device) const {
    return on_device() && scale_t_.device() == device;
  }
  /// `loss` (in float32) times the scale: by the tensor where the state
  /// lives on loss's device, else by its value (read where the state is
  /// elsewhere: free from the CPU, where offloaded shards keep it).
  at::Tensor scale_loss(const at::Tensor& loss) const;

  /// Clean steps since the last overflow or growth (a read back where the
  /// state is on a device).
  int64_t growth_tracker() const;
  const DynamicLossScalerOptions& options() const {
    return options_;
  }

 private:
  void to_device(const at::Device& device);

  DynamicLossScalerOptions options_;
  // On the host until to_device; then only the tensors hold the state.
  double scale_;
  int64_t growth_tracker_ = 0;
  int64_t hysteresis_left_;
  at::Tensor scale_t_; // float32 0-dim
  at::Tensor growth_tracker_t_; // int64 0-dim
  at::Tensor hysteresis_left_t_; // int64 0-dim
};

/// Whether any of `tensors` (undefined ones skipped) holds an inf or nan,
/// as a one-element float tensor (1 or 0) on their device: one host sync
/// for all of them, none until the caller reads it.
at::Tensor any_non_finite(const std::vector<at::Tensor>& tensors);

/// Multiplies each of `grads` (undefined ones skipped, all on inv_scale's
/// device) by `inv_scale` (a float32 one-element tensor) and returns
/// whether any of them held an inf or nan, as a float32 0-dim tensor (1 or
/// 0) on that device: nothing is read back. On a GPU one multi-tensor pass
/// (ATen's _amp_foreach_non_finite_check_and_unscale_, what PyTorch's
/// GradScaler calls).
at::Tensor unscale_and_check_(
    const std::vector<at::Tensor>& grads,
    const at::Tensor& inv_scale);

} // namespace amp
} // namespace colossalai
