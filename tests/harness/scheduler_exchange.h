#pragma once

// LR scheduler files exchanged with Python (tests/python/interop.py with
// torch's schedulers, tests/python/colossalai_interop.py with ColossalAI's):
// the optimizer both sides build, what a step leaves, and the comparison.

#include <colossalai/nn/lr_scheduler/lr_scheduler.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace colossalai {
namespace testing {

/// SGD with momentum on two groups at lr 0.1 and 0.03 (the scripts'
/// sched_optimizer()).
inline std::unique_ptr<torch::optim::SGD> sched_optimizer() {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (double lr : {0.1, 0.03}) {
    groups.emplace_back(
        std::vector<at::Tensor>{at::zeros({2}).requires_grad_()},
        std::make_unique<torch::optim::SGDOptions>(
            torch::optim::SGDOptions(lr).momentum(0.9)));
  }
  return std::make_unique<torch::optim::SGD>(
      groups, torch::optim::SGDOptions(0.1).momentum(0.9));
}

struct SchedulerCase {
  std::string name;
  std::function<std::unique_ptr<nn::lr_scheduler::LRScheduler>(
      torch::optim::Optimizer&)>
      make;
  int64_t steps; // before the save
};

/// The groups' learning rates, then their momenta (the scripts'
/// sched_step()).
inline std::vector<double> lrs_and_momenta(
    torch::optim::Optimizer& optimizer,
    const nn::lr_scheduler::LRScheduler& scheduler) {
  std::vector<double> out = scheduler.get_last_lr();
  for (auto& group : optimizer.param_groups()) {
    out.push_back(
        static_cast<torch::optim::SGDOptions&>(group.options()).momentum());
  }
  return out;
}

/// Relative 1e-12: the same double arithmetic on both sides, but Python's
/// pow and cos may come from another libm than LibTorch's. `who` names the
/// other side in messages.
inline void expect_values(
    const at::Tensor* want,
    const std::vector<double>& got,
    const std::string& who) {
  ASSERT_NE(want, nullptr) << "missing from " << who << "'s file";
  const auto w = want->to(at::kDouble).contiguous();
  ASSERT_EQ(w.numel(), static_cast<int64_t>(got.size()));
  for (size_t i = 0; i < got.size(); ++i) {
    const double x = w.data_ptr<double>()[i];
    EXPECT_LE(
        std::abs(x - got[i]), 1e-12 * std::max(std::abs(x), std::abs(got[i])))
        << "value " << i << ": " << who << " " << x << ", C++ " << got[i];
  }
}

} // namespace testing
} // namespace colossalai
