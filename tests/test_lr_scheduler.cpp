// Learning-rate schedulers against values recorded from PyTorch /
// ColossalAI (golden/gen_lr_scheduler_golden.py), and save/load resumption
// (LibTorch archives, and Python's state_dict() as a dict and as a file).

#include <colossalai/booster/booster.h>
#include <colossalai/checkpoint_io/torch_bin.h>
#include <colossalai/nn/lr_scheduler/all.h>
#include <harness/test_util.h>
#include <src/checkpoint_io/pickle_reader.h>

#include <caffe2/serialize/inline_container.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "golden/lr_scheduler_golden.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
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

// Runs `split` steps, hands the state to a fresh optimizer and scheduler
// (as a state_dict(), or through the file save_lr_scheduler writes) and then
// steps both to the end: the resumed one must equal the original bit for bit
// (lr, get_last_lr, momentum, last_epoch) and the golden values.
void resume_from_state_dict(
    const Case& c,
    int64_t split,
    const std::string* file) {
  auto original_optimizer = make_optimizer(c.opt);
  auto original = c.make(*original_optimizer);
  for (int64_t s = 1; s <= split; ++s) {
    apply_tweak(c, *original_optimizer, s);
    original->step();
  }
  auto optimizer = make_optimizer(c.opt);
  auto scheduler = c.make(*optimizer);
  if (file) {
    colossalai::booster::Booster booster;
    booster.save_lr_scheduler(*original, *file);
    booster.load_lr_scheduler(*scheduler, *file);
  } else {
    scheduler->load_state_dict(original->state_dict());
  }
  const std::string where = std::string("state_dict ") + (file ? "file " : "") +
      "resumed at " + std::to_string(split);
  auto same = [&](int64_t s) {
    const std::string what =
        c.name + " " + where + " step " + std::to_string(s);
    EXPECT_EQ(scheduler->last_epoch(), original->last_epoch()) << what;
    EXPECT_EQ(scheduler->get_last_lr(), original->get_last_lr()) << what;
    EXPECT_EQ(group_lrs(*optimizer), group_lrs(*original_optimizer)) << what;
    if (c.momentum) {
      EXPECT_EQ(momenta(*optimizer), momenta(*original_optimizer)) << what;
    }
    expect_at(c, *optimizer, *scheduler, s, where);
  };
  same(split);
  for (int64_t s = split + 1; s <= c.steps; ++s) {
    apply_tweak(c, *original_optimizer, s);
    apply_tweak(c, *optimizer, s);
    original->step();
    scheduler->step();
    same(s);
  }
}

TEST_P(GoldenTest, ResumesFromStateDictAtEveryStep) {
  const Case& c = GetParam();
  for (int64_t split = 0; split <= c.steps; ++split) {
    resume_from_state_dict(c, split, nullptr);
    if (::testing::Test::HasFailure()) {
      return;
    }
  }
}

// Early (inside the first stage of two-stage schedulers) and past the middle
// (inside the second).
TEST_P(GoldenTest, ResumesFromStateDictFile) {
  const Case& c = GetParam();
  colossalai::testing::ScratchDir dir("lr_scheduler_state_dict");
  const std::string file = dir.path + "/" + c.name + ".pt";
  resume_from_state_dict(c, 2, &file);
  resume_from_state_dict(c, c.steps / 2 + 1, &file);
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

const c10::IValue& entry(
    const c10::impl::GenericDict& d,
    const std::string& key) {
  auto it = d.find(c10::IValue(key));
  TORCH_CHECK(it != d.end(), "no '", key, "' in the state dict");
  return it->value();
}

std::vector<double> doubles(const c10::IValue& list) {
  std::vector<double> out;
  for (const auto& v : list.toListRef()) {
    out.push_back(v.toDouble());
  }
  return out;
}

// The keys and types Python's schedulers hold.
TEST(LRSchedulerStateDict, HasPythonsKeys) {
  namespace s = sched;
  auto optimizer = make_optimizer(Opt::kSgd);
  s::CosineAnnealingLR cosine(
      *optimizer, s::CosineAnnealingLROptions(25).eta_min(0.001));
  cosine.step();
  cosine.step();
  auto d = cosine.state_dict();
  EXPECT_EQ(entry(d, "last_epoch").toInt(), 2);
  EXPECT_EQ(entry(d, "_step_count").toInt(), 3);
  EXPECT_EQ(doubles(entry(d, "base_lrs")), golden::kInitialLrs);
  EXPECT_EQ(doubles(entry(d, "_last_lr")), cosine.get_last_lr());
  EXPECT_FALSE(entry(d, "_get_lr_called_within_step").toBool());
  EXPECT_FALSE(entry(d, "verbose").toBool());
  EXPECT_EQ(entry(d, "T_max").toInt(), 25);
  EXPECT_EQ(entry(d, "eta_min").toDouble(), 0.001);
  EXPECT_FALSE(d.contains("optimizer"));

  auto multistep = s::MultiStepLR(
                       *make_optimizer(Opt::kSgd),
                       s::MultiStepLROptions(50).milestones({25, 10, 25}))
                       .state_dict();
  const auto milestones = entry(multistep, "milestones").toGenericDict();
  ASSERT_EQ(milestones.size(), 2u);
  EXPECT_EQ(milestones.at(c10::IValue(int64_t{10})).toInt(), 1);
  EXPECT_EQ(milestones.at(c10::IValue(int64_t{25})).toInt(), 2);
  EXPECT_EQ(entry(multistep, "gamma").toDouble(), 0.1);

  auto step = s::StepLR(
                  *make_optimizer(Opt::kSgd),
                  s::StepLROptions(50).step_size(7).gamma(0.5))
                  .state_dict();
  EXPECT_EQ(entry(step, "step_size").toInt(), 7);
  EXPECT_EQ(entry(step, "gamma").toDouble(), 0.5);

  auto lambda = s::LambdaLR(
                    *make_optimizer(Opt::kSgd),
                    s::LambdaLROptions(10, [](int64_t) { return 1.0; }))
                    .state_dict();
  const auto lambdas = entry(lambda, "lr_lambdas").toListRef();
  ASSERT_EQ(lambdas.size(), golden::kInitialLrs.size());
  EXPECT_TRUE(lambdas[0].isNone());

  auto poly = s::PolynomialLR(
                  *make_optimizer(Opt::kSgd),
                  s::PolynomialLROptions(40).end_lr(1e-4).power(2.0))
                  .state_dict();
  EXPECT_EQ(entry(poly, "total_steps").toInt(), 40);
  EXPECT_EQ(entry(poly, "end_lr").toDouble(), 1e-4);
  EXPECT_EQ(entry(poly, "power").toDouble(), 2.0);

  auto linear = s::LinearWarmupLR(
                    *make_optimizer(Opt::kSgd),
                    s::LinearWarmupLROptions(40).warmup_steps(8))
                    .state_dict();
  EXPECT_EQ(entry(linear, "warmup_steps").toInt(), 8);
  EXPECT_EQ(entry(linear, "total_steps").toInt(), 40);

  auto adam = make_optimizer(Opt::kAdam);
  auto one_cycle =
      s::OneCycleLR(*adam, s::OneCycleLROptions(40).three_phase(true))
          .state_dict();
  EXPECT_EQ(entry(one_cycle, "total_steps").toInt(), 40);
  EXPECT_EQ(entry(one_cycle, "_anneal_func_type").toStringRef(), "cos");
  EXPECT_TRUE(entry(one_cycle, "cycle_momentum").toBool());
  EXPECT_TRUE(entry(one_cycle, "use_beta1").toBool());
  const auto phases = entry(one_cycle, "_schedule_phases").toListRef();
  ASSERT_EQ(phases.size(), 3u);
  const auto last = phases[2].toGenericDict();
  EXPECT_EQ(entry(last, "end_step").toDouble(), 39.0);
  EXPECT_EQ(entry(last, "start_lr").toStringRef(), "initial_lr");
  EXPECT_EQ(entry(last, "end_lr").toStringRef(), "min_lr");
  EXPECT_EQ(entry(last, "start_momentum").toStringRef(), "max_momentum");
  EXPECT_EQ(entry(last, "end_momentum").toStringRef(), "max_momentum");
  EXPECT_EQ(entry(phases[0].toGenericDict(), "end_step").toDouble(), 11.0);
  EXPECT_FALSE(
      entry(
          s::OneCycleLR(*make_optimizer(Opt::kSgd), s::OneCycleLROptions(10))
              .state_dict(),
          "use_beta1")
          .toBool());

  // Two-stage: ColossalAI's TwoStageScheduler.state_dict, with the second
  // stage's Python class name.
  auto warm_opt = make_optimizer(Opt::kSgd);
  s::CosineAnnealingWarmupLR warm(
      *warm_opt, s::CosineAnnealingWarmupLROptions(20).warmup_steps(5));
  for (int i = 0; i < 7; ++i) {
    warm.step();
  }
  auto w = warm.state_dict();
  EXPECT_EQ(entry(w, "warmup_epochs").toInt(), 5);
  EXPECT_TRUE(entry(w, "finished").toBool());
  EXPECT_EQ(
      entry(w, "after_scheduler_type").toStringRef(), "CosineAnnealingLR");
  const auto inner = entry(w, "after_scheduler_dict").toGenericDict();
  EXPECT_EQ(entry(inner, "T_max").toInt(), 15);
  EXPECT_EQ(entry(inner, "last_epoch").toInt(), 2);
  EXPECT_FALSE(w.contains("after_scheduler"));
  // ColossalAI's own last_epoch stops at the switch (its second stage
  // counts on); ours reads back as the 7 steps taken, and a state that
  // counted on (earlier files of this library) loads the same.
  EXPECT_EQ(warm.last_epoch(), 7);
  EXPECT_EQ(entry(w, "last_epoch").toInt(), 5);
  EXPECT_EQ(entry(w, "_step_count").toInt(), 6);
  for (int64_t saved : {5, 7}) {
    auto state = w.copy();
    state.insert_or_assign("last_epoch", saved);
    auto o = make_optimizer(Opt::kSgd);
    s::CosineAnnealingWarmupLR back(
        *o, s::CosineAnnealingWarmupLROptions(20).warmup_steps(5));
    back.load_state_dict(state);
    EXPECT_EQ(back.last_epoch(), 7) << "saved last_epoch " << saved;
  }

  auto flat = s::FlatAnnealingWarmupLR(
                  *make_optimizer(Opt::kSgd),
                  s::FlatAnnealingWarmupLROptions(50).warmup_steps(6))
                  .state_dict();
  EXPECT_EQ(entry(flat, "warmup_epochs").toInt(), 6);
  EXPECT_EQ(entry(flat, "delay_epochs").toInt(), 31); // int(44 * 0.72)
  EXPECT_FALSE(entry(flat, "finished").toBool());
  EXPECT_EQ(
      entry(
          s::FlatAnnealingLR(
              *make_optimizer(Opt::kSgd), s::FlatAnnealingLROptions(40))
              .state_dict(),
          "delay_epochs")
          .toInt(),
      28);
  EXPECT_EQ(
      entry(
          s::MultiStepWarmupLR(
              *make_optimizer(Opt::kSgd),
              s::MultiStepWarmupLROptions(50).warmup_steps(2).milestones({5}))
              .state_dict(),
          "after_scheduler_type")
          .toStringRef(),
      "MultiStepLR");
  EXPECT_EQ(
      entry(
          s::PolynomialWarmupLR(
              *make_optimizer(Opt::kSgd), s::PolynomialWarmupLROptions(50))
              .state_dict(),
          "after_scheduler_type")
          .toStringRef(),
      "PolynomialLR");
}

std::string load_error(
    sched::LRScheduler& scheduler,
    const c10::impl::GenericDict& state) {
  return colossalai::testing::error_of(
      [&] { scheduler.load_state_dict(state); });
}

void expect_has(const std::string& msg, const std::string& part) {
  EXPECT_NE(msg.find(part), std::string::npos)
      << "'" << part << "' not in: " << msg;
}

TEST(LRSchedulerStateDict, RefusesWhatItCannotApply) {
  namespace s = sched;
  auto optimizer = make_optimizer(Opt::kSgd);
  s::StepLR step(*optimizer, s::StepLROptions(50).step_size(3));
  for (int i = 0; i < 4; ++i) {
    step.step();
  }
  const auto lrs = step.get_last_lr();

  auto no_epoch = step.state_dict();
  ASSERT_EQ(no_epoch.erase("last_epoch"), 1u);
  auto msg = load_error(step, no_epoch);
  expect_has(msg, "StepLR");
  expect_has(msg, "'last_epoch'");

  auto one_group = step.state_dict();
  c10::impl::GenericList one(c10::AnyType::get());
  one.push_back(c10::IValue(0.1));
  one_group.insert_or_assign("base_lrs", one);
  msg = load_error(step, one_group);
  expect_has(msg, "StepLR");
  expect_has(msg, "'base_lrs' has 1 entries");
  expect_has(msg, "optimizer has 2");

  auto not_numbers = step.state_dict();
  not_numbers.insert_or_assign("_last_lr", c10::IValue("0.1"));
  expect_has(load_error(step, not_numbers), "'_last_lr'");

  auto warm_opt = make_optimizer(Opt::kSgd);
  s::CosineAnnealingWarmupLR warm(
      *warm_opt, s::CosineAnnealingWarmupLROptions(20).warmup_steps(5));
  for (int i = 0; i < 7; ++i) {
    warm.step();
  }
  auto cos_opt = make_optimizer(Opt::kSgd);
  s::CosineAnnealingLR cosine(*cos_opt, s::CosineAnnealingLROptions(15));
  msg = load_error(cosine, warm.state_dict());
  expect_has(msg, "CosineAnnealingLR");
  expect_has(msg, "two-stage scheduler's state");

  auto other_opt = make_optimizer(Opt::kSgd);
  s::CosineAnnealingWarmupLR other(
      *other_opt, s::CosineAnnealingWarmupLROptions(20).warmup_steps(5));
  auto wrong_type = warm.state_dict();
  wrong_type.insert_or_assign("after_scheduler_type", "MultiStepLR");
  msg = load_error(other, wrong_type);
  expect_has(msg, "CosineAnnealingWarmupLR");
  expect_has(msg, "MultiStepLR");
  expect_has(msg, "CosineAnnealingLR");

  auto no_finished = warm.state_dict();
  ASSERT_EQ(no_finished.erase("finished"), 1u);
  expect_has(load_error(other, no_finished), "'finished'");

  auto bad_inner = warm.state_dict();
  auto inner = bad_inner.at("after_scheduler_dict").toGenericDict().copy();
  ASSERT_EQ(inner.erase("_last_lr"), 1u);
  bad_inner.insert_or_assign("after_scheduler_dict", inner);
  msg = load_error(other, bad_inner);
  expect_has(msg, "after_scheduler_dict");
  expect_has(msg, "'_last_lr'");

  // A refused state changes nothing.
  EXPECT_EQ(step.last_epoch(), 4);
  EXPECT_EQ(step.get_last_lr(), lrs);
  EXPECT_EQ(group_lrs(*optimizer), lrs);
  EXPECT_EQ(other.last_epoch(), 0);
  EXPECT_FALSE(other.finished());
  EXPECT_EQ(other.after_scheduler().last_epoch(), 0);
}

// Python pickles an integral lr as an int; the keys Python adds (and the
// options' copies) are ignored.
TEST(LRSchedulerStateDict, TakesPythonsIntsAndIgnoresOtherKeys) {
  std::vector<torch::Tensor> params{torch::zeros({2}, torch::requires_grad())};
  torch::optim::SGD a(params, torch::optim::SGDOptions(1.0));
  sched::StepLR step(a, sched::StepLROptions(10).step_size(2).gamma(0.5));
  auto state = step.state_dict();
  c10::impl::GenericList ints(c10::AnyType::get());
  ints.push_back(c10::IValue(int64_t{2}));
  state.insert_or_assign("base_lrs", ints);
  state.insert_or_assign("_last_lr", ints);
  state.insert_or_assign("last_epoch", int64_t{3});
  state.insert_or_assign("_is_initial", false);
  state.insert_or_assign("step_size", int64_t{100}); // not read
  torch::optim::SGD b(params, torch::optim::SGDOptions(1.0));
  sched::StepLR resumed(b, sched::StepLROptions(10).step_size(2).gamma(0.5));
  resumed.load_state_dict(state);
  EXPECT_EQ(resumed.last_epoch(), 3);
  EXPECT_EQ(resumed.base_lrs(), std::vector<double>{2.0});
  EXPECT_EQ(resumed.get_last_lr(), std::vector<double>{2.0});
  EXPECT_EQ(group_lrs(b), std::vector<double>{2.0});
  resumed.step(); // step 4: a multiple of step_size 2
  EXPECT_EQ(resumed.get_last_lr(), std::vector<double>{1.0});
}

// Files of the old format (a LibTorch archive of `save`) still load; a file
// that is neither refuses naming it.
TEST(LRSchedulerStateDict, LoadsOldArchiveFilesAndNamesBadOnes) {
  colossalai::testing::ScratchDir dir("lr_scheduler_files");
  colossalai::booster::Booster booster;
  auto original_optimizer = make_optimizer(Opt::kSgd);
  sched::CosineAnnealingLR original(
      *original_optimizer, sched::CosineAnnealingLROptions(20));
  for (int i = 0; i < 7; ++i) {
    original.step();
  }
  const std::string old_file = dir.path + "/old.pt";
  {
    torch::serialize::OutputArchive archive;
    original.save(archive);
    archive.save_to(old_file);
  }
  auto optimizer = make_optimizer(Opt::kSgd);
  sched::CosineAnnealingLR resumed(
      *optimizer, sched::CosineAnnealingLROptions(20));
  booster.load_lr_scheduler(resumed, old_file);
  EXPECT_EQ(resumed.last_epoch(), 7);
  for (int i = 0; i < 5; ++i) {
    original.step();
    resumed.step();
    EXPECT_EQ(resumed.get_last_lr(), original.get_last_lr());
  }

  const std::string garbage = dir.path + "/garbage.pt";
  std::ofstream(garbage) << "not a checkpoint";
  auto msg = colossalai::testing::error_of(
      [&] { booster.load_lr_scheduler(resumed, garbage); });
  expect_has(msg, "garbage.pt");

  const std::string list = dir.path + "/list.pt";
  {
    c10::impl::GenericList values(c10::AnyType::get());
    values.push_back(c10::IValue(1.0));
    const auto bytes = colossalai::checkpoint_io::pickle_archive(values);
    std::ofstream(list, std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  msg = colossalai::testing::error_of(
      [&] { booster.load_lr_scheduler(resumed, list); });
  expect_has(msg, "list.pt");
  expect_has(msg, "state_dict");

  // A refusal of the scheduler names the file too.
  const std::string warm_file = dir.path + "/warm.pt";
  auto warm_optimizer = make_optimizer(Opt::kSgd);
  sched::CosineAnnealingWarmupLR warm(
      *warm_optimizer,
      sched::CosineAnnealingWarmupLROptions(20).warmup_steps(5));
  booster.save_lr_scheduler(warm, warm_file);
  msg = colossalai::testing::error_of(
      [&] { booster.load_lr_scheduler(resumed, warm_file); });
  expect_has(msg, "warm.pt");
  expect_has(msg, "two-stage");
  EXPECT_EQ(resumed.last_epoch(), 12);
}

// The pickle opcodes (protocol 2) Python's torch.save writes for a state
// dict, to make Python's files here without Python.
struct PythonPickle {
  std::string bytes = "\x80\x02"; // PROTO 2
  void str(const std::string& s) {
    bytes += 'X'; // BINUNICODE
    for (int k = 0; k < 4; ++k) {
      bytes += static_cast<char>((s.size() >> (8 * k)) & 0xff);
    }
    bytes += s;
  }
  void small_int(int v) {
    bytes += 'K'; // BININT1
    bytes += static_cast<char>(v);
  }
  void real(double v) {
    bytes += 'G'; // BINFLOAT, big-endian
    uint64_t u = 0;
    std::memcpy(&u, &v, 8);
    for (int k = 7; k >= 0; --k) {
      bytes += static_cast<char>((u >> (8 * k)) & 0xff);
    }
  }
  void reals(const std::vector<double>& vs) {
    bytes += "]("; // EMPTY_LIST, MARK
    for (double v : vs) {
      real(v);
    }
    bytes += 'e'; // APPENDS
  }
  void save(const std::string& path) const {
    caffe2::serialize::PyTorchStreamWriter writer(path);
    writer.writeRecord("data.pkl", bytes.data(), bytes.size());
    writer.writeEndOfFile();
  }
};

// Python's MultiStepLR pickles its milestones as collections.Counter
// (REDUCE of Counter on one dict); the reader takes the dict.
TEST(LRSchedulerStateDict, LoadsPythonsMultiStepLRWithItsCounter) {
  colossalai::testing::ScratchDir dir("lr_scheduler_counter");
  PythonPickle p;
  p.bytes += "}("; // EMPTY_DICT, MARK
  p.str("milestones");
  p.bytes += "ccollections\nCounter\n}("; // GLOBAL, EMPTY_DICT, MARK
  p.small_int(3);
  p.small_int(1);
  p.small_int(8);
  p.small_int(2);
  p.bytes += "u\x85R"; // SETITEMS, TUPLE1, REDUCE
  p.str("gamma");
  p.real(0.5);
  p.str("base_lrs");
  p.reals(golden::kInitialLrs);
  p.str("last_epoch");
  p.small_int(7);
  p.str("_step_count");
  p.small_int(8);
  p.str("_is_initial");
  p.bytes += '\x89'; // NEWFALSE
  p.str("_last_lr");
  p.reals({0.05, 0.015});
  p.bytes += "u."; // SETITEMS, STOP
  const std::string file = dir.path + "/multistep.pt";
  p.save(file);

  const auto state =
      colossalai::checkpoint_io::detail::load_pickle(file).toGenericDict();
  const auto milestones = entry(state, "milestones").toGenericDict();
  ASSERT_EQ(milestones.size(), 2u);
  EXPECT_EQ(milestones.at(c10::IValue(int64_t{8})).toInt(), 2);

  const auto options =
      sched::MultiStepLROptions(50).milestones({3, 8, 8}).gamma(0.5);
  auto original_optimizer = make_optimizer(Opt::kSgd);
  sched::MultiStepLR original(*original_optimizer, options);
  for (int i = 0; i < 7; ++i) {
    original.step();
  }
  auto optimizer = make_optimizer(Opt::kSgd);
  sched::MultiStepLR resumed(*optimizer, options);
  colossalai::booster::Booster booster;
  booster.load_lr_scheduler(resumed, file);
  EXPECT_EQ(resumed.last_epoch(), 7);
  EXPECT_EQ(resumed.get_last_lr(), original.get_last_lr());
  for (int i = 0; i < 3; ++i) {
    original.step();
    resumed.step();
    EXPECT_EQ(resumed.get_last_lr(), original.get_last_lr());
    EXPECT_EQ(group_lrs(*optimizer), group_lrs(*original_optimizer));
  }

  // Counter() pickles with no arguments: an empty dict.
  PythonPickle empty;
  empty.bytes += "ccollections\nCounter\n)R."; // GLOBAL, EMPTY_TUPLE, REDUCE
  empty.save(dir.path + "/empty.pt");
  const auto none =
      colossalai::checkpoint_io::detail::load_pickle(dir.path + "/empty.pt");
  ASSERT_TRUE(none.isGenericDict());
  EXPECT_EQ(none.toGenericDict().size(), 0u);
}

} // namespace
