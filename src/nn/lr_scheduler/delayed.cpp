#include <colossalai/nn/lr_scheduler/delayed.h>

#include <algorithm>

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

void TwoStageScheduler::state_dict_extra(c10::impl::GenericDict& state) const {
  state.insert_or_assign("finished", finished_);
  state.insert_or_assign("after_scheduler_type", after_->name());
  state.insert_or_assign("after_scheduler_dict", after_->state_dict());
}

void TwoStageScheduler::load_state_dict_extra(
    const c10::impl::GenericDict& state) {
  const std::string who = name();
  const bool finished = detail::bool_entry(
      detail::require_entry(state, who, "finished"), who, "finished");
  if (const c10::IValue* type =
          detail::find_entry(state, "after_scheduler_type")) {
    TORCH_CHECK(
        type->isString(),
        who,
        ": 'after_scheduler_type' in the scheduler state is a ",
        type->tagKind(),
        ", not a class name");
    TORCH_CHECK(
        type->toStringRef() == after_->name(),
        who,
        ": the state's second stage is a ",
        type->toStringRef(),
        ", this scheduler's is a ",
        after_->name());
  }
  const c10::IValue* after = detail::find_entry(state, "after_scheduler_dict");
  if (after == nullptr) {
    // ColossalAI warns and goes on; past the switch that would leave the
    // second stage at its step 0.
    TORCH_CHECK(
        !finished,
        who,
        ": the state has finished=True but no 'after_scheduler_dict' (where "
        "the second stage stands)");
  } else {
    TORCH_CHECK(
        after->isGenericDict(),
        who,
        ": 'after_scheduler_dict' in the scheduler state is a ",
        after->tagKind(),
        ", not a dict");
    // It changes nothing unless all of its checks pass.
    try {
      after_->load_state_dict(after->toGenericDict());
    } catch (const c10::Error& e) {
      TORCH_CHECK(
          false,
          who,
          ": in 'after_scheduler_dict': ",
          e.what_without_backtrace());
    }
  }
  finished_ = finished;
  // ColossalAI's last_epoch stopped at the switch; ours counts the second
  // stage's steps too. (A state that counted on has last_epoch above the
  // switch, or equal to it where both readings agree.)
  if (finished_ && after != nullptr && last_epoch_ == switch_epoch()) {
    last_epoch_ += after_->last_epoch();
  }
}

int64_t TwoStageScheduler::python_last_epoch() const {
  return finished_ ? std::min(last_epoch_, switch_epoch()) : last_epoch_;
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

void WarmupScheduler::state_dict_extra(c10::impl::GenericDict& state) const {
  state.insert_or_assign("warmup_epochs", warmup_epochs_);
  TwoStageScheduler::state_dict_extra(state);
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

void DelayerScheduler::state_dict_extra(c10::impl::GenericDict& state) const {
  state.insert_or_assign("delay_epochs", delay_epochs_);
  TwoStageScheduler::state_dict_extra(state);
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

void WarmupDelayerScheduler::state_dict_extra(
    c10::impl::GenericDict& state) const {
  state.insert_or_assign("warmup_epochs", warmup_epochs_);
  state.insert_or_assign("delay_epochs", delay_epochs_);
  TwoStageScheduler::state_dict_extra(state);
}

} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
