#include <colossalai/nn/lr_scheduler/cosine.h>

#include <c10/util/Exception.h>

#include <cmath>

#include "pi.h"

namespace colossalai {
namespace nn {
namespace lr_scheduler {

namespace {
using detail::kPi;

// ColossalAI truncates the flat part's length with int().
int64_t flat_steps(int64_t steps, double pct_start, const char* who) {
  TORCH_CHECK(
      pct_start >= 0.0 && pct_start <= 1.0,
      who,
      ": pct_start must be in [0, 1], got ",
      pct_start);
  return static_cast<int64_t>(static_cast<double>(steps) * pct_start);
}

void check_warmup(int64_t total_steps, int64_t warmup_steps, const char* who) {
  TORCH_CHECK(
      warmup_steps >= 0,
      who,
      ": warmup_steps must be >= 0, got ",
      warmup_steps);
  TORCH_CHECK(
      total_steps >= warmup_steps,
      who,
      ": total_steps (",
      total_steps,
      ") must be >= warmup_steps (",
      warmup_steps,
      ")");
}
} // namespace

CosineAnnealingLR::CosineAnnealingLR(
    torch::optim::Optimizer& optimizer,
    const CosineAnnealingLROptions& options)
    : LRScheduler(optimizer), options_(options) {
  TORCH_CHECK(
      options.total_steps() >= 0,
      "CosineAnnealingLR: total_steps must be >= 0, got ",
      options.total_steps());
  initial_step();
}

std::vector<double> CosineAnnealingLR::get_lr() {
  auto lrs = group_lrs();
  if (last_epoch_ == 0) {
    return lrs;
  }
  // Past step 0 PyTorch divides by T_max (a ZeroDivisionError in Python).
  TORCH_CHECK(
      options_.total_steps() > 0,
      "CosineAnnealingLR: cannot step with total_steps = 0");
  const auto t_max = static_cast<double>(options_.total_steps());
  const double eta_min = options_.eta_min();
  const int64_t e = last_epoch_;
  // PyTorch's recursive form: each lr follows from the previous one, with
  // the closed-form increment where the cosine's denominator would vanish.
  if ((e - 1 - options_.total_steps()) % (2 * options_.total_steps()) == 0) {
    for (size_t i = 0; i < lrs.size(); ++i) {
      lrs[i] =
          lrs[i] + (base_lrs_[i] - eta_min) * (1 - std::cos(kPi / t_max)) / 2;
    }
    return lrs;
  }
  const double ratio = (1 + std::cos(kPi * static_cast<double>(e) / t_max)) /
      (1 + std::cos(kPi * static_cast<double>(e - 1) / t_max));
  for (double& lr : lrs) {
    lr = ratio * (lr - eta_min) + eta_min;
  }
  return lrs;
}

namespace {
std::unique_ptr<LRScheduler> cosine_after_warmup(
    torch::optim::Optimizer& optimizer,
    const CosineAnnealingWarmupLROptions& o) {
  check_warmup(o.total_steps(), o.warmup_steps(), "CosineAnnealingWarmupLR");
  return std::make_unique<CosineAnnealingLR>(
      optimizer,
      CosineAnnealingLROptions(o.total_steps() - o.warmup_steps())
          .eta_min(o.eta_min()));
}
} // namespace

CosineAnnealingWarmupLR::CosineAnnealingWarmupLR(
    torch::optim::Optimizer& optimizer,
    const CosineAnnealingWarmupLROptions& options)
    : WarmupScheduler(
          optimizer,
          options.warmup_steps(),
          cosine_after_warmup(optimizer, options)),
      options_(options) {}

namespace {
std::unique_ptr<LRScheduler> cosine_after_flat(
    torch::optim::Optimizer& optimizer,
    const FlatAnnealingLROptions& o) {
  const int64_t flat =
      flat_steps(o.total_steps(), o.pct_start(), "FlatAnnealingLR");
  // ColossalAI anneals to 0 here (no eta_min option).
  return std::make_unique<CosineAnnealingLR>(
      optimizer, CosineAnnealingLROptions(o.total_steps() - flat));
}
} // namespace

FlatAnnealingLR::FlatAnnealingLR(
    torch::optim::Optimizer& optimizer,
    const FlatAnnealingLROptions& options)
    : DelayerScheduler(
          optimizer,
          flat_steps(
              options.total_steps(),
              options.pct_start(),
              "FlatAnnealingLR"),
          cosine_after_flat(optimizer, options)),
      options_(options) {}

namespace {
std::unique_ptr<LRScheduler> cosine_after_flat_warmup(
    torch::optim::Optimizer& optimizer,
    const FlatAnnealingWarmupLROptions& o) {
  check_warmup(o.total_steps(), o.warmup_steps(), "FlatAnnealingWarmupLR");
  const int64_t steps = o.total_steps() - o.warmup_steps();
  const int64_t flat =
      flat_steps(steps, o.pct_start(), "FlatAnnealingWarmupLR");
  return std::make_unique<CosineAnnealingLR>(
      optimizer, CosineAnnealingLROptions(steps - flat).eta_min(o.eta_min()));
}
} // namespace

FlatAnnealingWarmupLR::FlatAnnealingWarmupLR(
    torch::optim::Optimizer& optimizer,
    const FlatAnnealingWarmupLROptions& options)
    : WarmupDelayerScheduler(
          optimizer,
          options.warmup_steps(),
          flat_steps(
              options.total_steps() - options.warmup_steps(),
              options.pct_start(),
              "FlatAnnealingWarmupLR"),
          cosine_after_flat_warmup(optimizer, options)),
      options_(options) {}

void CosineAnnealingLR::state_dict_extra(c10::impl::GenericDict& state) const {
  state.insert_or_assign("T_max", options_.total_steps());
  state.insert_or_assign("eta_min", options_.eta_min());
}

} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
