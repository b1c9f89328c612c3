#include <colossalai/nn/lr_scheduler/exponential.h>

namespace colossalai {
namespace nn {
namespace lr_scheduler {

ExponentialLR::ExponentialLR(
    torch::optim::Optimizer& optimizer,
    const ExponentialLROptions& options)
    : LRScheduler(optimizer), options_(options) {
  initial_step();
}

std::vector<double> ExponentialLR::get_lr() {
  auto lrs = group_lrs();
  if (last_epoch_ == 0) {
    return lrs;
  }
  // Recursive rather than base * gamma^t: the products round differently.
  for (double& lr : lrs) {
    lr *= options_.gamma();
  }
  return lrs;
}

void ExponentialLR::state_dict_extra(c10::impl::GenericDict& state) const {
  state.insert_or_assign("gamma", options_.gamma());
}

} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
