#include <colossalai/amp/grad_scaler.h>

#include <limits>

namespace colossalai {
namespace amp {

DynamicLossScaler::DynamicLossScaler(DynamicLossScalerOptions options)
    : options_(options),
      scale_(options.initial_scale()),
      hysteresis_left_(options.hysteresis()) {
  TORCH_CHECK(
      options_.initial_scale() > 0, "loss scaler: initial_scale must be > 0");
  TORCH_CHECK(
      options_.min_scale() >= 0 &&
          options_.min_scale() <= options_.initial_scale() &&
          options_.initial_scale() <= options_.max_scale(),
      "loss scaler: need 0 <= min_scale <= initial_scale <= max_scale, got ",
      options_.min_scale(),
      ", ",
      options_.initial_scale(),
      ", ",
      options_.max_scale());
  TORCH_CHECK(
      options_.growth_factor() > 1.0, "loss scaler: growth_factor must be > 1");
  TORCH_CHECK(
      options_.backoff_factor() > 0 && options_.backoff_factor() < 1,
      "loss scaler: backoff_factor must be in (0, 1)");
  TORCH_CHECK(
      options_.growth_interval() > 0,
      "loss scaler: growth_interval must be > 0");
  TORCH_CHECK(
      options_.hysteresis() >= 1, "loss scaler: hysteresis must be >= 1");
}

void DynamicLossScaler::update(bool found_inf) {
  if (found_inf) {
    growth_tracker_ = 0;
    if (--hysteresis_left_ <= 0) {
      scale_ =
          std::max(scale_ * options_.backoff_factor(), options_.min_scale());
      hysteresis_left_ = options_.hysteresis();
    }
  } else if (++growth_tracker_ == options_.growth_interval()) {
    scale_ = std::min(scale_ * options_.growth_factor(), options_.max_scale());
    growth_tracker_ = 0;
    hysteresis_left_ = options_.hysteresis();
  }
}

at::Tensor any_non_finite(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flags;
  for (const auto& t : tensors) {
    if (t.defined() && t.numel() > 0) {
      flags.push_back(t.isfinite().all().logical_not());
    }
  }
  if (flags.empty()) {
    return at::zeros({1}, at::kFloat);
  }
  // Partly offloaded shards put gradients on two devices: gather the flags
  // where the first one is.
  for (auto& f : flags) {
    f = f.to(flags.front().device());
  }
  return at::stack(flags).any().to(at::kFloat).reshape({1});
}

GradScaler::GradScaler(GradScalerOptions options)
    : options_(options), scaler_([&] {
        // torch.cuda.amp.GradScaler: back off on every overflow, no bounds.
        return DynamicLossScalerOptions()
            .initial_scale(options.init_scale())
            .min_scale(0.0)
            .max_scale(std::numeric_limits<double>::infinity())
            .growth_factor(options.growth_factor())
            .backoff_factor(options.backoff_factor())
            .growth_interval(options.growth_interval())
            .hysteresis(1);
      }()) {}

at::Tensor GradScaler::scale(const at::Tensor& loss) const {
  // fp32 multiply: the scale (2^16 and up) must not overflow an fp16 loss.
  return loss.to(at::kFloat) * scaler_.scale();
}

bool GradScaler::unscale_(const std::vector<at::Tensor>& params) {
  if (unscaled_) {
    return found_inf_;
  }
  unscaled_ = true;
  const double inv = 1.0 / scaler_.scale();
  std::vector<at::Tensor> grads;
  for (auto& p : params) {
    if (p.grad().defined()) {
      grads.push_back(p.grad());
    }
  }
  auto flag = any_non_finite(grads);
  for (auto& g : grads) {
    g.mul_(inv);
  }
  found_inf_ = flag.item<float>() > 0;
  return found_inf_;
}

void GradScaler::update() {
  scaler_.update(found_inf_);
  unscaled_ = false;
  found_inf_ = false;
}

} // namespace amp
} // namespace colossalai
