// Training checkpoints (NOTE [Training checkpoints]): save_checkpoint and
// resume_or_start. A run resumed from any checkpoint ends with the weights
// of a run that was never stopped; a process killed at every commit step of
// a save leaves the previous or the new set, never a partial one; a damaged
// set is skipped, by name and reason, for the one before; a set saved under
// ZeRO on two ranks resumes in one process without a plugin.

#include <colossalai/booster/booster.h>
#include <colossalai/booster/plugin/low_level_zero_plugin.h>
#include <colossalai/booster/plugin/torch_ddp_plugin.h>
#include <colossalai/data/distributed_sampler.h>
#include <colossalai/booster/training_checkpoint.h>
#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/nn/lr_scheduler/cosine.h>
#include <harness/multiprocess.h>
#include <harness/test_util.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <csignal>
#include <set>
#include <sstream>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

namespace cb = colossalai::booster;
namespace ck = colossalai::checkpoint_io;
namespace fs = std::filesystem;
namespace ls = colossalai::nn::lr_scheduler;
using colossalai::testing::error_of;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    return fc2(torch::tanh(fc1(x)));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

constexpr int64_t kSteps = 8;

// A model, AdamW and a cosine schedule under `plugin` (none: one process);
// the weights start from seed 0 on every rank.
struct Trainer {
  explicit Trainer(std::shared_ptr<cb::plugin::Plugin> plugin = nullptr)
      : net((torch::manual_seed(0), Net())),
        optimizer(std::make_shared<torch::optim::AdamW>(
            net->parameters(),
            torch::optim::AdamWOptions(1e-2).weight_decay(0.01))),
        booster(cb::BoosterOptions().plugin(std::move(plugin))),
        boosted(booster.boost(net, optimizer)),
        scheduler(*optimizer, ls::CosineAnnealingLROptions(kSteps)) {}

  // Steps [from, to) on batches that depend only on the step (this rank's
  // half of them under two ranks), saving every `every` steps into `dir`.
  void train(
      int64_t from,
      int64_t to,
      const std::string& dir = "",
      int64_t every = 0,
      int rank = 0,
      int world = 1) {
    for (int64_t s = from; s < to; ++s) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + s);
      auto x = at::randn({8, 8}, gen), y = at::randn({8, 4}, gen);
      x = x.narrow(0, 8 / world * rank, 8 / world);
      y = y.narrow(0, 8 / world * rank, 8 / world);
      boosted.optimizer->zero_grad();
      booster.backward(
          colossalai::testing::mse_loss(boosted.model(x), y),
          *boosted.optimizer);
      boosted.optimizer->step();
      scheduler.step();
      if (every > 0 && (s + 1) % every == 0) {
        booster.save_checkpoint(
            dir,
            cb::TrainingState().step(s + 1),
            boosted.model,
            boosted.optimizer.get(),
            &scheduler);
      }
    }
  }

  cb::TrainingState resume(const std::string& dir) {
    return booster.resume_or_start(
        dir, boosted.model, boosted.optimizer.get(), &scheduler);
  }

  Net net;
  std::shared_ptr<torch::optim::AdamW> optimizer;
  cb::Booster booster;
  cb::Boosted<Net, std::nullptr_t, std::nullptr_t> boosted;
  ls::CosineAnnealingLR scheduler;
};

std::vector<at::Tensor> uninterrupted(int64_t steps) {
  Trainer t;
  t.train(0, steps);
  return colossalai::testing::host(t.net->parameters());
}

void expect_equal(
    const std::vector<at::Tensor>& want,
    const std::vector<at::Tensor>& got,
    const std::string& what) {
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(at::equal(want[i], got[i]))
        << what << ": parameter " << i << " differs by "
        << (want[i] - got[i]).abs().max().item<double>();
  }
}

std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    out.push_back(e.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Samples whose one feature is their index.
auto index_dataset(int64_t n) {
  return torch::data::datasets::TensorDataset(
             at::arange(n, at::kFloat).unsqueeze(1))
      .map(torch::data::transforms::Stack<torch::data::TensorExample>());
}

// One line per file: the ids separated by spaces.
std::vector<size_t> read_ids(const std::string& file) {
  std::ifstream in(file);
  std::vector<size_t> ids;
  size_t id;
  while (in >> id) {
    ids.push_back(id);
  }
  return ids;
}

} // namespace

TEST(TrainingCheckpoint, ResumesToTheUninterruptedWeightsAndKeepsTheLastK) {
  colossalai::testing::ScratchDir dir("colossalai_training_ckpt");
  const auto ckpt = dir.path + "/ckpt";
  {
    Trainer fresh;
    EXPECT_EQ(fresh.resume(ckpt).step(), 0); // nothing there: a fresh start
    fresh.train(0, 6, ckpt, 2);
  }
  // keep_last 2: the two newest, nothing hidden left behind.
  EXPECT_EQ(
      names_in(ckpt),
      (std::vector<std::string>{"checkpoint-4", "checkpoint-6"}));
  for (const auto& info : cb::list_training_checkpoints(ckpt)) {
    EXPECT_TRUE(info.problem.empty()) << info.path << ": " << info.problem;
  }
  Trainer resumed;
  const auto state = resumed.resume(ckpt);
  EXPECT_EQ(state.step(), 6);
  EXPECT_EQ(resumed.scheduler.last_epoch(), 6);
  resumed.train(state.step(), kSteps);
  expect_equal(
      uninterrupted(kSteps),
      colossalai::testing::host(resumed.net->parameters()),
      "resumed at 6");

  // A damaged newest set is skipped, by name and reason, for the previous.
  const auto shard = [&](const std::string& set) {
    for (const auto& e : fs::recursive_directory_iterator(ckpt + "/" + set)) {
      if (e.path().extension() == ".safetensors") {
        return e.path().string();
      }
    }
    return std::string();
  };
  {
    std::fstream f(shard("checkpoint-6"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x7f'); // a flipped byte inside a tensor: safetensors cannot tell
  }
  Trainer fallback;
  testing::internal::CaptureStderr();
  const auto back = fallback.resume(ckpt);
  const auto said = testing::internal::GetCapturedStderr();
  EXPECT_EQ(back.step(), 4);
  EXPECT_NE(said.find("skipping"), std::string::npos) << said;
  EXPECT_NE(said.find("checkpoint-6"), std::string::npos) << said;
  EXPECT_NE(said.find("checksum"), std::string::npos) << said;
  fallback.train(back.step(), kSteps);
  expect_equal(
      uninterrupted(kSteps),
      colossalai::testing::host(fallback.net->parameters()),
      "resumed at 4");

  // Cut short, or a set without a manifest (not ours): skipped too.
  fs::resize_file(shard("checkpoint-4"), fs::file_size(shard("checkpoint-4")) / 2);
  testing::internal::CaptureStderr();
  EXPECT_EQ(Trainer().resume(ckpt).step(), 0);
  const auto none = testing::internal::GetCapturedStderr();
  EXPECT_NE(none.find("bytes, the manifest says"), std::string::npos) << none;

  // Bad options and states are refused by name.
  Trainer t;
  auto e = error_of([&] {
    t.booster.save_checkpoint(
        ckpt, cb::TrainingState().step(-3), t.boosted.model, t.boosted.optimizer.get());
  });
  EXPECT_NE(e.find("must be >= 0"), std::string::npos) << e;
  e = error_of([&] {
    t.booster.save_checkpoint(
        ckpt,
        cb::TrainingState().step(1),
        t.boosted.model,
        t.boosted.optimizer.get(),
        nullptr,
        cb::TrainingCheckpointOptions().keep_last(0));
  });
  EXPECT_NE(e.find("keep_last"), std::string::npos) << e;
  // Resuming with a scheduler from a set saved without one says so.
  t.booster.save_checkpoint(
      ckpt, cb::TrainingState().step(9), t.boosted.model, t.boosted.optimizer.get());
  e = error_of([&] { t.resume(ckpt); });
  EXPECT_NE(e.find("no scheduler state"), std::string::npos) << e;
}

// A process killed (SIGKILL) at each commit step of its second save: the
// resume finds the first or the second set, never a partial one, and ends
// with the uninterrupted weights; the next save clears what the kill left.
TEST(TrainingCheckpoint, KilledAtEveryCommitStepResumesExactly) {
  const std::vector<std::string> points = {
      "training:model_saved#2",     "training:optimizer_saved#2",
      "training:state_written#2",   "training:manifest_written#2",
      "training:committed#2",       "training:retiring#1",
      "sharded:index_written#3",    "file:renamed#6"};
  const auto want = uninterrupted(kSteps);
  const auto scratch = colossalai::testing::scratch(
      colossalai::testing::test_process(), "training_kill");
  for (const auto& point : points) {
    SCOPED_TRACE(point);
    const auto ckpt = scratch + "/" + point.substr(point.find(':') + 1);
    colossalai::testing::MultiProcessOptions options;
    options.env[-1]["COLOSSALAI_FAULT_POINT"] = point;
    options.env[-1]["COLOSSALAI_TEST_CKPT"] = ckpt;
    const auto results = colossalai::testing::run_processes(
        1,
        [](int, int) {
          Trainer t;
          // keep_last 1 retires the first set during the third save.
          const std::string dir = std::getenv("COLOSSALAI_TEST_CKPT");
          for (int64_t s = 0; s < 6; s += 2) {
            t.train(s, s + 2);
            t.booster.save_checkpoint(
                dir,
                cb::TrainingState().step(s + 2),
                t.boosted.model,
                t.boosted.optimizer.get(),
                &t.scheduler,
                cb::TrainingCheckpointOptions().keep_last(1));
          }
        },
        options);
    if (std::getenv("COLOSSALAI_TEST_CHILD") != nullptr) {
      continue; // a child runs only its own call of run_processes
    }
    ASSERT_EQ(results.size(), 1u);
    EXPECT_EQ(results[0].exit_code, 128 + SIGKILL) << results[0].output;
    Trainer resumed;
    const auto state = resumed.resume(ckpt);
    EXPECT_TRUE(state.step() == 2 || state.step() == 4 || state.step() == 6)
        << state.step();
    std::cout << point << ": resumed at step " << state.step() << "\n";
    resumed.train(state.step(), kSteps, ckpt, 2);
    expect_equal(
        want, colossalai::testing::host(resumed.net->parameters()), point);
    for (const auto& name : names_in(ckpt)) {
      EXPECT_NE(name[0], '.') << name << " left behind";
    }
  }
  colossalai::testing::remove_scratch("training_kill");
}

// Saved under LowLevelZero stage 2 on two ranks, resumed in one process
// without a plugin: the same training, within ZeRO's rounding of the
// averaged gradient (the bound of test_low_level_zero).
TEST(TrainingCheckpoint, ZeroOnTwoRanksResumesInOneProcess) {
  const auto ckpt = colossalai::testing::scratch(
      colossalai::testing::test_process(), "training_zero");
  colossalai::testing::run_distributed(2, [ckpt](int rank, int world) {
    Trainer t(std::make_shared<cb::plugin::LowLevelZeroPlugin>(
        cb::plugin::LowLevelZeroPluginOptions().stage(2).precision("fp32")));
    EXPECT_EQ(t.resume(ckpt).step(), 0);
    t.train(0, 4, ckpt, 2, rank, world);
  });
  Trainer resumed;
  const auto state = resumed.resume(ckpt);
  EXPECT_EQ(state.step(), 4);
  resumed.train(state.step(), kSteps);
  const auto want = uninterrupted(kSteps);
  const auto got = colossalai::testing::host(resumed.net->parameters());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(at::allclose(got[i], want[i], 1e-4, 1e-5))
        << "parameter " << i << " differs by "
        << (got[i] - want[i]).abs().max().item<double>();
  }
  colossalai::testing::remove_scratch("training_zero");
}

// A stop mid-epoch: 3 batches of 2 on each of two ranks (12 of 30 samples),
// then a save. Resumed on three ranks, the rest of the epoch is drawn once,
// nothing twice; resumed on two, each rank draws what it would have drawn
// without the stop.
TEST(TrainingCheckpoint, MidEpochResumeAtAnotherWorldSizeDrawsEachSampleOnce) {
  constexpr int64_t kSamples = 30;
  constexpr uint64_t kSeed = 5;
  const auto scratch = colossalai::testing::scratch(
      colossalai::testing::test_process(), "training_loader");
  fs::create_directories(scratch);
  auto run = [scratch](int world, const std::string& tag, int batches) {
    colossalai::testing::run_distributed(world, [=](int rank, int) {
      auto plugin = std::make_shared<cb::plugin::TorchDDPPlugin>();
      Trainer t(plugin);
      auto loader = plugin->prepare_dataloader(
          index_dataset(kSamples), 2, /*shuffle=*/true, kSeed);
      const auto ckpt = scratch + "/ckpt";
      const auto state = t.booster.resume_or_start(
          ckpt, t.boosted.model, t.boosted.optimizer.get(), &t.scheduler,
          *loader);
      EXPECT_EQ(state.samples_in_epoch(), batches >= 0 ? 0 : 12);
      std::ofstream out(scratch + "/" + tag + std::to_string(rank));
      int taken = 0;
      for (auto& batch : *loader) {
        if (taken == batches) {
          break;
        }
        const auto x = batch.data.expand({-1, 8}) / kSamples;
        t.boosted.optimizer->zero_grad();
        t.booster.backward(
            colossalai::testing::mse_loss(
                t.boosted.model(x), at::zeros({x.size(0), 4})),
            *t.boosted.optimizer);
        t.boosted.optimizer->step();
        for (int64_t i = 0; i < batch.data.size(0); ++i) {
          out << batch.data[i][0].item<int64_t>() << " ";
        }
        ++taken;
      }
      if (batches >= 0) {
        t.booster.save_checkpoint(
            ckpt,
            cb::TrainingState().step(taken).epoch(0).samples_in_epoch(
                static_cast<int64_t>(loader->samples_seen(taken))),
            t.boosted.model,
            t.boosted.optimizer.get(),
            &t.scheduler);
      }
    });
  };
  run(2, "stopped", 3);
  run(3, "three", -1);
  run(2, "two", -1);
  if (std::getenv("COLOSSALAI_TEST_CHILD") != nullptr) {
    return;
  }
  std::multiset<size_t> drawn;
  for (const char* tag : {"stopped0", "stopped1", "three0", "three1", "three2"}) {
    const auto ids = read_ids(scratch + "/" + tag);
    drawn.insert(ids.begin(), ids.end());
  }
  EXPECT_EQ(drawn.size(), static_cast<size_t>(kSamples));
  EXPECT_EQ(std::set<size_t>(drawn.begin(), drawn.end()).size(), drawn.size());
  for (int r = 0; r < 2; ++r) {
    const auto whole =
        colossalai::data::DistributedSampler(kSamples, 2, r, true, kSeed)
            .indices();
    EXPECT_EQ(
        read_ids(scratch + "/stopped" + std::to_string(r)),
        std::vector<size_t>(whole.begin(), whole.begin() + 6));
    EXPECT_EQ(
        read_ids(scratch + "/two" + std::to_string(r)),
        std::vector<size_t>(whole.begin() + 6, whole.end()));
  }
  colossalai::testing::remove_scratch("training_loader");
}
