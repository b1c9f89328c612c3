#include <colossalai/amp/grad_scaler.h>

namespace colossalai {
namespace amp {

GradScaler::GradScaler(GradScalerOptions options)
    : options_(options), scale_(options.init_scale()) {
  TORCH_CHECK(options_.init_scale() > 0, "GradScaler: init_scale must be > 0");
  TORCH_CHECK(
      options_.growth_factor() > 1.0, "GradScaler: growth_factor must be > 1");
  TORCH_CHECK(
      options_.backoff_factor() > 0 && options_.backoff_factor() < 1,
      "GradScaler: backoff_factor must be in (0, 1)");
  TORCH_CHECK(
      options_.growth_interval() > 0,
      "GradScaler: growth_interval must be > 0");
}

at::Tensor GradScaler::scale(const at::Tensor& loss) const {
  // fp32 multiply: the scale (2^16 and up) must not overflow an fp16 loss.
  return loss.to(at::kFloat) * scale_;
}

bool GradScaler::unscale_(const std::vector<at::Tensor>& params) {
  if (unscaled_) {
    return found_inf_;
  }
  unscaled_ = true;
  const double inv = 1.0 / scale_;
  std::vector<at::Tensor> flags;
  for (auto& p : params) {
    if (!p.grad().defined()) {
      continue;
    }
    auto& g = const_cast<at::Tensor&>(p).mutable_grad();
    flags.push_back(g.isfinite().all().logical_not());
    g.mul_(inv);
  }
  found_inf_ = !flags.empty() && at::stack(flags).any().item<bool>();
  return found_inf_;
}

void GradScaler::update() {
  if (found_inf_) {
    scale_ *= options_.backoff_factor();
    growth_tracker_ = 0;
  } else if (++growth_tracker_ == options_.growth_interval()) {
    scale_ *= options_.growth_factor();
    growth_tracker_ = 0;
  }
  unscaled_ = false;
  found_inf_ = false;
}

} // namespace amp
} // namespace colossalai
