#include <colossalai/nn/lr_scheduler/poly.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace colossalai {
namespace nn {
namespace lr_scheduler {

PolynomialLR::PolynomialLR(
    torch::optim::Optimizer& optimizer,
    const PolynomialLROptions& options)
    : LRScheduler(optimizer), options_(options) {
  TORCH_CHECK(
      options.end_lr() >= 0,
      "PolynomialLR: end_lr must be >= 0, got ",
      options.end_lr());
  TORCH_CHECK(
      options.total_steps() > 0,
      "PolynomialLR: total_steps must be > 0, got ",
      options.total_steps());
  initial_step();
}

std::vector<double> PolynomialLR::get_lr() {
  const int64_t total = options_.total_steps();
  const double done = static_cast<double>(std::min(last_epoch_, total)) /
      static_cast<double>(total);
  const double factor = std::pow(1.0 - done, options_.power());
  std::vector<double> lrs;
  for (double base : base_lrs_) {
    lrs.push_back((base - options_.end_lr()) * factor + options_.end_lr());
  }
  return lrs;
}

namespace {
std::unique_ptr<LRScheduler> poly_after_warmup(
    torch::optim::Optimizer& optimizer,
    const PolynomialWarmupLROptions& o) {
  TORCH_CHECK(
      o.warmup_steps() >= 0,
      "PolynomialWarmupLR: warmup_steps must be >= 0, got ",
      o.warmup_steps());
  TORCH_CHECK(
      o.total_steps() > o.warmup_steps(),
      "PolynomialWarmupLR: total_steps (",
      o.total_steps(),
      ") must be > warmup_steps (",
      o.warmup_steps(),
      ")");
  return std::make_unique<PolynomialLR>(
      optimizer,
      PolynomialLROptions(o.total_steps() - o.warmup_steps())
          .end_lr(o.end_lr())
          .power(o.power()));
}
} // namespace

PolynomialWarmupLR::PolynomialWarmupLR(
    torch::optim::Optimizer& optimizer,
    const PolynomialWarmupLROptions& options)
    : WarmupScheduler(
          optimizer,
          options.warmup_steps(),
          poly_after_warmup(optimizer, options)),
      options_(options) {}

void PolynomialLR::state_dict_extra(c10::impl::GenericDict& state) const {
  state.insert_or_assign("total_steps", options_.total_steps());
  state.insert_or_assign("end_lr", options_.end_lr());
  state.insert_or_assign("power", options_.power());
}

} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
