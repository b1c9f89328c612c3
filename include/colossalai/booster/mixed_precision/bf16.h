#pragma once

#include <colossalai/booster/mixed_precision/mixed_precision_base.h>

namespace colossalai {
namespace booster {
namespace mixed_precision {

/// bf16 autocast: matmuls and convolutions run in bf16, parameters and
/// gradients stay fp32. No loss scaling (bf16 has fp32's exponent range).
class BF16MixedPrecision : public MixedPrecision {
 public:
  /// `device`: unset follows the Booster's device.
  explicit BF16MixedPrecision(
      std::optional<at::DeviceType> device = std::nullopt)
      : MixedPrecision(device) {}
  std::string name() const override {
    return "bf16";
  }
  void configure(
      std::shared_ptr<interface::ModelWrapper>& model,
      std::shared_ptr<interface::OptimizerWrapper>& optimizer) override;
};

} // namespace mixed_precision
} // namespace booster
} // namespace colossalai
