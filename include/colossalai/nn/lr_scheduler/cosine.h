#pragma once

#include <colossalai/nn/lr_scheduler/delayed.h>
#include <colossalai/nn/lr_scheduler/lr_scheduler.h>

#include <torch/arg.h>

namespace colossalai {
namespace nn {
namespace lr_scheduler {

struct CosineAnnealingLROptions {
  /* implicit */ CosineAnnealingLROptions(int64_t total_steps)
      : total_steps_(total_steps) {}
  /// Steps from the base lr down to `eta_min` (PyTorch's T_max); past it
  /// the lr rises again.
  TORCH_ARG(int64_t, total_steps);
  /// The lowest lr.
  TORCH_ARG(double, eta_min) = 0.0;
};

/// Cosine annealing from each group's lr to `eta_min` over `total_steps`
/// steps (SGDR without restarts):
/// `eta_min + (base_lr - eta_min) * (1 + cos(pi * t / total_steps)) / 2`.
/// Computed with PyTorch's recursive form, so the values match
/// `torch.optim.lr_scheduler.CosineAnnealingLR` to the last bit and an lr
/// changed between steps carries on.
///
/// Example:
/// \code
///   CosineAnnealingLR scheduler(
///       optimizer, CosineAnnealingLROptions(1000).eta_min(1e-5));
/// \endcode
class CosineAnnealingLR final : public LRScheduler {
 public:
  CosineAnnealingLR(
      torch::optim::Optimizer& optimizer,
      const CosineAnnealingLROptions& options);

  const CosineAnnealingLROptions& options() const {
    return options_;
  }
  std::string name() const override {
    return "CosineAnnealingLR";
  }

 protected:
  std::vector<double> get_lr() override;
  void state_dict_extra(c10::impl::GenericDict& state) const override;

 private:
  CosineAnnealingLROptions options_;
};

struct CosineAnnealingWarmupLROptions {
  /* implicit */ CosineAnnealingWarmupLROptions(int64_t total_steps)
      : total_steps_(total_steps) {}
  /// Warmup plus annealing steps.
  TORCH_ARG(int64_t, total_steps);
  /// Steps of linear warmup before the annealing starts.
  TORCH_ARG(int64_t, warmup_steps) = 0;
  TORCH_ARG(double, eta_min) = 0.0;
};

/// Linear warmup over `warmup_steps`, then cosine annealing to `eta_min` over
/// the remaining `total_steps - warmup_steps`.
///
/// Example:
/// \code
///   CosineAnnealingWarmupLR scheduler(
///       optimizer, CosineAnnealingWarmupLROptions(1000).warmup_steps(50));
/// \endcode
class CosineAnnealingWarmupLR final : public WarmupScheduler {
 public:
  CosineAnnealingWarmupLR(
      torch::optim::Optimizer& optimizer,
      const CosineAnnealingWarmupLROptions& options);

  const CosineAnnealingWarmupLROptions& options() const {
    return options_;
  }
  std::string name() const override {
    return "CosineAnnealingWarmupLR";
  }

 private:
  CosineAnnealingWarmupLROptions options_;
};

struct FlatAnnealingLROptions {
  /* implicit */ FlatAnnealingLROptions(int64_t total_steps)
      : total_steps_(total_steps) {}
  TORCH_ARG(int64_t, total_steps);
  /// Fraction of the steps, in [0, 1], at the base lr before annealing.
  TORCH_ARG(double, pct_start) = 0.72;
};

/// The base lr for `int(total_steps * pct_start)` steps, then cosine
/// annealing to 0 over the rest.
///
/// Example:
/// \code
///   FlatAnnealingLR scheduler(optimizer, FlatAnnealingLROptions(1000));
/// \endcode
class FlatAnnealingLR final : public DelayerScheduler {
 public:
  FlatAnnealingLR(
      torch::optim::Optimizer& optimizer,
      const FlatAnnealingLROptions& options);

  const FlatAnnealingLROptions& options() const {
    return options_;
  }
  std::string name() const override {
    return "FlatAnnealingLR";
  }

 private:
  FlatAnnealingLROptions options_;
};

struct FlatAnnealingWarmupLROptions {
  /* implicit */ FlatAnnealingWarmupLROptions(int64_t total_steps)
      : total_steps_(total_steps) {}
  TORCH_ARG(int64_t, total_steps);
  TORCH_ARG(int64_t, warmup_steps) = 0;
  /// Fraction of the steps after warmup, in [0, 1], at the base lr.
  TORCH_ARG(double, pct_start) = 0.72;
  TORCH_ARG(double, eta_min) = 0.0;
};

/// Linear warmup, the base lr for `int((total_steps - warmup_steps) *
/// pct_start)` steps, then cosine annealing to `eta_min`.
///
/// Example:
/// \code
///   FlatAnnealingWarmupLR scheduler(
///       optimizer, FlatAnnealingWarmupLROptions(1000).warmup_steps(50));
/// \endcode
class FlatAnnealingWarmupLR final : public WarmupDelayerScheduler {
 public:
  FlatAnnealingWarmupLR(
      torch::optim::Optimizer& optimizer,
      const FlatAnnealingWarmupLROptions& options);

  const FlatAnnealingWarmupLROptions& options() const {
    return options_;
  }
  std::string name() const override {
    return "FlatAnnealingWarmupLR";
  }

 private:
  FlatAnnealingWarmupLROptions options_;
};

} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
