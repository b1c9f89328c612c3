#pragma once

#include <colossalai/nn/lr_scheduler/lr_scheduler.h>

#include <torch/arg.h>

namespace colossalai {
namespace nn {
namespace lr_scheduler {

struct StepLROptions {
  /* implicit */ StepLROptions(int64_t total_steps)
      : total_steps_(total_steps) {}
  /// Unused; kept so the constructors read like ColossalAI's.
  TORCH_ARG(int64_t, total_steps);
  /// Steps between decays; > 0.
  TORCH_ARG(int64_t, step_size) = 1;
  TORCH_ARG(double, gamma) = 0.1;
};

/// Multiplies each group's lr by `gamma` every `step_size` steps (PyTorch's
/// recursive form). Unlike LibTorch's `torch::optim::StepLR`, it takes
/// ColossalAI's arguments and can be saved and resumed.
///
/// Example:
/// \code
///   StepLR scheduler(optimizer, StepLROptions(100).step_size(30));
/// \endcode
class StepLR final : public LRScheduler {
 public:
  StepLR(torch::optim::Optimizer& optimizer, const StepLROptions& options);

  const StepLROptions& options() const {
    return options_;
  }
  std::string name() const override {
    return "StepLR";
  }

 protected:
  std::vector<double> get_lr() override;
  void state_dict_extra(c10::impl::GenericDict& state) const override;

 private:
  StepLROptions options_;
};

} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
