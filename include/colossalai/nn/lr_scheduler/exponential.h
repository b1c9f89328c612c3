#pragma once

#include <colossalai/nn/lr_scheduler/lr_scheduler.h>

#include <torch/arg.h>

namespace colossalai {
namespace nn {
namespace lr_scheduler {

struct ExponentialLROptions {
  /* implicit */ ExponentialLROptions(int64_t total_steps)
      : total_steps_(total_steps) {}
  /// Unused; kept so the constructors read like ColossalAI's.
  TORCH_ARG(int64_t, total_steps);
  /// Factor applied to the lr at every step (ColossalAI's default keeps it).
  TORCH_ARG(double, gamma) = 1.0;
};

/// Multiplies each group's lr by `gamma` at every step (PyTorch's recursive
/// form, so values match PyTorch to the last bit).
///
/// Example:
/// \code
///   ExponentialLR scheduler(optimizer, ExponentialLROptions(100).gamma(0.95));
/// \endcode
class ExponentialLR final : public LRScheduler {
 public:
  ExponentialLR(
      torch::optim::Optimizer& optimizer,
      const ExponentialLROptions& options);

  const ExponentialLROptions& options() const {
    return options_;
  }
  std::string name() const override {
    return "ExponentialLR";
  }

 protected:
  std::vector<double> get_lr() override;
  void state_dict_extra(c10::impl::GenericDict& state) const override;

 private:
  ExponentialLROptions options_;
};

} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
