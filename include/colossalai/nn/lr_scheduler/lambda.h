#pragma once

#include <colossalai/nn/lr_scheduler/lr_scheduler.h>

#include <torch/arg.h>

#include <functional>

namespace colossalai {
namespace nn {
namespace lr_scheduler {

/// A factor as a function of the step (`last_epoch`).
using LrLambda = std::function<double(int64_t)>;

struct LambdaLROptions {
  /// One function for every group.
  LambdaLROptions(int64_t total_steps, LrLambda lr_lambda)
      : total_steps_(total_steps), lr_lambdas_({std::move(lr_lambda)}) {}
  /// One function per group, in order.
  LambdaLROptions(int64_t total_steps, std::vector<LrLambda> lr_lambdas)
      : total_steps_(total_steps), lr_lambdas_(std::move(lr_lambdas)) {}
  /// Unused; kept so the constructors read like ColossalAI's.
  TORCH_ARG(int64_t, total_steps);
  /// One function (used for every group) or one per group.
  TORCH_ARG(std::vector<LrLambda>, lr_lambdas);
};

/// Sets each group's lr to `base_lr * lr_lambda(t)`.
///
/// Example:
/// \code
///   LambdaLR scheduler(optimizer, LambdaLROptions(100, [](int64_t t) {
///     return std::pow(0.95, t);
///   }));
/// \endcode
class LambdaLR final : public LRScheduler {
 public:
  LambdaLR(torch::optim::Optimizer& optimizer, const LambdaLROptions& options);

  const LambdaLROptions& options() const {
    return options_;
  }
  std::string name() const override {
    return "LambdaLR";
  }

 protected:
  std::vector<double> get_lr() override;
  void state_dict_extra(c10::impl::GenericDict& state) const override;

 private:
  LambdaLROptions options_;
};

/// Same arguments as `LambdaLR`; the function gives the factor of one step.
using MultiplicativeLROptions = LambdaLROptions;

/// Multiplies each group's lr by `lr_lambda(t)` at every step after the
/// first (recursive, like PyTorch's).
///
/// Example:
/// \code
///   auto factor = [](int64_t) { return 0.95; };
///   MultiplicativeLR scheduler(optimizer, {100, factor});
/// \endcode
class MultiplicativeLR final : public LRScheduler {
 public:
  MultiplicativeLR(
      torch::optim::Optimizer& optimizer,
      const MultiplicativeLROptions& options);

  const MultiplicativeLROptions& options() const {
    return options_;
  }
  std::string name() const override {
    return "MultiplicativeLR";
  }

 protected:
  std::vector<double> get_lr() override;
  void state_dict_extra(c10::impl::GenericDict& state) const override;

 private:
  MultiplicativeLROptions options_;
};

} // namespace lr_scheduler
} // namespace nn
} // namespace colossalai
