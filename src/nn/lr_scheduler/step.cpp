#include <colossalai/nn/lr_scheduler/step.h>

#include <c10/util/Exception.h>

namespace colossalai {
namespace nn {
namespace lr_scheduler {

StepLR::StepLR(torch::optim::Optimizer& optimizer, const StepLROptions& options)
    : LRScheduler(optimizer), options_(options) {
  TORCH_CHECK(
      options.step_size() > 0,
      "StepLR: step_size must be > 0, got ",
      options.step_size());
  initial_step();
}

std::vector<double> StepLR::get_lr() {
  auto lrs = group_lrs();
  if (last_epoch_ == 0 || last_epoch_ % options_.step_size() != 0) {
    return lrs;
  }
  for (double& lr : lrs) {
    lr *= options_.gamma();
  }
  return lrs;
}

void StepLR::state_dict_extra(c10::impl::GenericDict& state) const {
  state.insert_or_assign("step_size", options_.step_size());
  state.insert_or_assign("gamma", options_.gamma());
}

} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
