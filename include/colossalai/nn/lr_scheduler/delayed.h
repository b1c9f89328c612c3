#pragma once

#include <colossalai/nn/lr_scheduler/lr_scheduler.h>

#include <memory>

namespace colossalai {
namespace nn {
namespace lr_scheduler {

/// A scheduler that runs a first stage itself and then hands every step to
/// `after_scheduler` (ColossalAI's `TwoStageScheduler`). Both act on the same
/// optimizer; when the second stage starts, `after_scheduler` takes this
/// scheduler's base learning rates and continues from its own step 0.
///
/// The base learning rates are those `after_scheduler` recorded, i.e. the
/// groups' lr before it was built (PyTorch keeps them in the groups'
/// `initial_lr`). `last_epoch()` keeps counting through the second stage;
/// `state_dict()` holds the `last_epoch` ColossalAI's does, which stops at
/// the switch (its second stage counts on).
class TwoStageScheduler : public LRScheduler {
 public:
  void step() final;

  LRScheduler& after_scheduler() const {
    return *after_;
  }
  /// Whether the second stage has started.
  bool finished() const {
    return finished_;
  }

 protected:
  TwoStageScheduler(
      torch::optim::Optimizer& optimizer,
      std::unique_ptr<LRScheduler> after_scheduler);

  /// Starts the second stage (once) and returns its learning rates.
  std::vector<double> after_lr();

  void save_state(torch::serialize::OutputArchive& archive) const override;
  void load_state(torch::serialize::InputArchive& archive) override;
  /// `finished`, and the second stage as `after_scheduler_type` (its
  /// `name()`, Python's class name) and `after_scheduler_dict` (its
  /// `state_dict()`), as ColossalAI's `TwoStageScheduler.state_dict` writes.
  void state_dict_extra(c10::impl::GenericDict& state) const override;
  /// Takes ColossalAI's `last_epoch` (stopped at the switch) and, from files
  /// of earlier versions of this library, one that counted on.
  void load_state_dict_extra(const c10::impl::GenericDict& state) override;
  int64_t python_last_epoch() const final;
  /// The step at which the second stage starts.
  virtual int64_t switch_epoch() const = 0;
  bool two_stage() const final {
    return true;
  }

  std::unique_ptr<LRScheduler> after_;
  bool finished_ = false;
};

/// Linear warmup, then `after_scheduler`: for the first `warmup_epochs` steps
/// the lr is `(last_epoch + 1) / warmup_epochs * base_lr`.
///
/// Example:
/// \code
///   auto after = std::make_unique<CosineAnnealingLR>(optimizer, 90);
///   WarmupScheduler scheduler(optimizer, 10, std::move(after));
/// \endcode
class WarmupScheduler : public TwoStageScheduler {
 public:
  WarmupScheduler(
      torch::optim::Optimizer& optimizer,
      int64_t warmup_epochs,
      std::unique_ptr<LRScheduler> after_scheduler);

  int64_t warmup_epochs() const {
    return warmup_epochs_;
  }
  std::string name() const override {
    return "WarmupScheduler";
  }

 protected:
  std::vector<double> get_lr() final;
  void state_dict_extra(c10::impl::GenericDict& state) const override;
  int64_t switch_epoch() const override {
    return warmup_epochs_;
  }

 private:
  int64_t warmup_epochs_;
};

/// The base lr for `delay_epochs` steps, then `after_scheduler`.
///
/// Example:
/// \code
///   auto after = std::make_unique<CosineAnnealingLR>(optimizer, 30);
///   DelayerScheduler scheduler(optimizer, 70, std::move(after));
/// \endcode
class DelayerScheduler : public TwoStageScheduler {
 public:
  DelayerScheduler(
      torch::optim::Optimizer& optimizer,
      int64_t delay_epochs,
      std::unique_ptr<LRScheduler> after_scheduler);

  int64_t delay_epochs() const {
    return delay_epochs_;
  }
  std::string name() const override {
    return "DelayerScheduler";
  }

 protected:
  std::vector<double> get_lr() final;
  void state_dict_extra(c10::impl::GenericDict& state) const override;
  int64_t switch_epoch() const override {
    return delay_epochs_;
  }

 private:
  int64_t delay_epochs_;
};

/// Linear warmup for `warmup_epochs` steps, the base lr for `delay_epochs`
/// more, then `after_scheduler` (the groups are reset to the base lr when it
/// starts).
///
/// Example:
/// \code
///   auto after = std::make_unique<CosineAnnealingLR>(optimizer, 30);
///   WarmupDelayerScheduler scheduler(optimizer, 10, 60, std::move(after));
/// \endcode
class WarmupDelayerScheduler : public TwoStageScheduler {
 public:
  WarmupDelayerScheduler(
      torch::optim::Optimizer& optimizer,
      int64_t warmup_epochs,
      int64_t delay_epochs,
      std::unique_ptr<LRScheduler> after_scheduler);

  int64_t warmup_epochs() const {
    return warmup_epochs_;
  }
  int64_t delay_epochs() const {
    return delay_epochs_;
  }
  std::string name() const override {
    return "WarmupDelayerScheduler";
  }

 protected:
  std::vector<double> get_lr() final;
  void state_dict_extra(c10::impl::GenericDict& state) const override;
  int64_t switch_epoch() const override {
    return warmup_epochs_ + delay_epochs_;
  }

 private:
  int64_t warmup_epochs_;
  int64_t delay_epochs_;
};

} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
