#pragma once

#include <colossalai/nn/lr_scheduler/delayed.h>
#include <colossalai/nn/lr_scheduler/lr_scheduler.h>

#include <torch/arg.h>

namespace colossalai {
namespace nn {
namespace lr_scheduler {

struct PolynomialLROptions {
  /* implicit */ PolynomialLROptions(int64_t total_steps)
      : total_steps_(total_steps) {}
  /// The step at which the lr reaches `end_lr` (and stays).
  TORCH_ARG(int64_t, total_steps);
  /// The final lr; >= 0.
  TORCH_ARG(double, end_lr) = 0.0001;
  TORCH_ARG(double, power) = 1.0;
};

/// Polynomial decay:
/// `(base_lr - end_lr) * (1 - min(t, total_steps) / total_steps)^power +
/// end_lr`.
///
/// Example:
/// \code
///   PolynomialLR scheduler(optimizer, PolynomialLROptions(1000).power(2.0));
/// \endcode
class PolynomialLR final : public LRScheduler {
 public:
  PolynomialLR(
      torch::optim::Optimizer& optimizer,
      const PolynomialLROptions& options);

  const PolynomialLROptions& options() const {
    return options_;
  }
  std::string name() const override {
    return "PolynomialLR";
  }

 protected:
  std::vector<double> get_lr() override;
  void state_dict_extra(c10::impl::GenericDict& state) const override;

 private:
  PolynomialLROptions options_;
};

struct PolynomialWarmupLROptions {
  /* implicit */ PolynomialWarmupLROptions(int64_t total_steps)
      : total_steps_(total_steps) {}
  /// Warmup plus decay steps.
  TORCH_ARG(int64_t, total_steps);
  TORCH_ARG(int64_t, warmup_steps) = 0;
  TORCH_ARG(double, end_lr) = 0.0001;
  TORCH_ARG(double, power) = 1.0;
};

/// Linear warmup over `warmup_steps`, then `PolynomialLR` over the remaining
/// `total_steps - warmup_steps`.
///
/// Example:
/// \code
///   PolynomialWarmupLR scheduler(
///       optimizer, PolynomialWarmupLROptions(1000).warmup_steps(50));
/// \endcode
class PolynomialWarmupLR final : public WarmupScheduler {
 public:
  PolynomialWarmupLR(
      torch::optim::Optimizer& optimizer,
      const PolynomialWarmupLROptions& options);

  const PolynomialWarmupLROptions& options() const {
    return options_;
  }
  std::string name() const override {
    return "PolynomialWarmupLR";
  }

 private:
  PolynomialWarmupLROptions options_;
};

} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
