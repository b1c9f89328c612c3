#include <colossalai/nn/lr_scheduler/linear.h>

#include <c10/util/Exception.h>

namespace colossalai {
namespace nn {
namespace lr_scheduler {

LinearWarmupLR::LinearWarmupLR(
    torch::optim::Optimizer& optimizer,
    const LinearWarmupLROptions& options)
    : LRScheduler(optimizer), options_(options) {
  TORCH_CHECK(
      options.warmup_steps() >= 0,
      "LinearWarmupLR: warmup_steps must be >= 0, got ",
      options.warmup_steps());
  initial_step();
}

std::vector<double> LinearWarmupLR::get_lr() {
  const int64_t total = options_.total_steps();
  const int64_t warmup = options_.warmup_steps();
  double factor = 0;
  if (last_epoch_ < warmup) {
    factor =
        static_cast<double>(last_epoch_ + 1) / static_cast<double>(warmup + 1);
  } else {
    TORCH_CHECK(
        total != warmup,
        "LinearWarmupLR: the decay has no steps (total_steps = warmup_steps = ",
        total,
        ")");
    factor = static_cast<double>(total - last_epoch_) /
        static_cast<double>(total - warmup);
  }
  std::vector<double> lrs;
  for (double base : base_lrs_) {
    lrs.push_back(factor * base);
  }
  return lrs;
}

void LinearWarmupLR::state_dict_extra(c10::impl::GenericDict& state) const {
  state.insert_or_assign("warmup_steps", options_.warmup_steps());
  state.insert_or_assign("total_steps", options_.total_steps());
}

} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
