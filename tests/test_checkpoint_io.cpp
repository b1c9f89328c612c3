// Checkpoint IO: every format and option round-trips, optimizers resume
// bit-identically, async saves snapshot (saves killed mid-way:
// test_checkpoint_faults),
// bad files give errors that name file and key, and under DDP rank 0 writes
// while every rank loads.

#include <colossalai/booster/booster.h>
#include <colossalai/booster/plugin/torch_ddp_plugin.h>
#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/checkpoint_io/io_utils.h>
#include <colossalai/checkpoint_io/model_state_hooks.h>
#include <colossalai/checkpoint_io/safetensors.h>
#include <colossalai/checkpoint_io/torch_bin.h>
#include <colossalai/distributed/error.h>
#include <colossalai/interface/model.h>
#include <colossalai/models/gpt2.h>
#include <colossalai/models/llama.h>
#include <colossalai/models/pretrained.h>
#include <colossalai/nn/lr_scheduler/cosine.h>
#include <colossalai/nn/optimizer/hybrid_adam.h>
#include <colossalai/utils/compat.h>

#include <harness/multiprocess.h>

#include <harness/test_util.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

namespace cb = colossalai::booster;
namespace ck = colossalai::checkpoint_io;
namespace fs = std::filesystem;

namespace {

using colossalai::testing::error_of;
std::string temp_dir() {
  return colossalai::testing::temp_dir("colossalai_ckpt");
}

struct NetImpl : torch::nn::Module {
  explicit NetImpl(int64_t width = 64) {
    fc1 = register_module("fc1", torch::nn::Linear(16, width));
    bn = register_module("bn", torch::nn::BatchNorm1d(width));
    fc2 = register_module("fc2", torch::nn::Linear(width, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    return fc2(torch::relu(bn(fc1(x))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Net);

void expect_same_state(torch::nn::Module& a, torch::nn::Module& b) {
  auto sa = ck::model_state_dict(a), sb = ck::model_state_dict(b);
  ASSERT_EQ(sa.size(), sb.size());
  for (const auto& item : sa) {
    ASSERT_NE(sb.find(item.key()), nullptr) << item.key();
    EXPECT_TRUE(at::equal(item.value(), sb[item.key()])) << item.key();
  }
}

Net trained_net(int64_t width = 64, int seed = 0) {
  torch::manual_seed(seed);
  Net net(width);
  net(torch::randn({8, 16})); // moves BatchNorm statistics off their init
  return net;
}

} // namespace

TEST(CheckpointIO, ModelRoundTripsInEveryFormat) {
  auto dir = temp_dir();
  for (bool st : {false, true}) {
    for (bool shard : {false, true}) {
      for (bool async : {false, true}) {
        auto src = trained_net();
        cb::Booster booster;
        auto boosted = booster.boost(src);
        auto path = dir + "/m" + std::to_string(st) + std::to_string(shard) +
            std::to_string(async);
        booster.save_model(
            boosted.model,
            path,
            ck::SaveModelOptions().use_safetensors(st).shard(shard).use_async(
                async));
        booster.checkpoint_io().synchronize();
        auto dst = trained_net(64, 1);
        auto boosted_dst = booster.boost(dst);
        booster.load_model(boosted_dst.model, path);
        expect_same_state(*src, *dst);
        if (shard) {
          auto index = path +
              (st ? "/model.safetensors.index.json"
                  : "/pytorch_model.bin.index.json");
          EXPECT_TRUE(fs::exists(index)) << index;
          // The index file itself is also accepted.
          auto again = trained_net(64, 2);
          auto b2 = booster.boost(again);
          booster.load_model(b2.model, index);
          expect_same_state(*src, *again);
        }
      }
    }
  }
  fs::remove_all(dir);
}

TEST(CheckpointIO, LoadsIntoTensorsAtEveryOffsetOfAPage) {
  // A load reads a mapped tensor straight into its target, through a small
  // buffer when the target sits just past the source modulo a page (NOTE
  // [Copies just past their source]). Targets that view a larger buffer at
  // every 4-byte offset of a page meet both paths; the bytes must match.
  auto dir = temp_dir();
  const int64_t n = 20000; // 80 KB: above the size a load copies instead
  for (bool st : {true, false}) {
    auto path = dir + (st ? "/w.safetensors" : "/w.bin");
    auto saved = std::make_shared<torch::nn::Module>();
    saved->register_buffer("w", torch::randn({n}));
    colossalai::interface::ModelWrapper src(saved);
    ck::GeneralCheckpointIO io;
    io.save_model(src, path, ck::SaveModelOptions().use_safetensors(st));
    auto flat = at::zeros({n + 1024});
    for (int64_t k = 0; k < 1024; ++k) {
      auto module = std::make_shared<torch::nn::Module>();
      module->register_buffer("w", flat.narrow(0, k, n));
      colossalai::interface::ModelWrapper dst(module);
      io.load_model(dst, path);
      ASSERT_TRUE(at::equal(flat.narrow(0, k, n), saved->named_buffers()["w"]))
          << (st ? "safetensors" : "bin") << ", offset " << k;
    }
  }
  fs::remove_all(dir);
}

TEST(CheckpointIO, ShardsRespectSizeAndPrefix) {
  auto dir = temp_dir();
  auto src = trained_net(/*width=*/16384); // fc1.weight: 1 MiB, fc2: 256 KiB
  cb::Booster booster;
  auto boosted = booster.boost(src);
  booster.save_model(
      boosted.model,
      dir + "/sharded",
      ck::SaveModelOptions()
          .shard(true)
          .use_safetensors(true)
          .size_per_shard(1)
          .prefix("step5"));
  std::vector<std::string> shards;
  for (const auto& e : fs::directory_iterator(dir + "/sharded")) {
    auto name = e.path().filename().string();
    if (name.find(".index.json") == std::string::npos) {
      shards.push_back(name);
      EXPECT_LE(fs::file_size(e.path()), (1 << 20) + (1 << 17)) << name;
    }
    EXPECT_NE(name.find("step5"), std::string::npos) << name;
  }
  EXPECT_GE(shards.size(), 2u);
  std::ifstream in(dir + "/sharded/model.step5.safetensors.index.json");
  std::string text(
      (std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  int64_t total = 0;
  for (const auto& item : ck::model_state_dict(*src)) {
    total += item.value().numel() * item.value().element_size();
    EXPECT_NE(text.find("\"" + item.key() + "\""), std::string::npos);
  }
  EXPECT_NE(
      text.find("\"total_size\": " + std::to_string(total)), std::string::npos)
      << text;
  auto dst = trained_net(16384, 1);
  auto b2 = booster.boost(dst);
  booster.load_model(b2.model, dir + "/sharded");
  expect_same_state(*src, *dst);
  fs::remove_all(dir);
}

TEST(CheckpointIO, BadInputNamesFileAndKey) {
  auto dir = temp_dir();
  cb::Booster booster;
  auto src = trained_net();
  auto boosted = booster.boost(src);
  booster.save_model(
      boosted.model,
      dir + "/m.safetensors",
      ck::SaveModelOptions().use_safetensors(true));

  // An accepted option that cannot work is refused by name.
  auto msg = error_of([&] {
    booster.save_model(
        boosted.model,
        dir + "/d.safetensors",
        ck::SaveModelOptions().gather_dtensor(false));
  });
  EXPECT_NE(msg.find("gather_dtensor"), std::string::npos) << msg;

  // Missing file.
  msg = error_of([&] { booster.load_model(boosted.model, dir + "/nope"); });
  EXPECT_NE(msg.find(dir + "/nope"), std::string::npos) << msg;

  // Shape mismatch and unexpected / missing keys under strict.
  auto wide = trained_net(32);
  auto bw = booster.boost(wide);
  msg = error_of([&] { booster.load_model(bw.model, dir + "/m.safetensors"); });
  EXPECT_NE(msg.find("fc1.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("m.safetensors"), std::string::npos) << msg;

  ck::StateDict partial;
  partial.insert("fc1.weight", src->fc1->weight.detach());
  partial.insert("extra.weight", at::zeros({2}));
  ck::safetensors::save_file(dir + "/partial.safetensors", partial);
  msg = error_of(
      [&] { booster.load_model(boosted.model, dir + "/partial.safetensors"); });
  EXPECT_NE(msg.find("extra.weight"), std::string::npos) << msg;
  ck::StateDict only_fc1;
  only_fc1.insert("fc1.weight", src->fc1->weight.detach());
  ck::safetensors::save_file(dir + "/fc1.safetensors", only_fc1);
  msg = error_of(
      [&] { booster.load_model(boosted.model, dir + "/fc1.safetensors"); });
  EXPECT_NE(msg.find("fc2.weight"), std::string::npos) << msg;
  // Not strict: loads what is there.
  booster.load_model(boosted.model, dir + "/fc1.safetensors", false);

  // dtype of another kind.
  ck::StateDict ints;
  ints.insert("fc1.bias", at::zeros({64}, at::kLong));
  ck::safetensors::save_file(dir + "/ints.safetensors", ints);
  msg = error_of([&] {
    booster.load_model(boosted.model, dir + "/ints.safetensors", false);
  });
  EXPECT_NE(msg.find("fc1.bias"), std::string::npos) << msg;
  EXPECT_NE(msg.find("dtype"), std::string::npos) << msg;

  // Truncated file.
  auto size = fs::file_size(dir + "/m.safetensors");
  fs::copy_file(dir + "/m.safetensors", dir + "/cut.safetensors");
  fs::resize_file(dir + "/cut.safetensors", size / 2);
  msg = error_of(
      [&] { booster.load_model(boosted.model, dir + "/cut.safetensors"); });
  EXPECT_NE(msg.find("cut.safetensors"), std::string::npos) << msg;

  // A shard named by the index is missing.
  booster.save_model(
      boosted.model, dir + "/sh", ck::SaveModelOptions().shard(true));
  fs::remove(dir + "/sh/pytorch_model.bin");
  msg = error_of([&] { booster.load_model(boosted.model, dir + "/sh"); });
  EXPECT_NE(msg.find("pytorch_model.bin"), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing"), std::string::npos) << msg;
  fs::remove_all(dir);
}

namespace {

std::shared_ptr<torch::optim::Optimizer> make_optimizer(
    const std::string& kind,
    const std::vector<at::Tensor>& p) {
  if (kind == "SGD")
    return std::make_shared<torch::optim::SGD>(
        p, torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true));
  if (kind == "Adam")
    return std::make_shared<torch::optim::Adam>(
        p, torch::optim::AdamOptions(1e-2).amsgrad(true));
  if (kind == "AdamW")
    return std::make_shared<torch::optim::AdamW>(
        p, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  if (kind == "HybridAdam")
    return std::make_shared<colossalai::nn::optimizer::HybridAdam>(
        p,
        colossalai::nn::optimizer::HybridAdamOptions(1e-2).weight_decay(0.1));
  if (kind == "RMSprop")
    return std::make_shared<torch::optim::RMSprop>(
        p, torch::optim::RMSpropOptions(1e-2).momentum(0.5).centered(true));
  return std::make_shared<torch::optim::Adagrad>(p);
}

void train_steps(
    cb::Booster& booster,
    Net& net,
    colossalai::interface::OptimizerWrapper& opt,
    int from,
    int to) {
  for (int s = from; s < to; ++s) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(s);
    auto x = at::randn({8, 16}, gen), y = at::randn({8, 4}, gen);
    opt.zero_grad();
    booster.backward(torch::mse_loss(net(x), y), opt);
    opt.step();
  }
}

} // namespace

TEST(CheckpointIO, OptimizerResumeIsBitIdentical) {
  auto dir = temp_dir();
  const int n = 4, m = 3;
  for (std::string kind :
       {"SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "HybridAdam"}) {
    for (bool shard : {false, true}) {
      cb::Booster booster;
      // Uninterrupted reference.
      auto ref = trained_net();
      auto ref_b = booster.boost(ref, make_optimizer(kind, ref->parameters()));
      train_steps(booster, ref, *ref_b.optimizer, 0, n + m);

      auto net = trained_net();
      auto b = booster.boost(net, make_optimizer(kind, net->parameters()));
      train_steps(booster, net, *b.optimizer, 0, n);
      auto path = dir + "/" + kind + std::to_string(shard);
      booster.save_model(b.model, path + ".model");
      booster.save_optimizer(
          *b.optimizer,
          path + ".optim",
          ck::SaveOptimizerOptions().shard(shard));

      auto fresh = trained_net(64, 7);
      auto fb = booster.boost(fresh, make_optimizer(kind, fresh->parameters()));
      booster.load_model(fb.model, path + ".model");
      booster.load_optimizer(*fb.optimizer, path + ".optim");
      train_steps(booster, fresh, *fb.optimizer, n, n + m);
      for (size_t i = 0; i < ref->parameters().size(); ++i) {
        EXPECT_TRUE(at::equal(ref->parameters()[i], fresh->parameters()[i]))
            << kind << (shard ? " sharded" : "") << " parameter " << i;
      }
    }
  }
  fs::remove_all(dir);
}

TEST(CheckpointIO, AsyncSaveSnapshotsAndReportsErrorsLater) {
  auto dir = temp_dir();
  cb::Booster booster;
  auto net = trained_net();
  auto b = booster.boost(net);
  auto expected = net->fc1->weight.detach().clone();
  booster.save_model(
      b.model, dir + "/async.bin", ck::SaveModelOptions().use_async(true));
  {
    at::NoGradGuard g;
    net->fc1->weight.fill_(42); // training goes on while the file is written
  }
  booster.checkpoint_io().synchronize();
  auto other = trained_net(64, 3);
  auto ob = booster.boost(other);
  booster.load_model(ob.model, dir + "/async.bin");
  EXPECT_TRUE(at::equal(other->fc1->weight, expected));

  // A background failure surfaces at the next call, naming the path.
  booster.save_model(
      b.model,
      "/proc/no/such/dir/x.bin",
      ck::SaveModelOptions().use_async(true));
  auto msg = error_of([&] { booster.checkpoint_io().synchronize(); });
  EXPECT_NE(msg.find("/proc/no/such/dir"), std::string::npos) << msg;
  fs::remove_all(dir);
}

TEST(CheckpointIO, DDPRankZeroWritesEveryRankLoadsAndResumes) {
  colossalai::testing::run_distributed(2, [](int rank, int world) {
    auto dir = fs::temp_directory_path() /
        ("colossalai_ddp_ckpt_" +
         std::to_string(colossalai::testing::test_process()));
    const int n = 3, m = 2;
    auto run = [&](bool resume, bool shard) {
      const auto model_path =
          (dir / ("model" + std::to_string(shard))).string();
      const auto optim_path =
          (dir / ("optim" + std::to_string(shard))).string();
      auto plugin = std::make_shared<cb::plugin::TorchDDPPlugin>();
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      auto net = trained_net(64, resume ? 11 : 0);
      auto b = booster.boost(net, make_optimizer("AdamW", net->parameters()));
      auto step = [&](int s) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * s + rank);
        auto x = at::randn({8, 16}, gen), y = at::randn({8, 4}, gen);
        b.optimizer->zero_grad();
        booster.backward(
            colossalai::testing::mse_loss(b.model(x), y), *b.optimizer);
        b.optimizer->step();
      };
      if (!resume) {
        for (int s = 0; s < n; ++s)
          step(s);
        booster.save_model(
            b.model, model_path, ck::SaveModelOptions().shard(shard));
        booster.save_optimizer(
            *b.optimizer, optim_path, ck::SaveOptimizerOptions().shard(shard));
        for (int s = n; s < n + m; ++s)
          step(s);
      } else {
        booster.load_model(b.model, model_path);
        booster.load_optimizer(*b.optimizer, optim_path);
        for (int s = n; s < n + m; ++s)
          step(s);
      }
      return net->parameters();
    };
    for (bool shard : {false, true}) {
      auto straight = run(false, shard);
      auto resumed = run(true, shard);
      for (size_t i = 0; i < straight.size(); ++i) {
        EXPECT_TRUE(at::equal(straight[i], resumed[i]))
            << "rank " << rank << " parameter " << i;
      }
    }
    if (rank == 0) {
      fs::remove_all(dir);
    }
  });
}

TEST(CheckpointIO, LRSchedulerRoundTripsThroughTheBooster) {
  auto dir = temp_dir();
  cb::Booster booster;
  auto net = trained_net();
  auto opt = std::make_shared<torch::optim::SGD>(
      net->parameters(), torch::optim::SGDOptions(0.1));
  colossalai::nn::lr_scheduler::CosineAnnealingLR a(*opt, 20);
  for (int i = 0; i < 7; ++i)
    a.step();
  booster.save_lr_scheduler(a, dir + "/sched.pt");
  auto opt2 = std::make_shared<torch::optim::SGD>(
      net->parameters(), torch::optim::SGDOptions(0.1));
  colossalai::nn::lr_scheduler::CosineAnnealingLR b(*opt2, 20);
  booster.load_lr_scheduler(b, dir + "/sched.pt");
  EXPECT_EQ(b.last_epoch(), 7);
  for (int i = 0; i < 5; ++i) {
    a.step();
    b.step();
    EXPECT_EQ(a.get_last_lr(), b.get_last_lr());
  }
  auto msg = error_of([&] { booster.load_lr_scheduler(b, dir + "/none.pt"); });
  EXPECT_NE(msg.find("none.pt"), std::string::npos) << msg;
  fs::remove_all(dir);
}

namespace {

// NOTE [Checkpoints across LibTorch versions]
// tests/golden/checkpoints/torch-<version>/ holds a checkpoint written by the
// build against that LibTorch: the model of `known_net` in every format, and
// its AdamW state after one step with `known_grad`, as one file and sharded.
// Every build loads every version's files. Buffers are exact small binary
// fractions, so they must load bit for bit. Parameters and the optimizer's
// moments come from one AdamW step, which the reading build recomputes:
// they must agree to 1e-6 relative (the same formula in fp32, but LibTorch
// versions order its few operations differently and 2.x picks its CPU
// kernels by instruction set, AVX2 or AVX-512, which round a few ulps apart;
// 1e-6 is about 8 ulps, far below any wrong tensor or misplaced byte).
// To add a version: COLOSSALAI_WRITE_CHECKPOINT_GOLDEN=1 with that build.
const fs::path kGoldenCheckpoints =
    fs::path(__FILE__).parent_path() / "golden" / "checkpoints";

at::Tensor known_values(int64_t numel, int64_t salt) {
  return ((at::arange(numel, at::kFloat) * 5 + salt * 3).fmod(17) - 8) *
      0.125;
}

Net known_net() {
  Net net(8);
  torch::NoGradGuard no_grad;
  int64_t salt = 0;
  for (auto& t : ck::model_state_dict(*net)) {
    if (t.value().is_floating_point()) {
      t.value().copy_(known_values(t.value().numel(), ++salt)
                          .view(t.value().sizes()));
    }
  }
  return net;
}

// known_net and its AdamW after one step with known gradients.
std::pair<Net, std::shared_ptr<torch::optim::Optimizer>> known_state() {
  auto net = known_net();
  auto opt = make_optimizer("AdamW", net->parameters());
  int64_t salt = 100;
  for (auto& p : net->parameters()) {
    p.mutable_grad() = known_values(p.numel(), ++salt).view(p.sizes());
  }
  opt->step();
  return {net, opt};
}

void write_golden(const fs::path& dir) {
  fs::create_directories(dir);
  auto [net, opt] = known_state();
  cb::Booster booster;
  auto b = booster.boost(net, opt);
  for (bool st : {false, true}) {
    for (bool shard : {false, true}) {
      booster.save_model(
          b.model,
          (dir / ("model" + std::string(st ? "_st" : "_bin") +
                  (shard ? "_sharded" : "")))
              .string(),
          ck::SaveModelOptions().use_safetensors(st).shard(shard));
    }
  }
  booster.save_optimizer(*b.optimizer, (dir / "optim.bin").string());
  booster.save_optimizer(
      *b.optimizer,
      (dir / "optim_sharded").string(),
      ck::SaveOptimizerOptions().shard(true));
}

} // namespace

TEST(CheckpointIO, LoadsCheckpointsOfOtherLibTorchVersions) {
  const std::string mine = std::string("torch-") + TORCH_VERSION;
  if (std::getenv("COLOSSALAI_WRITE_CHECKPOINT_GOLDEN") != nullptr) {
    fs::remove_all(kGoldenCheckpoints / mine);
    write_golden(kGoldenCheckpoints / mine);
  }
  auto [want_net, want_opt] = known_state();
  std::vector<std::string> versions;
  for (const auto& e : fs::directory_iterator(kGoldenCheckpoints)) {
    versions.push_back(e.path().filename().string());
  }
  std::sort(versions.begin(), versions.end());
  // Both sides of the 1.x / 2.x line must be there, or this proves nothing.
  ASSERT_TRUE(std::any_of(versions.begin(), versions.end(), [](auto& v) {
    return v.rfind("torch-1.", 0) == 0;
  }));
  ASSERT_TRUE(std::any_of(versions.begin(), versions.end(), [](auto& v) {
    return v.rfind("torch-2.", 0) == 0;
  }));
  for (const auto& version : versions) {
    const fs::path dir = kGoldenCheckpoints / version;
    for (const char* model :
         {"model_bin", "model_bin_sharded", "model_st", "model_st_sharded"}) {
      SCOPED_TRACE(version + "/" + model);
      auto net = trained_net(8, 3);
      cb::Booster booster;
      auto b = booster.boost(net);
      booster.load_model(b.model, (dir / model).string());
      auto got = ck::model_state_dict(*net);
      const auto params = want_net->named_parameters(true);
      for (const auto& item : ck::model_state_dict(*want_net)) {
        ASSERT_NE(got.find(item.key()), nullptr) << item.key();
        const auto& g = got[item.key()];
        if (params.contains(item.key())) {
          EXPECT_TRUE(at::allclose(g, item.value(), 1e-6, 0)) << item.key();
        } else {
          EXPECT_TRUE(at::equal(g, item.value())) << item.key();
        }
      }
    }
    for (const char* optim : {"optim.bin", "optim_sharded"}) {
      SCOPED_TRACE(version + "/" + optim);
      auto net = known_net();
      cb::Booster booster;
      auto b = booster.boost(net, make_optimizer("AdamW", net->parameters()));
      booster.load_optimizer(*b.optimizer, (dir / optim).string());
      auto& got = b.optimizer->unwrap().state();
      auto& want = want_opt->state();
      using Map = std::remove_reference_t<decltype(got)>;
      auto params = net->parameters();
      auto want_params = want_net->parameters();
      ASSERT_EQ(got.size(), params.size());
      for (size_t i = 0; i < params.size(); ++i) {
        SCOPED_TRACE("parameter " + std::to_string(i));
        auto g = got.find(colossalai::compat::optimizer_state_key<Map>(params[i]));
        auto w = want.find(
            colossalai::compat::optimizer_state_key<Map>(want_params[i]));
        ASSERT_TRUE(g != got.end() && w != want.end());
        const auto& gs = static_cast<torch::optim::AdamWParamState&>(*g->second);
        const auto& ws = static_cast<torch::optim::AdamWParamState&>(*w->second);
        EXPECT_EQ(gs.step(), ws.step());
        EXPECT_TRUE(at::allclose(gs.exp_avg(), ws.exp_avg(), 1e-6, 0));
        EXPECT_TRUE(at::allclose(gs.exp_avg_sq(), ws.exp_avg_sq(), 1e-6, 0));
      }
    }
  }
}

// A tied head is one tensor under two names in Python's state_dict()
// (GPT-2's lm_head.weight is transformer.wte.weight): a .bin save writes
// both, as torch.save does, one storage in the file; a strict load accepts
// the second name when it holds the same values and refuses a checkpoint
// trained untied; safetensors files hold it once, as transformers writes
// them.
TEST(CheckpointIO, TiedWeightsCrossAsPythonsStateDictHoldsThem) {
  namespace models = colossalai::models;
  colossalai::testing::ScratchDir dir("colossalai_ckpt_tied");
  torch::manual_seed(0);
  models::GPT2LMHeadModel src(models::GPT2Config::tiny_test());
  cb::Booster booster;
  auto b = booster.boost(src.ptr());
  const std::string bin = dir.path + "/model.bin";
  const std::string st = dir.path + "/model.safetensors";
  booster.save_model(b.model, bin);
  booster.save_model(b.model, st, ck::SaveModelOptions().use_safetensors(true));
  const auto wte = src->transformer->wte->weight.detach();

  auto saved = ck::load_bin(bin);
  ASSERT_NE(saved.find("lm_head.weight"), nullptr);
  EXPECT_TRUE(at::equal(saved["lm_head.weight"], wte));
  EXPECT_EQ(
      saved["lm_head.weight"].data_ptr(),
      saved["transformer.wte.weight"].data_ptr()); // one storage
  EXPECT_EQ(
      ck::safetensors::load_file(st).find("lm_head.weight"), nullptr);

  for (const auto& path : {bin, st}) {
    torch::manual_seed(1);
    models::GPT2LMHeadModel dst(models::GPT2Config::tiny_test());
    auto bd = booster.boost(dst.ptr());
    booster.load_model(bd.model, path); // strict
    EXPECT_TRUE(at::equal(dst->transformer->wte->weight, wte)) << path;
  }

  // Trained untied: the two names differ.
  saved["lm_head.weight"] = saved["lm_head.weight"] + 1;
  const std::string untied = dir.path + "/untied.bin";
  ck::save_bin(untied, saved);
  models::GPT2LMHeadModel dst(models::GPT2Config::tiny_test());
  auto bd = booster.boost(dst.ptr());
  const auto e = error_of([&] { booster.load_model(bd.model, untied); });
  EXPECT_NE(e.find("'lm_head.weight' is tied to 'transformer.wte.weight'"),
            std::string::npos)
      << e;
}

TEST(CheckpointIO, FeaturesHandInHowTheirTensorsLoadAndSave) {
  // NOTE [Model state hooks]: a feature above checkpoint IO says which keys
  // a strict load may miss, which tensors it loads itself and which models
  // cannot be saved; checkpoint IO knows none of them by name.
  colossalai::testing::ScratchDir dir("colossalai_ckpt_hooks");
  const std::string path = dir.path + "/model.safetensors";
  auto src = trained_net(8, 0);
  cb::Booster booster;
  auto b = booster.boost(src);
  booster.save_model(b.model, path, ck::SaveModelOptions().use_safetensors(true));

  auto dst = trained_net(8, 1);
  dst->register_parameter("hooks_test_adapter", torch::ones({3}));
  auto bd = booster.boost(dst);
  // Before the feature registers: a strict load misses its key.
  auto e = error_of([&] { booster.load_model(bd.model, path); });
  EXPECT_NE(e.find("hooks_test_adapter"), std::string::npos) << e;

  at::Tensor taken;
  ck::ModelStateHooks hooks;
  hooks.optional_key = [](const std::string& key) {
    return key == "hooks_test_adapter";
  };
  hooks.loaders = [&taken](torch::nn::Module& model) {
    std::map<std::string, ck::ModelStateHooks::Loader> out;
    if (model.named_parameters(true).contains("hooks_test_adapter")) {
      out.emplace("fc2.bias", [&taken](const at::Tensor& v) {
        taken = v.clone();
      });
    }
    return out;
  };
  hooks.save_refusal = [](torch::nn::Module& model) {
    return model.named_parameters(true).contains("hooks_test_adapter")
        ? std::string("hooks_test_adapter models are not saved")
        : std::string();
  };
  ck::register_model_state_hooks("hooks_test", std::move(hooks));

  const auto before = dst->fc2->bias.clone();
  booster.load_model(bd.model, path);
  EXPECT_TRUE(at::equal(dst->fc1->weight, src->fc1->weight));
  // fc2.bias went to the feature's loader, not into the model.
  ASSERT_TRUE(taken.defined());
  EXPECT_TRUE(at::equal(taken, src->fc2->bias));
  EXPECT_TRUE(at::equal(dst->fc2->bias, before));
  EXPECT_TRUE(at::equal(dst->named_parameters()["hooks_test_adapter"],
                        torch::ones({3})));
  e = error_of([&] {
    booster.save_model(bd.model, dir.path + "/again.safetensors");
  });
  EXPECT_NE(e.find("hooks_test_adapter models are not saved"), std::string::npos)
      << e;
  // A model the feature has nothing to say about saves as before.
  booster.save_model(b.model, dir.path + "/plain.safetensors");
}

namespace {

// A copy of every tensor of `m`, to tell later whether a load touched it.
ck::StateDict snapshot_state(torch::nn::Module& m) {
  ck::StateDict out;
  for (const auto& item : ck::model_state_dict(m)) {
    out.insert(item.key(), item.value().detach().clone());
  }
  return out;
}

void expect_unchanged(torch::nn::Module& m, const ck::StateDict& before) {
  for (const auto& item : ck::model_state_dict(m)) {
    EXPECT_TRUE(at::equal(item.value(), before[item.key()])) << item.key();
  }
}

// A sharded checkpoint written by hand: one file per group of keys, and the
// index naming them.
void write_sharded(
    const std::string& dir,
    const std::vector<ck::StateDict>& shards) {
  fs::create_directories(dir);
  ck::detail::Index index;
  for (size_t i = 0; i < shards.size(); ++i) {
    const auto name = "model-0000" + std::to_string(i + 1) + ".safetensors";
    ck::safetensors::save_file(dir + "/" + name, shards[i]);
    for (const auto& item : shards[i]) {
      index.weight_map.emplace_back(item.key(), name);
    }
  }
  ck::detail::write_index(dir + "/model.safetensors.index.json", index);
}

} // namespace

// Every refusal of a load comes before the first tensor is copied, so a
// refused load (strict or not) leaves the model as it was: unexpected and
// missing keys, a misshapen tensor in the last key or the last shard, an
// index naming a key its shard lacks, and a tied head trained untied whose
// two names sit in different shards.
TEST(CheckpointIO, RefusedLoadsLeaveTheModelUnchanged) {
  colossalai::testing::ScratchDir dir("colossalai_ckpt_refused");
  cb::Booster booster;
  auto src = trained_net(64, 0);
  const auto good = ck::model_state_dict(*src);
  auto dst = trained_net(64, 5);
  auto b = booster.boost(dst);
  const auto before = snapshot_state(*dst);
  auto refused = [&](const std::string& path, bool strict, const char* says) {
    SCOPED_TRACE(path);
    const auto e =
        error_of([&] { booster.load_model(b.model, path, strict); });
    EXPECT_NE(e.find(says), std::string::npos) << e;
    expect_unchanged(*dst, before);
  };
  auto with = [&](const std::function<void(ck::StateDict&)>& edit) {
    ck::StateDict s;
    for (const auto& item : good) {
      s.insert(item.key(), item.value().detach());
    }
    edit(s);
    return s;
  };
  const std::string file = dir.path + "/m.safetensors";
  ck::safetensors::save_file(
      file, with([](ck::StateDict& s) { s.insert("extra.weight", at::ones(2)); }));
  refused(file, true, "extra.weight");
  ck::safetensors::save_file(
      file, with([](ck::StateDict& s) { s.erase("fc2.bias"); }));
  refused(file, true, "fc2.bias");
  ck::safetensors::save_file(
      file, with([](ck::StateDict& s) { s["fc2.bias"] = at::zeros({5}); }));
  refused(file, false, "fc2.bias");

  // Two shards: the first is right, the second is not.
  auto split = [](const ck::StateDict& s) {
    std::vector<ck::StateDict> shards(2);
    for (const auto& item : s) {
      shards[item.key().rfind("fc2", 0) == 0 ? 1 : 0].insert(
          item.key(), item.value());
    }
    return shards;
  };
  write_sharded(
      dir.path + "/shape",
      split(with([](ck::StateDict& s) { s["fc2.weight"] = at::zeros({4, 3}); })));
  refused(dir.path + "/shape", false, "fc2.weight");
  write_sharded(
      dir.path + "/extra",
      split(with([](ck::StateDict& s) { s.insert("fc2.extra", at::ones(2)); })));
  refused(dir.path + "/extra", true, "fc2.extra");
  write_sharded(
      dir.path + "/lacks", split(with([](ck::StateDict& s) {
        s.erase("fc2.bias");
      })));
  refused(dir.path + "/lacks", true, "fc2.bias");
  // The index names a key its shard does not hold.
  auto shards = split(with([](ck::StateDict&) {}));
  write_sharded(dir.path + "/unheld", shards);
  shards[1].erase("fc2.bias");
  ck::safetensors::save_file(
      dir.path + "/unheld/model-00002.safetensors", shards[1]);
  refused(dir.path + "/unheld", true, "fc2.bias");
  // Loads that pass still load everything.
  booster.load_model(b.model, dir.path + "/extra", false);
  expect_same_state(*src, *dst);

  // GPT-2's head trained untied, its second name in the second shard.
  namespace models = colossalai::models;
  torch::manual_seed(0);
  models::GPT2LMHeadModel gsrc(models::GPT2Config::tiny_test());
  torch::manual_seed(1);
  models::GPT2LMHeadModel gdst(models::GPT2Config::tiny_test());
  auto gb = booster.boost(gdst.ptr());
  const auto gbefore = snapshot_state(*gdst);
  std::vector<ck::StateDict> gshards(2);
  for (const auto& item : ck::model_state_dict(*gsrc)) {
    gshards[0].insert(item.key(), item.value().detach());
  }
  gshards[1].insert(
      "lm_head.weight", gsrc->transformer->wte->weight.detach() + 1);
  write_sharded(dir.path + "/untied", gshards);
  const auto e = error_of([&] { booster.load_model(gb.model, dir.path + "/untied"); });
  EXPECT_NE(e.find("'lm_head.weight' is tied to"), std::string::npos) << e;
  expect_unchanged(*gdst, gbefore);
}

// A sharded save of a colossalai::models model writes config.json (and,
// when the config knows its special tokens, generation_config.json) beside
// the shards, as ColossalAI's sharded save does: the directory is a model
// directory from_pretrained reads. Other modules get no config.
TEST(CheckpointIO, ShardedSaveOfAFamilyModelIsAModelDirectory) {
  namespace models = colossalai::models;
  colossalai::testing::ScratchDir dir("colossalai_ckpt_config");
  cb::Booster booster;
  torch::manual_seed(0);
  auto config = models::LlamaConfig::tiny_test().source_json(
      R"({"bos_token_id": 1, "eos_token_id": 2, "transformers_version": "5.24.0"})");
  models::LlamaForCausalLM src(config);
  auto b = booster.boost(src.ptr());
  const std::string out = dir.path + "/llama";
  booster.save_model(
      b.model, out, ck::SaveModelOptions().shard(true).use_safetensors(true));
  ASSERT_TRUE(fs::exists(out + "/config.json"));
  const auto j = nlohmann::json::parse(models::pretrained_config_json(out));
  EXPECT_EQ(j.at("model_type"), "llama");
  EXPECT_EQ(j.at("architectures")[0], "LlamaForCausalLM");
  EXPECT_EQ(j.at("hidden_size"), config.hidden_size());
  EXPECT_EQ(j.at("dtype"), "float32");
  EXPECT_EQ(j.at("bos_token_id"), 1);
  auto loaded = models::from_pretrained<models::LlamaForCausalLM>(out);
  expect_same_state(*src, *loaded);
  EXPECT_EQ(loaded->config().hidden_size(), config.hidden_size());
  std::ifstream g(out + "/generation_config.json");
  const std::string generation(std::istreambuf_iterator<char>(g), {});
  EXPECT_NE(generation.find("\"_from_model_config\": true"), std::string::npos)
      << generation;
  EXPECT_NE(generation.find("\"bos_token_id\": 1"), std::string::npos)
      << generation;
  EXPECT_NE(generation.find("\"eos_token_id\": 2"), std::string::npos)
      << generation;

  // No special tokens known: no generation config; not a family: nothing.
  models::LlamaForCausalLM plain(models::LlamaConfig::tiny_test());
  auto pb = booster.boost(plain.ptr());
  booster.save_model(pb.model, dir.path + "/plain", ck::SaveModelOptions().shard(true));
  EXPECT_TRUE(fs::exists(dir.path + "/plain/config.json"));
  EXPECT_FALSE(fs::exists(dir.path + "/plain/generation_config.json"));
  auto net = trained_net();
  auto nb = booster.boost(net);
  booster.save_model(nb.model, dir.path + "/net", ck::SaveModelOptions().shard(true));
  EXPECT_FALSE(fs::exists(dir.path + "/net/config.json"));
}
