#include <colossalai/nn/lr_scheduler/multistep.h>

#include <c10/util/Exception.h>

#include <cmath>

namespace colossalai {
namespace nn {
namespace lr_scheduler {

MultiStepLR::MultiStepLR(
    torch::optim::Optimizer& optimizer,
    const MultiStepLROptions& options)
    : LRScheduler(optimizer), options_(options) {
  for (int64_t milestone : options.milestones()) {
    ++counts_[milestone];
  }
  initial_step();
}

std::vector<double> MultiStepLR::get_lr() {
  auto lrs = group_lrs();
  auto it = counts_.find(last_epoch_);
  if (it == counts_.end()) {
    return lrs;
  }
  const double factor =
      std::pow(options_.gamma(), static_cast<double>(it->second));
  for (double& lr : lrs) {
    lr *= factor;
  }
  return lrs;
}

namespace {
std::unique_ptr<LRScheduler> multistep_after_warmup(
    torch::optim::Optimizer& optimizer,
    const MultiStepWarmupLROptions& o) {
  TORCH_CHECK(
      !o.milestones().empty(), "MultiStepWarmupLR: milestones cannot be empty");
  TORCH_CHECK(
      o.warmup_steps() >= 0,
      "MultiStepWarmupLR: warmup_steps must be >= 0, got ",
      o.warmup_steps());
  // Milestones count from the start; the after scheduler's steps from the
  // end of warmup.
  std::vector<int64_t> shifted;
  for (int64_t milestone : o.milestones()) {
    if (milestone >= o.warmup_steps()) {
      shifted.push_back(milestone - o.warmup_steps());
    }
  }
  return std::make_unique<MultiStepLR>(
      optimizer,
      MultiStepLROptions(o.total_steps())
          .milestones(std::move(shifted))
          .gamma(o.gamma()));
}
} // namespace

MultiStepWarmupLR::MultiStepWarmupLR(
    torch::optim::Optimizer& optimizer,
    const MultiStepWarmupLROptions& options)
    : WarmupScheduler(
          optimizer,
          options.warmup_steps(),
          multistep_after_warmup(optimizer, options)),
      options_(options) {}

void MultiStepLR::state_dict_extra(c10::impl::GenericDict& state) const {
  // Python keeps a Counter {milestone: times listed}; a plain dict reads the
  // same in its get_lr (and needs no global to unpickle).
  c10::impl::GenericDict milestones(c10::IntType::get(), c10::AnyType::get());
  for (const auto& [milestone, count] : counts_) {
    milestones.insert(milestone, count);
  }
  state.insert_or_assign("milestones", milestones);
  state.insert_or_assign("gamma", options_.gamma());
}

} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
