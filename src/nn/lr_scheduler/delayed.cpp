#include <colossalai/nn/lr_scheduler/delayed.h>

#include <c10/util/Exception.h>

namespace colossalai {
namespace nn {
namespace lr_scheduler {

namespace {
std::unique_ptr<LRScheduler> checked(
    torch::optim::Optimizer& optimizer,
    std::unique_ptr<LRScheduler> after_scheduler) {
  TORCH_CHECK(after_scheduler, "after_scheduler must not be null");
  TORCH_CHECK(
      &after_scheduler->optimizer() == &optimizer,
      "after_scheduler (",
      after_scheduler->name(),
      ") must schedule the same optimizer");
  return after_scheduler;
}
} // namespace

TwoStageScheduler::TwoStageScheduler(
    torch::optim::Optimizer& optimizer,
    std::unique_ptr<LRScheduler> after_scheduler)
    : LRScheduler(optimizer),
      after_(checked(optimizer, std::move(after_scheduler))) {
  // PyTorch takes base lrs from the groups' `initial_lr`, which the first
  // scheduler built on them (the after scheduler) recorded.
  base_lrs_ = after_->base_lrs();
}

void TwoStageScheduler::step() {
  if (!finished_) {
    LRScheduler::step();
    return;
  }
  after_->step();
  last_lrs_ = after_->get_last_lr();
  ++last_epoch_;
}

std::vector<double> TwoStageScheduler::after_lr() {
  if (!finished_) {
    set_base_lrs_of(*after_, base_lrs_);
    finished_ = true;
  }
  // The after scheduler is still at its step 0 here; its later steps come
  // from step() above.
  return get_lr_of(*after_);
}

void TwoStageScheduler::save_state(
    torch::serialize::OutputArchive& archive) const {
  archive.write("finished", c10::IValue(finished_));
  torch::serialize::OutputArchive after;
  after_->save(after);
  archive.write("after_scheduler", after);
}

void TwoStageScheduler::load_state(torch::serialize::InputArchive& archive) {
  finished_ = detail::read_bool(archive, "finished");
  torch::serialize::InputArchive after;
  archive.read("after_scheduler", after);
  after_->load(after);
}

WarmupScheduler::WarmupScheduler(
    torch::optim::Optimizer& optimizer,
    int64_t warmup_epochs,
    std::unique_ptr<LRScheduler> after_scheduler)
    : TwoStageScheduler(optimizer, std::move(after_scheduler)),
      warmup_epochs_(warmup_epochs) {
  TORCH_CHECK(
      warmup_epochs >= 0, "warmup steps must be >= 0, got ", warmup_epochs);
  initial_step();
}

std::vector<double> WarmupScheduler::get_lr() {
  if (last_epoch_ >= warmup_epochs_) {
    return after_lr();
  }
  std::vector<double> lrs;
  for (double base : base_lrs_) {
    lrs.push_back(
        static_cast<double>(last_epoch_ + 1) /
        static_cast<double>(warmup_epochs_) * base);
  }
  return lrs;
}

DelayerScheduler::DelayerScheduler(
    torch::optim::Optimizer& optimizer,
    int64_t delay_epochs,
    std::unique_ptr<LRScheduler> after_scheduler)
    : TwoStageScheduler(optimizer, std::move(after_scheduler)),
      delay_epochs_(delay_epochs) {
  TORCH_CHECK(
      delay_epochs >= 0, "delay_epochs must be >= 0, got ", delay_epochs);
  initial_step();
}

std::vector<double> DelayerScheduler::get_lr() {
  if (last_epoch_ >= delay_epochs_) {
    return after_lr();
  }
  return base_lrs_;
}

WarmupDelayerScheduler::WarmupDelayerScheduler(
    torch::optim::Optimizer& optimizer,
    int64_t warmup_epochs,
    int64_t delay_epochs,
    std::unique_ptr<LRScheduler> after_scheduler)
    : TwoStageScheduler(optimizer, std::move(after_scheduler)),
      warmup_epochs_(warmup_epochs),
      delay_epochs_(delay_epochs) {
  TORCH_CHECK(
      delay_epochs >= 0, "delay_epochs must be >= 0, got ", delay_epochs);
  TORCH_CHECK(
      warmup_epochs >= 0, "warmup_epochs must be >= 0, got ", warmup_epochs);
  initial_step();
}

std::vector<double> WarmupDelayerScheduler::get_lr() {
  if (last_epoch_ >= warmup_epochs_ + delay_epochs_) {
    if (!finished_) {
      // Recursive after schedulers start from the base lr, not the last
      // warmup value.
      set_group_lrs(base_lrs_);
    }
    return after_lr();
  }
  if (last_epoch_ >= warmup_epochs_) {
    return base_lrs_;
  }
  std::vector<double> lrs;
  for (double base : base_lrs_) {
    lrs.push_back(
        static_cast<double>(last_epoch_ + 1) /
        static_cast<double>(warmup_epochs_) * base);
  }
  return lrs;
}

} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
