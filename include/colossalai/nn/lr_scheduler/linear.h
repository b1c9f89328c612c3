#pragma once

#include <colossalai/nn/lr_scheduler/lr_scheduler.h>

#include <torch/arg.h>

namespace colossalai {
namespace nn {
namespace lr_scheduler {

struct LinearWarmupLROptions {
  /* implicit */ LinearWarmupLROptions(int64_t total_steps)
      : total_steps_(total_steps) {}
  /// The step at which the lr reaches 0.
  TORCH_ARG(int64_t, total_steps);
  TORCH_ARG(int64_t, warmup_steps) = 0;
};

/// Linear warmup, then linear decay to 0 at `total_steps`:
/// `(t + 1) / (warmup_steps + 1) * base_lr` while `t < warmup_steps`, then
/// `(total_steps - t) / (total_steps - warmup_steps) * base_lr` (negative past
/// `total_steps`, as in ColossalAI).
///
/// Example:
/// \code
///   LinearWarmupLR scheduler(
///       optimizer, LinearWarmupLROptions(1000).warmup_steps(100));
/// \endcode
class LinearWarmupLR final : public LRScheduler {
 public:
  LinearWarmupLR(
      torch::optim::Optimizer& optimizer,
      const LinearWarmupLROptions& options);

  const LinearWarmupLROptions& options() const {
    return options_;
  }
  std::string name() const override {
    return "LinearWarmupLR";
  }

 protected:
  std::vector<double> get_lr() override;
  void state_dict_extra(c10::impl::GenericDict& state) const override;

 private:
  LinearWarmupLROptions options_;
};

} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
