// Learning-rate schedulers against values recorded from PyTorch /
// ColossalAI (golden/gen_lr_scheduler_golden.py), and save/load resumption.

#include <colossalai/nn/lr_scheduler/all.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "golden/lr_scheduler_golden.h"

#include <cmath>
#include <cstdio>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <unistd.h>

namespace {

namespace sched = colossalai::nn::lr_scheduler;
using Table = std::vector<std::vector<double>>;

enum class Opt { kSgd, kAdam, kAdamW, kAdagrad };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt kind) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (double lr : golden::kInitialLrs) {
    std::vector<torch::Tensor> params{
        torch::zeros({2}, torch::requires_grad())};
    std::unique_ptr<torch::optim::OptimizerOptions> options;
    switch (kind) {
      case Opt::kSgd:
        options = std::make_unique<torch::optim::SGDOptions>(
            torch::optim::SGDOptions(lr).momentum(0.9));
        break;
      case Opt::kAdam:
        options = std::make_unique<torch::optim::AdamOptions>(lr);
        break;
      case Opt::kAdamW:
        options = std::make_unique<torch::optim::AdamWOptions>(lr);
        break;
      case Opt::kAdagrad:
        options = std::make_unique<torch::optim::AdagradOptions>(lr);
        break;
    }
    groups.emplace_back(std::move(params), std::move(options));
  }
  switch (kind) {
    case Opt::kSgd:
      return std::make_unique<torch::optim::SGD>(
          groups, torch::optim::SGDOptions(0.1).momentum(0.9));
    case Opt::kAdam:
      return std::make_unique<torch::optim::Adam>(
          groups, torch::optim::AdamOptions(0.1));
    case Opt::kAdamW:
      return std::make_unique<torch::optim::AdamW>(
          groups, torch::optim::AdamWOptions(0.1));
    case Opt::kAdagrad:
      return std::make_unique<torch::optim::Adagrad>(
          groups, torch::optim::AdagradOptions(0.1));
  }
  return nullptr;
}

std::vector<double> group_lrs(torch::optim::Optimizer& optimizer) {
  std::vector<double> lrs;
  for (auto& group : optimizer.param_groups()) {
    lrs.push_back(group.options().get_lr());
  }
  return lrs;
}

std::vector<double> momenta(torch::optim::Optimizer& optimizer) {
  std::vector<double> out;
  for (auto& group : optimizer.param_groups()) {
    auto& options = group.options();
    if (auto* sgd = dynamic_cast<torch::optim::SGDOptions*>(&options)) {
      out.push_back(sgd->momentum());
    } else if (
        auto* adam = dynamic_cast<torch::optim::AdamOptions*>(&options)) {
      out.push_back(std::get<0>(adam->betas()));
    } else if (
        auto* adamw = dynamic_cast<torch::optim::AdamWOptions*>(&options)) {
      out.push_back(std::get<0>(adamw->betas()));
    }
  }
  return out;
}

// Values compared, and how many of them were not bit-identical.
struct Tally {
  int64_t compared = 0;
  int64_t inexact = 0;
} tally;

// Relative 1e-12; the tally shows how many values differ at all.
void expect_row(
    const std::vector<double>& actual,
    const std::vector<double>& expected,
    const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    ++tally.compared;
    tally.inexact += actual[i] != expected[i];
    const double tol =
        1e-12 * std::max(std::abs(actual[i]), std::abs(expected[i]));
    EXPECT_LE(std::abs(actual[i] - expected[i]), tol)
        << what << " group " << i << ": " << actual[i] << " vs " << expected[i];
  }
}

using Factory = std::function<std::unique_ptr<sched::LRScheduler>(
    torch::optim::Optimizer&)>;

struct Case {
  std::string name;
  Opt opt;
  Factory make;
  int64_t steps;
  // Factor applied to every group's lr just before the given step.
  std::map<int64_t, double> tweaks;
  const Table* lr;
  const Table* momentum = nullptr;
};

template <class S, class O>
Factory factory(O options) {
  return [options](torch::optim::Optimizer& optimizer) {
    return std::make_unique<S>(optimizer, options);
  };
}

// Mirrors CASES in gen_lr_scheduler_golden.py.
std::vector<Case> cases() {
  using namespace sched;
  std::vector<Case> c;
  c.push_back(
      {"LinearWarmupLR",
       Opt::kSgd,
       factory<LinearWarmupLR>(LinearWarmupLROptions(40).warmup_steps(8)),
       40,
       {},
       &golden::kLinearWarmupLRLr});
  c.push_back(
      {"CosineAnnealingLR",
       Opt::kSgd,
       factory<CosineAnnealingLR>(CosineAnnealingLROptions(25).eta_min(0.001)),
       60,
       {},
       &golden::kCosineAnnealingLRLr});
  c.push_back(
      {"CosineAnnealingLRChained",
       Opt::kSgd,
       factory<CosineAnnealingLR>(CosineAnnealingLROptions(30)),
       45,
       {{12, 0.5}},
       &golden::kCosineAnnealingLRChainedLr});
  c.push_back(
      {"CosineAnnealingWarmupLR",
       Opt::kSgd,
       factory<CosineAnnealingWarmupLR>(
           CosineAnnealingWarmupLROptions(50).warmup_steps(10).eta_min(1e-4)),
       50,
       {},
       &golden::kCosineAnnealingWarmupLRLr});
  c.push_back(
      {"WarmupSchedulerComposed",
       Opt::kSgd,
       [](torch::optim::Optimizer& optimizer) {
         auto after = std::make_unique<CosineAnnealingLR>(
             optimizer, CosineAnnealingLROptions(40).eta_min(1e-4));
         return std::make_unique<WarmupScheduler>(
             optimizer, 10, std::move(after));
       },
       50,
       {},
       &golden::kCosineAnnealingWarmupLRLr});
  c.push_back(
      {"CosineAnnealingWarmupLRNoWarmup",
       Opt::kSgd,
       factory<CosineAnnealingWarmupLR>(CosineAnnealingWarmupLROptions(30)),
       30,
       {},
       &golden::kCosineAnnealingWarmupLRNoWarmupLr});
  c.push_back(
      {"FlatAnnealingLR",
       Opt::kSgd,
       factory<FlatAnnealingLR>(FlatAnnealingLROptions(40).pct_start(0.5)),
       40,
       {},
       &golden::kFlatAnnealingLRLr});
  c.push_back(
      {"FlatAnnealingWarmupLR",
       Opt::kSgd,
       factory<FlatAnnealingWarmupLR>(FlatAnnealingWarmupLROptions(50)
                                          .warmup_steps(6)
                                          .pct_start(0.3)
                                          .eta_min(1e-3)),
       50,
       {},
       &golden::kFlatAnnealingWarmupLRLr});
  c.push_back(
      {"MultiStepLR",
       Opt::kSgd,
       factory<MultiStepLR>(
           MultiStepLROptions(50).milestones({25, 10, 25, 40}).gamma(0.5)),
       50,
       {},
       &golden::kMultiStepLRLr});
  c.push_back(
      {"MultiStepWarmupLR",
       Opt::kSgd,
       factory<MultiStepWarmupLR>(MultiStepWarmupLROptions(50)
                                      .warmup_steps(10)
                                      .milestones({5, 10, 20, 35})
                                      .gamma(0.3)),
       50,
       {},
       &golden::kMultiStepWarmupLRLr});
  c.push_back(
      {"OneCycleLRSgd",
       Opt::kSgd,
       factory<OneCycleLR>(OneCycleLROptions(40)),
       40,
       {},
       &golden::kOneCycleLRSgdLr,
       &golden::kOneCycleLRSgdMomentum});
  const auto three_phase = OneCycleLROptions(45)
                               .pct_start(0.25)
                               .anneal_strategy("linear")
                               .base_momentum(0.8)
                               .max_momentum(0.9)
                               .div_factor(10.0)
                               .final_div_factor(100.0)
                               .three_phase(true);
  c.push_back(
      {"OneCycleLRAdamThreePhase",
       Opt::kAdam,
       factory<OneCycleLR>(three_phase),
       45,
       {},
       &golden::kOneCycleLRAdamThreePhaseLr,
       &golden::kOneCycleLRAdamThreePhaseMomentum});
  c.push_back(
      {"OneCycleLRAdamWThreePhase",
       Opt::kAdamW,
       factory<OneCycleLR>(three_phase),
       45,
       {},
       &golden::kOneCycleLRAdamThreePhaseLr,
       &golden::kOneCycleLRAdamThreePhaseMomentum});
  c.push_back(
      {"PolynomialLR",
       Opt::kSgd,
       factory<PolynomialLR>(PolynomialLROptions(40).end_lr(1e-4).power(2.0)),
       45,
       {},
       &golden::kPolynomialLRLr});
  c.push_back(
      {"PolynomialWarmupLR",
       Opt::kSgd,
       factory<PolynomialWarmupLR>(
           PolynomialWarmupLROptions(50).warmup_steps(5).end_lr(1e-3).power(
               0.5)),
       50,
       {},
       &golden::kPolynomialWarmupLRLr});
  c.push_back(
      {"ExponentialLR",
       Opt::kSgd,
       factory<ExponentialLR>(ExponentialLROptions(60).gamma(0.9)),
       60,
       {},
       &golden::kExponentialLRLr});
  c.push_back(
      {"ExponentialLRChained",
       Opt::kSgd,
       factory<ExponentialLR>(ExponentialLROptions(40).gamma(0.95)),
       40,
       {{7, 3.0}},
       &golden::kExponentialLRChainedLr});
  c.push_back(
      {"StepLR",
       Opt::kSgd,
       factory<StepLR>(StepLROptions(50).step_size(7).gamma(0.5)),
       50,
       {},
       &golden::kStepLRLr});
  c.push_back(
      {"LambdaLR",
       Opt::kSgd,
       factory<LambdaLR>(LambdaLROptions(
           40,
           [](int64_t e) { return std::pow(0.97, static_cast<double>(e)); })),
       40,
       {},
       &golden::kLambdaLRLr});
  c.push_back(
      {"LambdaLRPerGroup",
       Opt::kSgd,
       factory<LambdaLR>(LambdaLROptions(
           40,
           std::vector<LrLambda>{
               [](int64_t e) { return std::pow(0.97, static_cast<double>(e)); },
               [](int64_t e) {
                 return 1.0 / static_cast<double>(1 + e / 5);
               }})),
       40,
       {},
       &golden::kLambdaLRPerGroupLr});
  c.push_back(
      {"MultiplicativeLR",
       Opt::kSgd,
       factory<MultiplicativeLR>(MultiplicativeLROptions(
           40, [](int64_t e) { return 0.9 + 0.002 * static_cast<double>(e); })),
       40,
       {},
       &golden::kMultiplicativeLRLr});
  return c;
}

void apply_tweak(const Case& c, torch::optim::Optimizer& optimizer, int64_t s) {
  auto it = c.tweaks.find(s);
  if (it == c.tweaks.end()) {
    return;
  }
  for (auto& group : optimizer.param_groups()) {
    group.options().set_lr(group.options().get_lr() * it->second);
  }
}

void expect_at(
    const Case& c,
    torch::optim::Optimizer& optimizer,
    const sched::LRScheduler& scheduler,
    int64_t s,
    const std::string& where) {
  const std::string what = c.name + " " + where + " step " + std::to_string(s);
  ASSERT_EQ(c.lr->size(), static_cast<size_t>(c.steps + 1)) << c.name;
  EXPECT_EQ(scheduler.last_epoch(), s) << what;
  expect_row(group_lrs(optimizer), (*c.lr)[s], what + " (group lr)");
  expect_row(scheduler.get_last_lr(), (*c.lr)[s], what + " (get_last_lr)");
  if (c.momentum) {
    expect_row(momenta(optimizer), (*c.momentum)[s], what + " (momentum)");
  }
}

class GoldenTest : public ::testing::TestWithParam<Case> {};

TEST_P(GoldenTest, MatchesPyTorch) {
  const Case& c = GetParam();
  tally = Tally();
  auto optimizer = make_optimizer(c.opt);
  auto scheduler = c.make(*optimizer);
  expect_at(c, *optimizer, *scheduler, 0, "uninterrupted");
  for (int64_t s = 1; s <= c.steps; ++s) {
    apply_tweak(c, *optimizer, s);
    scheduler->step();
    expect_at(c, *optimizer, *scheduler, s, "uninterrupted");
  }
  std::cout << "  " << tally.compared - tally.inexact << " of "
            << tally.compared << " values bit-identical to PyTorch\n";
}

// Runs `split` steps, saves, loads into a fresh optimizer and scheduler and
// finishes the run there; every value must equal the uninterrupted run's.
void resume_at(const Case& c, int64_t split, const std::string* file) {
  std::stringstream buffer;
  {
    auto optimizer = make_optimizer(c.opt);
    auto scheduler = c.make(*optimizer);
    for (int64_t s = 1; s <= split; ++s) {
      apply_tweak(c, *optimizer, s);
      scheduler->step();
    }
    torch::serialize::OutputArchive archive;
    scheduler->save(archive);
    if (file) {
      archive.save_to(*file);
    } else {
      archive.save_to(buffer);
    }
  }
  auto optimizer = make_optimizer(c.opt);
  auto scheduler = c.make(*optimizer);
  torch::serialize::InputArchive archive;
  if (file) {
    archive.load_from(*file);
  } else {
    archive.load_from(buffer);
  }
  scheduler->load(archive);
  const std::string where = "resumed at " + std::to_string(split);
  expect_at(c, *optimizer, *scheduler, split, where);
  for (int64_t s = split + 1; s <= c.steps; ++s) {
    apply_tweak(c, *optimizer, s);
    scheduler->step();
    expect_at(c, *optimizer, *scheduler, s, where);
  }
}

TEST_P(GoldenTest, ResumesAfterSaveLoadAtEveryStep) {
  const Case& c = GetParam();
  for (int64_t split = 0; split <= c.steps; ++split) {
    resume_at(c, split, nullptr);
    if (::testing::Test::HasFailure()) {
      return;
    }
  }
}

TEST_P(GoldenTest, ResumesFromArchiveFile) {
  const Case& c = GetParam();
  const std::string file = ::testing::TempDir() + "lr_scheduler_" + c.name +
      "_" + std::to_string(getpid()) + ".pt";
  resume_at(c, c.steps / 2 + 1, &file);
  std::remove(file.c_str());
}

INSTANTIATE_TEST_SUITE_P(
    LRScheduler,
    GoldenTest,
    ::testing::ValuesIn(cases()),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

TEST(LRScheduler, TwoStageKeepsCountingAndExposesAfterScheduler) {
  auto optimizer = make_optimizer(Opt::kSgd);
  sched::CosineAnnealingWarmupLR scheduler(
      *optimizer, sched::CosineAnnealingWarmupLROptions(20).warmup_steps(5));
  for (int i = 0; i < 12; ++i) {
    scheduler.step();
  }
  EXPECT_EQ(scheduler.last_epoch(), 12);
  EXPECT_TRUE(scheduler.finished());
  EXPECT_EQ(scheduler.after_scheduler().last_epoch(), 7);
  EXPECT_EQ(scheduler.after_scheduler().base_lrs(), golden::kInitialLrs);
}

TEST(LRScheduler, OneCycleNeedsMomentumToCycleIt) {
  auto optimizer = make_optimizer(Opt::kAdagrad);
  try {
    sched::OneCycleLR scheduler(*optimizer, sched::OneCycleLROptions(10));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cycle_momentum"), std::string::npos)
        << e.what();
  }
  auto fresh = make_optimizer(Opt::kAdagrad);
  sched::OneCycleLR scheduler(
      *fresh, sched::OneCycleLROptions(10).cycle_momentum(false));
  for (int i = 0; i < 10; ++i) {
    scheduler.step();
  }
  EXPECT_THROW(scheduler.step(), c10::Error); // past total_steps
}

TEST(LRScheduler, RejectsBadOptions) {
  auto optimizer = make_optimizer(Opt::kSgd);
  EXPECT_THROW(
      sched::MultiStepWarmupLR(
          *optimizer, sched::MultiStepWarmupLROptions(10).warmup_steps(2)),
      c10::Error);
  EXPECT_THROW(
      sched::PolynomialLR(
          *optimizer, sched::PolynomialLROptions(10).end_lr(-1)),
      c10::Error);
  EXPECT_THROW(
      sched::OneCycleLR(
          *optimizer, sched::OneCycleLROptions(10).anneal_strategy("exp")),
      c10::Error);
  EXPECT_THROW(
      sched::OneCycleLR(
          *optimizer, sched::OneCycleLROptions(10).pct_start(1.5)),
      c10::Error);
  EXPECT_THROW(
      sched::StepLR(*optimizer, sched::StepLROptions(10).step_size(0)),
      c10::Error);
  EXPECT_THROW(
      sched::LambdaLR(
          *optimizer,
          sched::LambdaLROptions(
              10,
              std::vector<sched::LrLambda>(3, [](int64_t) { return 1.0; }))),
      c10::Error);
}

TEST(LRScheduler, LoadRejectsAnotherKind) {
  auto optimizer = make_optimizer(Opt::kSgd);
  sched::StepLR step(*optimizer, sched::StepLROptions(10));
  torch::serialize::OutputArchive out;
  step.save(out);
  std::stringstream buffer;
  out.save_to(buffer);
  torch::serialize::InputArchive in;
  in.load_from(buffer);
  sched::ExponentialLR exponential(*optimizer, sched::ExponentialLROptions(10));
  try {
    exponential.load(in);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("StepLR"), std::string::npos)
        << e.what();
  }
}

} // namespace
