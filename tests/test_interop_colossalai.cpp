// Checkpoints crossing to Python ColossalAI and back, each side training on
// from the other's files (tests/python/colossalai_interop.py, run in the
// ColossalAI venv that `./scripts/setup.sh --colossalai` makes; skipped
// without it).
//
// A small LLaMA that transformers writes trains two steps on one side under
// a plugin; the model (sharded), the optimizer (sharded, AdamW) and the LR
// scheduler (CosineAnnealingWarmupLR) are saved; the other side loads them
// strictly under another plugin and world size and takes the third step,
// which must give the first side's third step. Pairs (Python at world size
// 1, C++ at world size 2):
//   ColossalAI, no plugin          <-> TorchDDPPlugin
//   ColossalAI, TorchDDPPlugin     <-> LowLevelZeroPlugin stage 2
//   ColossalAI, HybridParallel tp1 <-> HybridParallelPlugin tp 2
// ColossalAI's ZeRO plugins, Gemini and HybridAdam do not run on a CPU (the
// script says how each refuses), so they are not among them. Below: every
// scheduler of colossalai.nn.lr_scheduler, and GPT-2's tied head.
//
// Bounds: the loss of the third step depends only on the loaded weights;
// both sides compute it in fp32 through the same two blocks with sums in
// other orders (and here split over two ranks), a few ulps per dot product:
// relative 1e-5 leaves two orders of magnitude. The weights after the
// step: AdamW moves each by at most about lr (its update is
// lr * m / (sqrt(v) + eps) plus the decay), and the gradients agree to fp32
// rounding, so the updates agree far inside 1e-3 * lr.

#include <colossalai/booster/booster.h>
#include <colossalai/booster/plugin/hybrid_parallel_plugin.h>
#include <colossalai/booster/plugin/low_level_zero_plugin.h>
#include <colossalai/booster/plugin/torch_ddp_plugin.h>
#include <colossalai/checkpoint_io/safetensors.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/models/gpt2.h>
#include <colossalai/models/llama.h>
#include <colossalai/models/pretrained.h>
#include <colossalai/nn/lr_scheduler/all.h>
#include <harness/multiprocess.h>
#include <harness/scheduler_exchange.h>
#include <harness/test_util.h>

#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#ifndef COLOSSALAI_TEST_CAI_PYTHON
#define COLOSSALAI_TEST_CAI_PYTHON ""
#endif

namespace {

namespace cb = colossalai::booster;
namespace ck = colossalai::checkpoint_io;
namespace fs = std::filesystem;
namespace models = colossalai::models;
namespace ls = colossalai::nn::lr_scheduler;
using colossalai::testing::expect_values;
using colossalai::testing::lrs_and_momenta;
using colossalai::testing::sched_optimizer;
using colossalai::testing::SchedulerCase;

// Kept equal to tests/python/colossalai_interop.py's.
constexpr int64_t kVocab = 128;
constexpr double kLr = 1e-3;
constexpr double kWeightDecay = 0.01;
constexpr int64_t kTotalSteps = 10;
constexpr int64_t kWarmupSteps = 2;
constexpr double kLossRtol = 1e-5;
constexpr double kParamAtol = 1e-3 * kLr;

// {Python's plugin, ours}.
const std::vector<std::pair<std::string, std::string>> kPairs = {
    {"none", "ddp"}, {"ddp", "zero2"}, {"hybrid", "tp2"}};

const char* cai_python() {
  return COLOSSALAI_TEST_CAI_PYTHON;
}

bool have_colossalai() {
  const std::string p = cai_python();
  return !p.empty() && ::access(p.c_str(), X_OK) == 0;
}

std::string script() {
  return (fs::path(__FILE__).parent_path() / "python" / "colossalai_interop.py")
      .string();
}

std::string dir() {
  return colossalai::testing::scratch(
      colossalai::testing::test_process(), "colossalai_interop");
}

std::pair<int, std::string> run_script(const std::string& args) {
  return colossalai::testing::run_shell(
      "COLOSSALAI_INTEROP_PORT=" +
      std::to_string(colossalai::testing::free_port()) + " '" + cai_python() +
      "' '" + script() + "' " + args);
}

// Step `step`'s ids, [4, 16] (colossalai_interop.py's batch()), and their
// targets: the next token, none after the last (transformers shifts labels
// so inside its loss).
std::pair<at::Tensor, at::Tensor> batch(int64_t step) {
  const auto b = at::arange(4, at::kLong).view({4, 1});
  const auto t = at::arange(16, at::kLong).view({1, 16});
  const auto ids = (step * 131 + b * 17 + t * 7 + 3).remainder(kVocab);
  auto targets = at::full_like(ids, -100);
  targets.narrow(1, 0, 15).copy_(ids.narrow(1, 1, 15));
  return {ids, targets};
}

std::shared_ptr<cb::plugin::Plugin> make_plugin(const std::string& name) {
  if (name == "ddp") {
    return std::make_shared<cb::plugin::TorchDDPPlugin>();
  }
  if (name == "zero2") {
    return std::make_shared<cb::plugin::LowLevelZeroPlugin>(
        cb::plugin::LowLevelZeroPluginOptions().stage(2).precision("fp32"));
  }
  return std::make_shared<cb::plugin::HybridParallelPlugin>(
      cb::plugin::HybridParallelPluginOptions().tp_size(2).precision("fp32"));
}

// A LLaMA from the base directory, boosted with `plugin` (world size 2),
// AdamW and the scheduler; each rank's share of the batch is its half of
// the rows when the plugin splits data (tp 2 keeps every row).
struct Trainer {
  explicit Trainer(const std::string& plugin_name)
      : dp(plugin_name != "tp2"),
        model(models::from_pretrained<models::LlamaForCausalLM>(
            dir() + "/base")),
        optimizer(std::make_shared<torch::optim::AdamW>(
            model->parameters(),
            torch::optim::AdamWOptions(kLr).weight_decay(kWeightDecay))),
        booster(cb::BoosterOptions().plugin(make_plugin(plugin_name))),
        boosted(booster.boost(model, optimizer)),
        scheduler(
            *optimizer,
            ls::CosineAnnealingWarmupLROptions(kTotalSteps)
                .warmup_steps(kWarmupSteps)) {}

  // One step; returns the whole batch's loss (before the update) and lr.
  std::pair<double, double> step(int64_t s) {
    auto b = batch(s);
    auto ids = b.first, targets = b.second;
    const auto world = colossalai::distributed::world_group();
    if (dp) {
      const int64_t rows = ids.size(0) / world->size();
      ids = ids.narrow(0, rows * world->rank(), rows).contiguous();
      targets = targets.narrow(0, rows * world->rank(), rows).contiguous();
    }
    const double lr = optimizer->param_groups()[0].options().get_lr();
    boosted.optimizer->zero_grad();
    auto loss = model->loss(boosted.model(ids), targets);
    booster.backward(loss, *boosted.optimizer);
    boosted.optimizer->step();
    scheduler.step();
    // Equal rows per rank, so the mean over ranks is the batch's mean (tp:
    // every rank's loss is the batch's already).
    auto total = loss.detach().reshape({1}).to(at::kDouble);
    colossalai::distributed::all_reduce(total, *world).wait();
    return {total.item<double>() / world->size(), lr};
  }

  // The whole weights, as one safetensors file holds them.
  ck::StateDict weights(const std::string& scratch_file) {
    booster.save_model(
        boosted.model,
        scratch_file,
        ck::SaveModelOptions().use_safetensors(true));
    colossalai::distributed::barrier(*colossalai::distributed::world_group())
        .wait();
    return ck::safetensors::load_file(scratch_file);
  }

  bool dp;
  models::LlamaForCausalLM model;
  std::shared_ptr<torch::optim::AdamW> optimizer;
  cb::Booster booster;
  cb::Boosted<models::LlamaForCausalLM, std::nullptr_t, std::nullptr_t> boosted;
  ls::CosineAnnealingWarmupLR scheduler;
};

void expect_next_step(
    const std::string& what,
    double loss,
    double lr,
    const ck::StateDict& after,
    ck::StateDict want) {
  SCOPED_TRACE(what);
  const double want_loss = want["__loss__"].item<double>();
  const double want_lr = want["__lr__"].item<double>();
  want.erase("__loss__");
  want.erase("__lr__");
  EXPECT_NEAR(lr, want_lr, 1e-12 * want_lr);
  EXPECT_NEAR(loss, want_loss, kLossRtol * std::abs(want_loss));
  ASSERT_EQ(after.size(), want.size());
  double worst = 0;
  for (const auto& item : want) {
    const auto* got = after.find(item.key());
    ASSERT_NE(got, nullptr) << item.key();
    worst = std::max(worst, (*got - item.value()).abs().max().item<double>());
  }
  EXPECT_LE(worst, kParamAtol);
  std::cout << std::setprecision(9) << what << ": loss " << loss << " vs " << want_loss
            << ", weights within " << worst << "\n";
}

} // namespace

TEST(InteropColossalAI, CheckpointsCrossBothWaysAndTrainingGoesOn) {
  if (!have_colossalai()) {
    GTEST_SKIP() << "the ColossalAI venv is absent (" << cai_python()
                 << "): ./scripts/setup.sh --colossalai makes it";
  }
  const bool parent = std::getenv("COLOSSALAI_TEST_RANK") == nullptr;
  if (parent) {
    fs::remove_all(dir());
    fs::create_directories(dir());
    std::string plugins;
    for (const auto& p : kPairs) {
      plugins += " " + p.first;
    }
    auto r = run_script("base '" + dir() + "'");
    ASSERT_EQ(r.first, 0) << r.second;
    r = run_script("train '" + dir() + "'" + plugins);
    ASSERT_EQ(r.first, 0) << r.second;
  }
  colossalai::testing::MultiProcessOptions options;
  options.timeout_seconds = 400;
  colossalai::testing::run_distributed(
      2,
      [](int rank, int) {
        for (const auto& pair : kPairs) {
          const auto& ours = pair.second;
          // Python's checkpoint, loaded strictly under our plugin.
          {
            const auto from = dir() + "/py_" + pair.first;
            Trainer run(ours);
            run.booster.load_model(run.boosted.model, from + "/model");
            run.booster.load_optimizer(*run.boosted.optimizer, from + "/optim");
            run.booster.load_lr_scheduler(run.scheduler, from + "/sched.pt");
            const auto step = run.step(2);
            const auto after = run.weights(
                dir() + "/check_" + ours + ".safetensors");
            expect_next_step(
                "ColossalAI " + pair.first + " -> " + ours,
                step.first,
                step.second,
                after,
                ck::safetensors::load_file(from + "/next.safetensors"));
          }
          // Ours, for ColossalAI to load.
          const auto out = dir() + "/cpp_" + ours;
          Trainer run(ours);
          run.step(0);
          run.step(1);
          run.booster.save_model(
              run.boosted.model,
              out + "/model",
              ck::SaveModelOptions().shard(true).use_safetensors(
                  ours != "zero2"));
          run.booster.save_optimizer(
              *run.boosted.optimizer,
              out + "/optim",
              ck::SaveOptimizerOptions().shard(true));
          run.booster.save_lr_scheduler(run.scheduler, out + "/sched.pt");
          const auto step = run.step(2);
          auto after = run.weights(out + "/next_weights.safetensors");
          if (rank == 0) {
            after.insert("__loss__", at::full({1}, step.first, at::kDouble));
            after.insert("__lr__", at::full({1}, step.second, at::kDouble));
            ck::safetensors::save_file(out + "/next.safetensors", after);
          }
        }
      },
      options);
  if (parent) {
    std::string pairs;
    for (const auto& p : kPairs) {
      pairs += " " + p.first + "=cpp_" + p.second;
    }
    const auto r = run_script("resume '" + dir() + "'" + pairs);
    EXPECT_EQ(r.first, 0) << r.second;
    std::istringstream lines(r.second);
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind("resume ", 0) == 0) {
        std::cout << line << "\n"; // what ColossalAI measured
      }
    }
    fs::remove_all(dir());
  }
}

namespace {

template <class S, class O>
std::function<std::unique_ptr<ls::LRScheduler>(torch::optim::Optimizer&)>
make(O options) {
  return [options](torch::optim::Optimizer& o) {
    return std::make_unique<S>(o, options);
  };
}

/// colossalai_interop.py's schedulers(): every scheduler of
/// colossalai.nn.lr_scheduler, a warmup one both in and after its warmup.
std::vector<SchedulerCase> scheduler_cases() {
  return {
      {"CosineAnnealingLR",
       make<ls::CosineAnnealingLR>(ls::CosineAnnealingLROptions(20).eta_min(0.001)),
       6},
      {"CosineAnnealingWarmupLR.warmup",
       make<ls::CosineAnnealingWarmupLR>(
           ls::CosineAnnealingWarmupLROptions(20).warmup_steps(5).eta_min(0.001)),
       3},
      {"CosineAnnealingWarmupLR",
       make<ls::CosineAnnealingWarmupLR>(
           ls::CosineAnnealingWarmupLROptions(20).warmup_steps(5).eta_min(0.001)),
       8},
      {"FlatAnnealingLR",
       make<ls::FlatAnnealingLR>(ls::FlatAnnealingLROptions(20).pct_start(0.5)),
       12},
      {"FlatAnnealingWarmupLR",
       make<ls::FlatAnnealingWarmupLR>(ls::FlatAnnealingWarmupLROptions(20)
                                           .warmup_steps(4)
                                           .pct_start(0.5)
                                           .eta_min(0.001)),
       9},
      {"LinearWarmupLR",
       make<ls::LinearWarmupLR>(ls::LinearWarmupLROptions(20).warmup_steps(5)),
       7},
      {"MultiStepLR",
       make<ls::MultiStepLR>(
           ls::MultiStepLROptions(20).milestones({4, 9}).gamma(0.5)),
       6},
      {"MultiStepWarmupLR",
       make<ls::MultiStepWarmupLR>(ls::MultiStepWarmupLROptions(20)
                                       .warmup_steps(3)
                                       .milestones({6, 11})
                                       .gamma(0.5)),
       8},
      {"OneCycleLR", make<ls::OneCycleLR>(ls::OneCycleLROptions(20)), 7},
      {"PolynomialLR",
       make<ls::PolynomialLR>(
           ls::PolynomialLROptions(20).end_lr(1e-4).power(2.0)),
       5},
      {"PolynomialWarmupLR",
       make<ls::PolynomialWarmupLR>(ls::PolynomialWarmupLROptions(20)
                                        .warmup_steps(4)
                                        .end_lr(1e-4)
                                        .power(2.0)),
       6},
      {"ExponentialLR",
       make<ls::ExponentialLR>(ls::ExponentialLROptions(20).gamma(0.9)),
       5},
      {"StepLR",
       make<ls::StepLR>(ls::StepLROptions(20).step_size(3).gamma(0.5)),
       7},
      {"LambdaLR",
       make<ls::LambdaLR>(ls::LambdaLROptions(20, [](int64_t e) {
         return std::pow(0.97, static_cast<double>(e));
       })),
       5},
      {"MultiplicativeLR",
       make<ls::MultiplicativeLR>(ls::MultiplicativeLROptions(20, [](int64_t e) {
         return 0.9 + 0.002 * static_cast<double>(e);
       })),
       5},
  };
}

} // namespace

// Every scheduler of colossalai.nn.lr_scheduler crosses both ways through
// the booster's files: ColossalAI's scheduler loads what we saved and its
// next step (learning rates and OneCycleLR's momenta) equals ours; we load
// what ColossalAI's booster saved and our next step equals its own.
TEST(InteropColossalAI, EverySchedulerCrossesBothWays) {
  if (!have_colossalai()) {
    GTEST_SKIP() << "the ColossalAI venv is absent (" << cai_python()
                 << "): ./scripts/setup.sh --colossalai makes it";
  }
  colossalai::testing::ScratchDir scratch("colossalai_interop_sched");
  const auto d = scratch.path;
  cb::Booster booster;
  std::map<std::string, std::vector<double>> ours;
  for (const auto& c : scheduler_cases()) {
    auto optimizer = sched_optimizer();
    auto scheduler = c.make(*optimizer);
    for (int64_t i = 0; i < c.steps; ++i) {
      scheduler->step();
    }
    booster.save_lr_scheduler(*scheduler, d + "/cpp_" + c.name + ".pt");
    scheduler->step();
    ours[c.name] = lrs_and_momenta(*optimizer, *scheduler);
  }
  const auto r = run_script("sched '" + d + "'");
  ASSERT_EQ(r.first, 0) << r.second;
  const auto from_ours =
      ck::safetensors::load_file(d + "/from_cpp_next.safetensors");
  const auto theirs = ck::safetensors::load_file(d + "/py_next.safetensors");
  for (const auto& c : scheduler_cases()) {
    SCOPED_TRACE(c.name);
    {
      SCOPED_TRACE("ColossalAI's step after loading our file");
      expect_values(from_ours.find(c.name), ours[c.name], "ColossalAI");
    }
    auto optimizer = sched_optimizer();
    auto scheduler = c.make(*optimizer);
    booster.load_lr_scheduler(*scheduler, d + "/py_" + c.name + ".pt");
    EXPECT_EQ(scheduler->last_epoch(), c.steps);
    scheduler->step();
    SCOPED_TRACE("our step after loading ColossalAI's file");
    expect_values(
        theirs.find(c.name),
        lrs_and_momenta(*optimizer, *scheduler),
        "ColossalAI");
  }
}

// GPT-2's tied head (lm_head.weight is transformer.wte.weight) crosses
// strictly both ways through sharded .bin files, which hold it under both
// names as Python's state_dict() does: we load ColossalAI's save strictly
// and hold the weights transformers wrote, bit for bit; ColossalAI loads
// ours strictly (no plugin, TorchDDPPlugin) and holds them too.
TEST(InteropColossalAI, TiedHeadsCrossStrictly) {
  if (!have_colossalai()) {
    GTEST_SKIP() << "the ColossalAI venv is absent (" << cai_python()
                 << "): ./scripts/setup.sh --colossalai makes it";
  }
  colossalai::testing::ScratchDir scratch("colossalai_interop_tied");
  const auto d = scratch.path;
  auto r = run_script("tied '" + d + "'");
  ASSERT_EQ(r.first, 0) << r.second;
  auto want = models::from_pretrained<models::GPT2LMHeadModel>(d + "/gpt2_base");
  torch::manual_seed(1);
  models::GPT2LMHeadModel model(want->config());
  cb::Booster booster;
  auto boosted = booster.boost(model);
  booster.load_model(boosted.model, d + "/py_gpt2"); // strict
  const auto got = ck::model_state_dict(*model);
  for (const auto& item : ck::model_state_dict(*want)) {
    ASSERT_NE(got.find(item.key()), nullptr) << item.key();
    EXPECT_TRUE(at::equal(got[item.key()], item.value())) << item.key();
  }
  booster.save_model(
      boosted.model, d + "/cpp_gpt2", ck::SaveModelOptions().shard(true));
  r = run_script("tied_check '" + d + "'");
  EXPECT_EQ(r.first, 0) << r.second;
}
