#include <colossalai/amp/grad_scaler.h>

#include <limits>
#include <map>

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

double DynamicLossScaler::scale() const {
  return on_device() ? scale_t_.item<double>() : scale_;
}

int64_t DynamicLossScaler::growth_tracker() const {
  return on_device() ? growth_tracker_t_.item<int64_t>() : growth_tracker_;
}

void DynamicLossScaler::update(bool found_inf) {
  if (on_device()) {
    update(at::full({}, found_inf ? 1.0 : 0.0, scale_t_.options()));
    return;
  }
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

void DynamicLossScaler::to_device(const at::Device& device) {
  if (on_device()) {
    if (scale_t_.device() != device) {
      scale_t_ = scale_t_.to(device);
      growth_tracker_t_ = growth_tracker_t_.to(device);
      hysteresis_left_t_ = hysteresis_left_t_.to(device);
    }
    return;
  }
  const auto on = at::TensorOptions().device(device);
  scale_t_ = at::full({}, scale_, on.dtype(at::kFloat));
  growth_tracker_t_ = at::full({}, growth_tracker_, on.dtype(at::kLong));
  hysteresis_left_t_ = at::full({}, hysteresis_left_, on.dtype(at::kLong));
}

at::Tensor DynamicLossScaler::scale_loss(const at::Tensor& loss) const {
  // fp32 multiply: the scale (2^16 and up) must not overflow an fp16 loss.
  if (lives_on(loss.device())) {
    return loss.to(at::kFloat) * scale_t_;
  }
  return loss.to(at::kFloat) * scale();
}

at::Tensor DynamicLossScaler::scale_tensor(const at::Device& device) {
  to_device(device);
  return scale_t_;
}

at::Tensor DynamicLossScaler::inv_scale_tensor(const at::Device& device) {
  to_device(device);
  return scale_t_.to(at::kDouble).reciprocal().to(at::kFloat);
}

void DynamicLossScaler::update(const at::Tensor& found_inf) {
  TORCH_CHECK(
      found_inf.numel() == 1,
      "loss scaler: found_inf must hold one element, got shape ",
      found_inf.sizes());
  to_device(found_inf.device());
  // update(bool)'s rule as selections, so that nothing is read back. The
  // tensors are written in place: their storage stays where it is.
  const auto& o = options_;
  const auto inf = found_inf.reshape({}).ne(0);
  const auto clean = inf.logical_not();
  const auto hysteresis_spent = hysteresis_left_t_.le(1);
  const auto back_off = inf.logical_and(hysteresis_spent);
  const auto grow =
      clean.logical_and(growth_tracker_t_.eq(o.growth_interval() - 1));
  const auto backed =
      scale_t_.mul(o.backoff_factor()).clamp_min(o.min_scale());
  const auto grown = scale_t_.mul(o.growth_factor()).clamp_max(o.max_scale());
  const auto restored = at::full_like(hysteresis_left_t_, o.hysteresis());
  const auto zero = at::zeros_like(growth_tracker_t_);
  scale_t_.copy_(at::where(back_off, backed, at::where(grow, grown, scale_t_)));
  hysteresis_left_t_.copy_(at::where(
      back_off.logical_or(grow),
      restored,
      at::where(inf, hysteresis_left_t_.sub(1), hysteresis_left_t_)));
  growth_tracker_t_.copy_(at::where(
      inf.logical_or(grow), zero, growth_tracker_t_.add(1)));
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

at::Tensor unscale_and_check_(
    const std::vector<at::Tensor>& grads,
    const at::Tensor& inv_scale) {
  TORCH_CHECK(
      inv_scale.numel() == 1 && inv_scale.scalar_type() == at::kFloat,
      "unscale_and_check_: inv_scale must be one float32 element");
  std::vector<at::Tensor> defined;
  for (const auto& g : grads) {
    if (g.defined() && g.numel() > 0) {
      TORCH_CHECK(
          g.device() == inv_scale.device(),
          "unscale_and_check_: a gradient is on ",
          g.device(),
          ", the scale on ",
          inv_scale.device());
      defined.push_back(g);
    }
  }
  auto found = at::zeros({}, inv_scale.options());
  if (defined.empty()) {
    return found;
  }
  const auto inv = inv_scale.reshape({});
  std::vector<at::Tensor> rest;
  if (inv_scale.is_cuda()) {
    // ATen's pass, one call per dtype (as Python's GradScaler groups
    // them); its CUDA kernel takes no bf16, which the composition below
    // unscales.
    std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
    for (const auto& g : defined) {
      if (g.scalar_type() == at::kBFloat16) {
        rest.push_back(g);
      } else {
        by_dtype[g.scalar_type()].push_back(g);
      }
    }
    for (auto& [dtype, grads] : by_dtype) {
      (void)dtype;
      at::_amp_foreach_non_finite_check_and_unscale_(grads, found, inv);
    }
  } else {
    rest = std::move(defined);
  }
  if (rest.empty()) {
    return found;
  }
  found = at::maximum(found, any_non_finite(rest).reshape({}));
  for (auto& g : rest) {
    g.mul_(inv);
  }
  return found;
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
  return scaler_.scale_loss(loss);
}

namespace {

std::vector<at::Tensor> grads_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> grads;
  for (const auto& p : params) {
    if (p.grad().defined()) {
      grads.push_back(p.grad());
    }
  }
  return grads;
}

} // namespace

bool GradScaler::unscale_(const std::vector<at::Tensor>& params) {
  const auto grads = grads_of(params);
  if (!unscaled_ && scaler_.on_device() && !grads.empty()) {
    unscale_on_device_(params); // the scale is there; the verdict read below
  }
  if (unscaled_) {
    return found_inf();
  }
  unscaled_ = true;
  const double inv = 1.0 / scaler_.scale();
  auto flag = any_non_finite(grads);
  for (const auto& g : grads) {
    g.mul_(inv);
  }
  found_inf_ = flag.item<float>() > 0;
  return found_inf_;
}

at::Tensor GradScaler::unscale_on_device_(
    const std::vector<at::Tensor>& params) {
  const auto grads = grads_of(params);
  TORCH_CHECK(
      !grads.empty(), "GradScaler::unscale_on_device_: no gradient to unscale");
  const auto device = grads.front().device();
  if (unscaled_) {
    return device_found_inf_.defined()
        ? device_found_inf_
        : at::full({}, found_inf_ ? 1.0 : 0.0, at::device(device));
  }
  unscaled_ = true;
  device_found_inf_ =
      unscale_and_check_(grads, scaler_.inv_scale_tensor(device));
  return device_found_inf_;
}

bool GradScaler::found_inf() const {
  return device_found_inf_.defined() ? device_found_inf_.item<float>() > 0
                                     : found_inf_;
}

void GradScaler::update() {
  if (device_found_inf_.defined()) {
    scaler_.update(device_found_inf_);
  } else {
    scaler_.update(found_inf_);
  }
  unscaled_ = false;
  found_inf_ = false;
  device_found_inf_ = at::Tensor();
}

} // namespace amp
} // namespace colossalai
