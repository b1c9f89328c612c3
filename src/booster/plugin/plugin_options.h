#pragma once

// Option conversions shared by the plugins (internal).

#include <colossalai/amp/dynamic_loss_scaler.h>
#include <colossalai/interface/model.h>

#include <ATen/ATen.h>

#include <string>

namespace colossalai {
namespace booster {
namespace plugin {
namespace detail {

/// "fp32", "bf16", "fp16" -> dtype; "" -> fp32 when `allow_empty`. Errors
/// name the plugin and the option.
inline at::ScalarType parse_precision(
    const std::string& name,
    const char* plugin,
    const char* option,
    bool allow_empty = false) {
  if (name == "fp32")
    return at::kFloat;
  if (name == "bf16")
    return at::kBFloat16;
  if (name == "fp16")
    return at::kHalf;
  TORCH_CHECK(
      allow_empty && name.empty(),
      plugin,
      ": ",
      option,
      " must be 'fp16', 'bf16' or 'fp32', got '",
      name,
      "'");
  return at::kFloat;
}

/// The dynamic loss scaler of a plugin whose options carry ColossalAI's
/// scaler fields (initial_scale, min_scale, ... hysteresis).
template <class PluginOptions>
amp::DynamicLossScalerOptions loss_scaler_options(const PluginOptions& o) {
  return amp::DynamicLossScalerOptions()
      .initial_scale(o.initial_scale())
      .min_scale(o.min_scale())
      .max_scale(o.max_scale())
      .growth_factor(o.growth_factor())
      .backoff_factor(o.backoff_factor())
      .growth_interval(o.growth_interval())
      .hysteresis(o.hysteresis());
}

/// Runs the module in a plugin's working dtype: floating inputs are cast to
/// it (ZeRO and HybridParallel keep bf16 / fp16 weights).
class CastInputModel : public interface::ModelWrapper {
 public:
  /// `cast` false: inputs pass as given (LowLevelZeroPlugin's cast_inputs).
  CastInputModel(
      std::shared_ptr<interface::ModelWrapper> inner,
      at::ScalarType dtype,
      bool cast = true)
      : interface::ModelWrapper(std::move(inner)), dtype_(dtype), cast_(cast) {}

 protected:
  at::Tensor transform_input(const at::Tensor& x) override {
    // An undefined tensor (an optional argument left out) passes as is.
    return cast_ && x.defined() && x.is_floating_point() &&
            x.scalar_type() != dtype_
        ? x.to(dtype_)
        : x;
  }

 private:
  at::ScalarType dtype_;
  bool cast_;
};

} // namespace detail
} // namespace plugin
} // namespace booster
} // namespace colossalai
