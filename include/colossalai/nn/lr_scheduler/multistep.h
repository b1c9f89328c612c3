#pragma once

#include <colossalai/nn/lr_scheduler/delayed.h>
#include <colossalai/nn/lr_scheduler/lr_scheduler.h>

#include <torch/arg.h>

#include <map>

namespace colossalai {
namespace nn {
namespace lr_scheduler {

struct MultiStepLROptions {
  /* implicit */ MultiStepLROptions(int64_t total_steps)
      : total_steps_(total_steps) {}
  /// Unused; kept so the constructors read like ColossalAI's.
  TORCH_ARG(int64_t, total_steps);
  /// Steps at which the lr is multiplied by `gamma`; a step listed k times
  /// multiplies by gamma^k.
  TORCH_ARG(std::vector<int64_t>, milestones);
  TORCH_ARG(double, gamma) = 0.1;
};

/// Multiplies each group's lr by `gamma` at every milestone (PyTorch's
/// recursive form: an lr changed between steps carries on).
///
/// Example:
/// \code
///   MultiStepLR scheduler(
///       optimizer, MultiStepLROptions(100).milestones({30, 80}).gamma(0.1));
/// \endcode
class MultiStepLR final : public LRScheduler {
 public:
  MultiStepLR(
      torch::optim::Optimizer& optimizer,
      const MultiStepLROptions& options);

  const MultiStepLROptions& options() const {
    return options_;
  }
  std::string name() const override {
    return "MultiStepLR";
  }

 protected:
  std::vector<double> get_lr() override;
  void state_dict_extra(c10::impl::GenericDict& state) const override;

 private:
  MultiStepLROptions options_;
  std::map<int64_t, int64_t> counts_; // milestone -> times listed
};

struct MultiStepWarmupLROptions {
  /* implicit */ MultiStepWarmupLROptions(int64_t total_steps)
      : total_steps_(total_steps) {}
  /// Unused; kept so the constructors read like ColossalAI's.
  TORCH_ARG(int64_t, total_steps);
  TORCH_ARG(int64_t, warmup_steps) = 0;
  /// Steps counted from the start of warmup; those before `warmup_steps`
  /// are dropped. Must not be empty.
  TORCH_ARG(std::vector<int64_t>, milestones);
  TORCH_ARG(double, gamma) = 0.1;
};

/// Linear warmup over `warmup_steps`, then `MultiStepLR`.
///
/// Example:
/// \code
///   MultiStepWarmupLR scheduler(
///       optimizer,
///       MultiStepWarmupLROptions(100).warmup_steps(5).milestones({30, 80}));
/// \endcode
class MultiStepWarmupLR final : public WarmupScheduler {
 public:
  MultiStepWarmupLR(
      torch::optim::Optimizer& optimizer,
      const MultiStepWarmupLROptions& options);

  const MultiStepWarmupLROptions& options() const {
    return options_;
  }
  std::string name() const override {
    return "MultiStepWarmupLR";
  }

 private:
  MultiStepWarmupLROptions options_;
};

} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
