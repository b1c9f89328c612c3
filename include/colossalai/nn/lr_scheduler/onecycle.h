#pragma once

#include <colossalai/nn/lr_scheduler/lr_scheduler.h>

#include <torch/arg.h>

#include <string>

namespace colossalai {
namespace nn {
namespace lr_scheduler {

struct OneCycleLROptions {
  /* implicit */ OneCycleLROptions(int64_t total_steps)
      : total_steps_(total_steps) {}
  /// Steps in the cycle; > 0. Stepping past it is an error.
  TORCH_ARG(int64_t, total_steps);
  /// Fraction of the cycle, in [0, 1], spent raising the lr.
  TORCH_ARG(double, pct_start) = 0.3;
  /// "cos" or "linear".
  TORCH_ARG(std::string, anneal_strategy) = "cos";
  /// Cycle the momentum (SGD, RMSprop) or beta1 (Adam, AdamW) inversely to
  /// the lr between `base_momentum` and `max_momentum`.
  TORCH_ARG(bool, cycle_momentum) = true;
  TORCH_ARG(double, base_momentum) = 0.85;
  TORCH_ARG(double, max_momentum) = 0.95;
  /// The cycle starts at `max_lr / div_factor`.
  TORCH_ARG(double, div_factor) = 25.0;
  /// The cycle ends at `max_lr / div_factor / final_div_factor`.
  TORCH_ARG(double, final_div_factor) = 1e4;
  /// Three phases (up, down to the initial lr, then to the minimum) as in the
  /// paper, instead of fastai's two.
  TORCH_ARG(bool, three_phase) = false;
};

/// The 1cycle policy with each group's lr at construction as its maximum
/// (ColossalAI's `OneCycleLR`): the lr rises from `max_lr / div_factor` to
/// `max_lr` and then falls far below the start, while the momentum moves the
/// opposite way. Values match `torch.optim.lr_scheduler.OneCycleLR`.
///
/// Example:
/// \code
///   torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(1e-3));
///   OneCycleLR scheduler(optimizer, OneCycleLROptions(1000).pct_start(0.25));
/// \endcode
class OneCycleLR final : public LRScheduler {
 public:
  OneCycleLR(
      torch::optim::Optimizer& optimizer,
      const OneCycleLROptions& options);

  const OneCycleLROptions& options() const {
    return options_;
  }
  std::string name() const override {
    return "OneCycleLR";
  }

 protected:
  std::vector<double> get_lr() override;
  void save_state(torch::serialize::OutputArchive& archive) const override;
  void load_state(torch::serialize::InputArchive& archive) override;
  /// `total_steps`, `_schedule_phases`, `_anneal_func_type`,
  /// `cycle_momentum` and `use_beta1`, as PyTorch's OneCycleLR holds them.
  /// The groups' `initial_lr`, `max_lr`, ... live in Python's param groups,
  /// not in its state dict; here they follow from the constructor (or, if
  /// the state's `base_lrs` differ from it, from `base_lrs`).
  void state_dict_extra(c10::impl::GenericDict& state) const override;
  /// Restores the momentum of the loaded step when `cycle_momentum`.
  void load_state_dict_extra(const c10::impl::GenericDict& state) override;

 private:
  // What PyTorch keeps in each param group's dict.
  struct Group {
    double initial_lr, max_lr, min_lr;
    double max_momentum, base_momentum;
  };
  struct Phase {
    double end_step;
    double Group::*start_lr;
    double Group::*end_lr;
    double Group::*start_momentum;
    double Group::*end_momentum;
  };
  double anneal(double start, double end, double pct) const;

  OneCycleLROptions options_;
  std::vector<Phase> phases_;
  std::vector<Group> groups_;
  std::vector<double> last_momenta_; // restored into the optimizer by load
};

} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
