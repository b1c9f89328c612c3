#pragma once

#include <colossalai/interface/model.h>
#include <colossalai/interface/optimizer.h>
#include <colossalai/utils/compat.h>

#include <memory>
#include <optional>
#include <string>

namespace colossalai {
namespace booster {
namespace mixed_precision {

/// A mixed-precision policy the Booster applies when the plugin does not
/// control precision itself (`colossalai.booster.mixed_precision`).
class MixedPrecision {
 public:
  virtual ~MixedPrecision() = default;
  virtual std::string name() const = 0;
  /// The device type whose autocast it drives: the one it was built with,
  /// else the Booster's (`bind_device`).
  std::optional<at::DeviceType> device_type() const {
    return device_;
  }
  /// Adopts the Booster's device type when none was given; a policy built
  /// for another device type is an error naming both (autocast on the wrong
  /// device would silently change nothing).
  void bind_device(at::DeviceType device);
  /// Wraps the boosted model and optimizer (either may be null).
  virtual void configure(
      std::shared_ptr<interface::ModelWrapper>& model,
      std::shared_ptr<interface::OptimizerWrapper>& optimizer) = 0;

 protected:
  explicit MixedPrecision(std::optional<at::DeviceType> device)
      : device_(device) {}
  // Set by the constructor or bind_device, before configure.
  std::optional<at::DeviceType> device_;
};

/// Runs the model's forward under autocast to `dtype` on `device`.
class AutocastModel : public interface::ModelWrapper {
 public:
  AutocastModel(
      std::shared_ptr<interface::ModelWrapper> inner,
      at::DeviceType device,
      at::ScalarType dtype);

  at::ScalarType dtype() const {
    return dtype_;
  }

 protected:
  void pre_forward() override;
  void post_forward() noexcept override;

 private:
  at::DeviceType device_;
  at::ScalarType dtype_;
  std::optional<compat::AutocastGuard> guard_;
};

/// "fp16", "bf16", "fp32"/"" (none). Returns null for fp32/none; throws naming
/// the option for anything else or for fp16 on a device that cannot run it.
std::shared_ptr<MixedPrecision> make_mixed_precision(
    const std::string& name,
    at::DeviceType device);

} // namespace mixed_precision
} // namespace booster
} // namespace colossalai
