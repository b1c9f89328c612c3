// LoRA (booster.enable_lora / save_lora_as_pretrained): adapters on
// colossalai's layers (GPT-2) and on torch::nn::Linear / Embedding (GPT),
// PEFT's file layout, and data-parallel LoRA training against one process.

#include <colossalai/booster/booster.h>
#include <colossalai/booster/plugin/gemini_plugin.h>
#include <colossalai/booster/plugin/hybrid_parallel_plugin.h>
#include <colossalai/booster/plugin/low_level_zero_plugin.h>
#include <colossalai/booster/plugin/torch_ddp_plugin.h>
#include <colossalai/checkpoint_io/safetensors.h>
#include <colossalai/checkpoint_io/torch_bin.h>
#include <colossalai/lora/lora_model.h>
#include <colossalai/models/gpt2.h>
#include <harness/deadline.h>
#include <harness/multiprocess.h>
#include <harness/test_util.h>
#include <zoo/gpt.h>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>

#include <sys/stat.h>
#include <unistd.h>

namespace {

namespace cb = colossalai::booster;
namespace cl = colossalai::lora;
namespace cio = colossalai::checkpoint_io;
namespace zoo = colossalai::zoo;
namespace models = colossalai::models;
namespace fs = std::filesystem;
using colossalai::testing::error_of;
using colossalai::testing::remove_scratch;
using colossalai::testing::run_distributed;
using colossalai::testing::scratch;

models::GPT2LMHeadModel gpt2(int seed) {
  torch::manual_seed(seed);
  return models::GPT2LMHeadModel(models::GPT2Config::tiny_test().n_layer(2));
}

zoo::GPT gpt(int seed) {
  torch::manual_seed(seed);
  return zoo::GPT(zoo::GPTConfig::tiny_test());
}

at::Tensor tokens(int seed, int64_t vocab, int64_t batch = 4) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randint(vocab, {batch, 9}, gen);
}

cl::LoraConfig gpt2_config() {
  return cl::LoraConfig().r(4).lora_alpha(8).target_modules(
      {"c_attn", "c_proj"});
}

cl::LoraConfig gpt_config() {
  return cl::LoraConfig().r(4).lora_alpha(8).target_modules(
      {"qkv", "fc", "wte"});
}

// At init B = 0: the adapted model's output is the base model's, bit for
// bit (the adapter adds exact zeros); backward reaches only the adapters.
TEST(Lora, OutputEqualsBaseAtInitAndOnlyAdaptersGetGradients) {
  auto check = [](auto model, const cl::LoraConfig& config, int64_t vocab) {
    const at::Tensor ids = tokens(1, vocab);
    const at::Tensor before = model->forward(ids).detach();
    cl::LoraModel lora(model.ptr(), config);
    EXPECT_TRUE(at::equal(model->forward(ids), before));
    auto trainable = lora.trainable_parameters();
    EXPECT_EQ(trainable.size(), 2 * lora.adapted_modules().size());
    const at::Tensor out = model->forward(ids);
    out.sum().backward();
    for (const auto& item : model->named_parameters()) {
      const bool adapter = item.key().find("lora_") != std::string::npos;
      const at::Tensor p = item.value();
      EXPECT_EQ(p.requires_grad(), adapter) << item.key();
      EXPECT_EQ(p.grad().defined(), adapter) << item.key();
    }
  };
  check(gpt2(1), gpt2_config(), 100); // adapter path
  check(gpt(1), gpt_config(), 96);    // reparametrised Linear and Embedding
}

// Every layer recomputed in backward: the frozen embedding's output needs
// no gradient, yet the adapters inside the checkpointed layers get theirs,
// the same as without recomputation (the same operations on the same
// values: equal on the CPU). B is set nonzero so that A's gradient is too.
TEST(Lora, AdaptersTrainUnderActivationCheckpointing) {
  std::vector<std::vector<at::Tensor>> grads;
  for (const double ratio : {0.0, 1.0}) {
    auto model = gpt2(2);
    cl::LoraModel lora(model.ptr(), gpt2_config());
    {
      at::NoGradGuard no_grad;
      for (auto& p : lora.trainable_parameters()) {
        p.normal_(0.0, 0.1);
      }
    }
    model->parallel_state().gradient_checkpointing_ratio = ratio;
    model->train();
    model->forward(tokens(3, 100)).pow(2).mean().backward();
    std::vector<at::Tensor> g;
    for (const auto& p : lora.trainable_parameters()) {
      ASSERT_TRUE(p.grad().defined());
      g.push_back(p.grad().clone());
    }
    grads.push_back(std::move(g));
  }
  for (size_t i = 0; i < grads[0].size(); ++i) {
    EXPECT_GT(grads[0][i].abs().max().item<double>(), 0.0) << i;
    EXPECT_TRUE(at::equal(grads[1][i], grads[0][i])) << "adapter tensor " << i;
  }
}

// With B != 0 the adapter changes the output; merging moves it into the
// weights (same output up to fp32 rounding of W + s B A: 1e-5 is about
// 100 ulps of these O(1) logits) and unmerging gives the weights back.
TEST(Lora, MergeAndUnmerge) {
  auto check = [](auto model, cl::LoraConfig config, int64_t vocab) {
    const at::Tensor ids = tokens(2, vocab);
    const at::Tensor base = model->forward(ids).detach();
    std::map<std::string, at::Tensor> weights;
    for (const auto& item : model->named_parameters()) {
      const at::Tensor w = item.value();
      weights[item.key()] = w.detach().clone();
    }
    cl::LoraModel lora(model.ptr(), config.init_lora_weights("none"));
    const at::Tensor adapted = model->forward(ids).detach();
    const at::Tensor change = (adapted - base).abs().max();
    EXPECT_GT(change.item().toDouble(), 1e-3);
    lora.merge();
    EXPECT_TRUE(at::allclose(model->forward(ids), adapted, 0, 1e-5));
    lora.unmerge();
    EXPECT_TRUE(at::allclose(model->forward(ids), adapted, 0, 1e-5));
    auto named = model->named_parameters();
    for (const auto& kv : weights) {
      const at::Tensor now = named[kv.first];
      EXPECT_TRUE(at::allclose(now, kv.second, 0, 1e-6)) << kv.first;
    }
  };
  check(gpt2(3), gpt2_config(), 100);
  check(gpt(3), gpt_config(), 96);
}

// The files follow PEFT's save_pretrained: key names, config fields; a
// model given the saved adapter computes the same outputs.
TEST(Lora, SavesAndLoadsPeftLayout) {
  const auto dir = colossalai::testing::temp_dir("lora_save");
  for (const bool st : {true, false}) {
    auto model = gpt2(4);
    cb::Booster booster;
    auto lora = booster.enable_lora(
        model, "", gpt2_config().init_lora_weights("none").bias("lora_only"));
    auto boosted = booster.boost(model);
    auto ids = tokens(3, 100);
    auto want = boosted.model(ids).detach();
    const auto out = dir + (st ? "/st" : "/bin");
    booster.save_lora_as_pretrained(boosted.model, out, st);
    auto state = st
        ? cio::safetensors::load_file(out + "/adapter_model.safetensors")
        : cio::load_bin(out + "/adapter_model.bin");
    for (const char* key :
         {"base_model.model.transformer.h.0.attn.c_attn.lora_A.weight",
          "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight",
          "base_model.model.transformer.h.1.mlp.c_proj.lora_A.weight",
          "base_model.model.transformer.h.1.mlp.c_proj.bias"}) {
      EXPECT_NE(state.find(key), nullptr) << key;
    }
    // 2 blocks x (c_attn, attn.c_proj, mlp.c_proj): A, B and bias each.
    EXPECT_EQ(state.size(), 2u * 3u * 3u);
    EXPECT_EQ(
        state["base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"]
            .sizes(),
        (at::IntArrayRef{4, 32}));
    std::ifstream f(out + "/adapter_config.json");
    auto j = nlohmann::json::parse(f);
    EXPECT_EQ(j.at("peft_type"), "LORA");
    EXPECT_EQ(j.at("r"), 4);
    EXPECT_EQ(j.at("lora_alpha"), 8.0);
    EXPECT_EQ(j.at("bias"), "lora_only");
    EXPECT_EQ(j.at("fan_in_fan_out"), true); // GPT-2's Conv1D layout
    EXPECT_EQ(j.at("init_lora_weights"), false);
    EXPECT_EQ(
        j.at("target_modules").get<std::vector<std::string>>(),
        (std::vector<std::string>{"c_attn", "c_proj"}));

    auto other = gpt2(4);
    cb::Booster booster2;
    booster2.enable_lora(other, out);
    auto boosted2 = booster2.boost(other);
    EXPECT_TRUE(at::equal(boosted2.model(ids), want));
  }
  fs::remove_all(dir);
}

// An adapter written by Python (torch only, PEFT's layout and config) for a
// Sequential MLP loads here and gives Python's output (fp32, the same
// operations in another order: 1e-5 absolute on outputs of size ~1).
TEST(Lora, LoadsAnAdapterWrittenByPython) {
  using colossalai::testing::kPython;
  if (!colossalai::testing::python_has_torch()) {
    GTEST_SKIP() << "Python torch absent: install python3-torch";
  }
  const auto dir = colossalai::testing::temp_dir("lora_python");
  torch::manual_seed(5);
  torch::nn::Sequential mlp(
      torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4));
  cio::StateDict base;
  for (const auto& item : mlp->named_parameters()) {
    base.insert(item.key(), item.value().detach());
  }
  cio::save_bin(dir + "/base.bin", base);
  auto x = torch::randn({5, 8});
  cio::StateDict xs;
  xs.insert("x", x);
  cio::save_bin(dir + "/x.bin", xs);
  const auto script =
      fs::path(__FILE__).parent_path() / "python" / "peft_adapter.py";
  auto [rc, out] = colossalai::testing::run_shell(
      std::string(kPython) + " " + script.string() + " " + dir);
  ASSERT_EQ(rc, 0) << out;
  cb::Booster booster;
  auto lora = booster.enable_lora(mlp, dir + "/adapter");
  EXPECT_EQ(lora->adapted_modules(), (std::vector<std::string>{"0", "2"}));
  auto boosted = booster.boost(mlp);
  auto y = boosted.model(x);
  auto want = cio::load_bin(dir + "/y.bin")["y"];
  EXPECT_TRUE(at::allclose(y, want, 0, 1e-5))
      << (y - want).abs().max().item<double>();
  fs::remove_all(dir);
}

// Data-parallel LoRA training equals one process training the same
// adapters on the whole batch (3 SGD-momentum steps; bound as
// test_hybrid_parallel's: fp32 gradient sums in another order), the frozen
// weights do not move, and the optimizer holds only adapters.
TEST(Lora, DataParallelTrainingMatchesOneProcess) {
  constexpr int kSteps = 3;
  constexpr double kAtol = 2e-5;
  auto batch = [](int step) {
    auto t = tokens(100 + step, 100, 8);
    return std::make_pair(
        t.narrow(1, 0, 8).contiguous(), t.narrow(1, 1, 8).contiguous());
  };
  auto config = gpt2_config().init_lora_weights("gaussian");
  // One process.
  std::map<std::string, at::Tensor> want;
  {
    auto model = gpt2(6);
    cl::LoraModel lora(model.ptr(), config);
    torch::optim::SGD opt(
        lora.trainable_parameters(),
        torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < kSteps; ++step) {
      auto b = batch(step);
      opt.zero_grad();
      model->loss(model->forward(b.first), b.second).backward();
      opt.step();
    }
    for (const auto& item : model->named_parameters()) {
      want[item.key()] = item.value().detach().clone();
    }
  }
  run_distributed(2, [&](int rank, int world) {
    std::vector<std::pair<std::string, std::shared_ptr<cb::plugin::Plugin>>>
        plugins{
            {"TorchDDP", std::make_shared<cb::plugin::TorchDDPPlugin>()},
            {"ZeRO-1",
             std::make_shared<cb::plugin::LowLevelZeroPlugin>(
                 cb::plugin::LowLevelZeroPluginOptions().stage(1).precision(
                     "fp32"))},
            {"ZeRO-2",
             std::make_shared<cb::plugin::LowLevelZeroPlugin>(
                 cb::plugin::LowLevelZeroPluginOptions().stage(2).precision(
                     "fp32"))},
            {"Hybrid dp2 ZeRO-1",
             std::make_shared<cb::plugin::HybridParallelPlugin>(
                 cb::plugin::HybridParallelPluginOptions()
                     .zero_stage(1)
                     .precision("fp32"))}};
    for (auto& [name, plugin] : plugins) {
      SCOPED_TRACE(name);
      cb::Booster booster(cb::BoosterOptions().plugin(plugin));
      auto model = gpt2(6);
      booster.enable_lora(model, "", config);
      auto opt = std::make_shared<torch::optim::SGD>(
          model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      auto boosted = booster.boost(model, opt);
      const int64_t local = 8 / world;
      for (int step = 0; step < kSteps; ++step) {
        auto b = batch(step);
        auto x = b.first.narrow(0, rank * local, local);
        auto y = b.second.narrow(0, rank * local, local);
        boosted.optimizer->zero_grad();
        booster.backward(model->loss(boosted.model(x), y), *boosted.optimizer);
        boosted.optimizer->step();
      }
      size_t held = 0;
      for (const auto& g : opt->param_groups()) {
        held += g.params().size();
      }
      EXPECT_LE(held, 2u * 6u); // adapters only (ZeRO may hold flat pieces)
      for (const auto& item : model->named_parameters()) {
        const at::Tensor diff =
            colossalai::testing::host(item.value().detach()) -
            want.at(item.key());
        const double err = diff.abs().max().item<double>();
        if (item.key().find("lora_") == std::string::npos) {
          EXPECT_EQ(err, 0.0) << item.key() << " is frozen but moved";
        } else {
          EXPECT_LE(err, kAtol) << item.key();
        }
      }
    }
  });
}

TEST(Lora, MisuseNamesTheProblem) {
  auto has = [](const std::function<void()>& f, const std::string& what) {
    const auto e = error_of(f);
    EXPECT_NE(e.find(what), std::string::npos) << "got: " << e;
  };
  has(
      [] {
        cl::LoraModel(gpt2(1).ptr(), cl::LoraConfig().target_modules({"nope"}));
      },
      "matches no module");
  has(
      [] {
        cl::LoraModel(gpt2(1).ptr(), cl::LoraConfig().target_modules({"ln_1"}));
      },
      "LoRA cannot adapt");
  has([] { cl::LoraModel(gpt2(1).ptr(), cl::LoraConfig()); }, "target_modules");
  has([] { cl::LoraModel(gpt(1).ptr(), gpt_config().lora_dropout(0.1)); },
      "lora_dropout");
  has([] { cl::LoraModel(gpt2(1).ptr(), gpt2_config().bias("some")); }, "bias");
  has([] { cl::LoraModel(gpt2(1).ptr(), gpt2_config().r(0)); }, "r must be");
  has(
      [] {
        cb::Booster booster;
        auto m = gpt2(1);
        booster.enable_lora(m);
      },
      "pass a lora_config");
  has(
      [] {
        cb::Booster booster;
        auto m = gpt2(1);
        booster.boost(m);
        booster.enable_lora(m, "", gpt2_config());
      },
      "before boost");
  has(
      [] {
        cb::Booster booster;
        auto m = gpt2(1);
        booster.enable_lora(m, "/nonexistent/adapter");
      },
      "adapter_config.json");
  has([] { cl::LoraConfig::from_json("{\"peft_type\": \"IA3\"}", "x.json"); },
      "only LORA");
}

// ---------------------------------------------------------------------------
// Hostile adapter files: every field checked by name, regexes matched with
// bounded work, r checked against the layers and the weights file before
// anything is allocated, only regular files read. Hang-prone cases run in a
// forked child with a deadline.

using colossalai::testing::run_with_deadline;

// An adapter directory: `config` as adapter_config.json, and the weights
// of a real adapter of r 4 on gpt2()'s c_attn / c_proj.
struct AdapterDir : colossalai::testing::ScratchDir {
  explicit AdapterDir(const nlohmann::json& config) : ScratchDir("lora_bad") {
    auto model = gpt2(1);
    cl::LoraModel(model.ptr(), gpt2_config()).save_pretrained(path, true);
    std::ofstream(path + "/adapter_config.json") << config.dump();
  }
};

nlohmann::json peft_config() {
  return {
      {"peft_type", "LORA"},
      {"r", 4},
      {"lora_alpha", 8},
      {"target_modules", {"c_attn", "c_proj"}}};
}

// The error of loading `dir` onto gpt2(), in a child with a deadline.
std::string load_error(const std::string& dir, double max_seconds = 5) {
  auto model = gpt2(1); // built here: the child only loads
  const auto o = run_with_deadline(30, [&] {
    cl::LoraModel::from_pretrained(model.ptr(), dir);
  });
  EXPECT_TRUE(o.threw) << o.describe();
  EXPECT_LT(o.seconds, max_seconds) << o.describe();
  EXPECT_LT(o.error.size(), 1500u) << "a value dumped whole: " << o.error;
  return o.error;
}

TEST(LoraHostile, AdapterConfigFieldsAreCheckedByName) {
  struct Bad {
    std::function<void(nlohmann::json&)> edit;
    std::string want;
  };
  const std::vector<Bad> bad = {
      {[](auto& j) { j["r"] = "8"; }, "field 'r' must be an integer > 0"},
      {[](auto& j) { j["r"] = 2.5; }, "field 'r'"},
      {[](auto& j) { j["r"] = -3; }, "field 'r'"},
      {[](auto& j) { j["r"] = 0; }, "field 'r'"},
      {[](auto& j) { j["r"] = 18446744073709551615ull; }, "field 'r'"},
      {[](auto& j) { j["lora_alpha"] = "x"; }, "field 'lora_alpha'"},
      {[](auto& j) { j["lora_dropout"] = 1.5; }, "lora_dropout"},
      {[](auto& j) { j["target_modules"] = 5; }, "field 'target_modules'"},
      {[](auto& j) { j["target_modules"] = {1}; }, "field 'target_modules'"},
      {[](auto& j) { j.erase("target_modules"); }, "'target_modules' is missing"},
      {[](auto& j) { j["bias"] = 3; }, "field 'bias'"},
      {[](auto& j) { j["use_rslora"] = "yes"; }, "field 'use_rslora'"},
      {[](auto& j) { j["modules_to_save"] = "lm_head"; },
       "field 'modules_to_save'"},
      {[](auto& j) { j["init_lora_weights"] = 3; },
       "field 'init_lora_weights'"},
      {[](auto& j) { j["rank_pattern"] = {1}; }, "field 'rank_pattern'"},
      {[](auto& j) { j["peft_type"] = 7; }, "field 'peft_type'"},
      {[](auto& j) { j["use_dora"] = "no"; }, "field 'use_dora'"},
  };
  for (const auto& b : bad) {
    auto j = peft_config();
    b.edit(j);
    SCOPED_TRACE(j.dump());
    const auto e =
        error_of([&] { cl::LoraConfig::from_json(j.dump(), "a/adapter_config.json"); });
    EXPECT_NE(e.find("a/adapter_config.json"), std::string::npos) << e;
    EXPECT_NE(e.find(b.want), std::string::npos) << e;
  }
  // 1e5 nested arrays: refused before parsing (no recursion over them).
  const std::string deep = "{\"r\": " + std::string(100000, '[') +
      std::string(100000, ']') + "}";
  const auto o = run_with_deadline(
      30, [&] { cl::LoraConfig::from_json(deep, "a/adapter_config.json"); });
  ASSERT_TRUE(o.threw) << o.describe();
  EXPECT_NE(o.error.find("128 levels deep"), std::string::npos) << o.error;
  EXPECT_LT(o.error.size(), 1000u);
}

TEST(LoraHostile, TargetModuleRegexesRunWithBoundedWork) {
  // PEFT's string form: re.fullmatch on each dotted name.
  auto names = [](const cl::LoraConfig& config) {
    auto model = gpt2(1);
    return cl::LoraModel(model.ptr(), config).adapted_modules();
  };
  const auto listed = names(gpt2_config());
  EXPECT_EQ(listed.size(), 6u);
  EXPECT_EQ(
      names(gpt2_config().target_modules_regex(R"(.*\.(c_attn|c_proj))")),
      listed);
  EXPECT_EQ(
      names(gpt2_config().target_modules_regex(
          R"(^(?!.*mlp).*\.c_(attn|proj)$)")),
      (std::vector<std::string>{
          "transformer.h.0.attn.c_attn",
          "transformer.h.0.attn.c_proj",
          "transformer.h.1.attn.c_attn",
          "transformer.h.1.attn.c_proj"}));
  EXPECT_EQ(
      names(gpt2_config().target_modules_regex(R"((?i).*H\.1\.MLP\.C_PROJ)")),
      (std::vector<std::string>{"transformer.h.1.mlp.c_proj"}));

  // Each hostile pattern, from a file: refused by name, or matched in
  // bounded time (a backtracking matcher takes minutes on the second).
  struct Case {
    std::string pattern, want;
  };
  const std::vector<Case> cases = {
      {std::string(30000, '(') + "c_attn" + std::string(30000, ')'),
       "more than 4096"},
      {std::string(1000, '(') + "c_attn" + std::string(1000, ')'),
       "groups nested more than 64 deep"},
      {"(.*.*)*c_attnX", "matches no module"},
      {"((a*)*)*(.*.*.*)*(b|b?)*c_attnX", "matches no module"},
      {"(x{1000}){1000}", "more than 20000 steps"},
      {"(c_attn)\\1", "backreferences"},
      {"(?<=a+)c_attn", "fixed-width"},
      {"c_attn(", "missing )"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.want);
    auto j = peft_config();
    j["target_modules"] = c.pattern;
    AdapterDir dir(j);
    const auto e = load_error(dir.path, 2.0);
    EXPECT_NE(e.find(c.want), std::string::npos) << e;
    EXPECT_NE(e.find("target_modules"), std::string::npos) << e;
  }
}

TEST(LoraHostile, RankIsCheckedBeforeAnythingIsAllocated) {
  // r 1e7 would allocate 1e7 x (32 + 96) floats per c_attn (5 GB for the
  // model): the layer's size bounds it.
  auto e = error_of([] {
    cl::LoraModel(gpt2(1).ptr(), gpt2_config().r(10000000));
  });
  EXPECT_NE(e.find("r 10000000"), std::string::npos) << e;
  EXPECT_NE(e.find("transformer.h.0.attn.c_attn"), std::string::npos) << e;
  EXPECT_NE(e.find("min(in, out) = 32"), std::string::npos) << e;
  // From a file: the same, and an r the layers allow but the weights file
  // does not hold, refused from its header before the adapters exist.
  auto j = peft_config();
  j["r"] = 10000000;
  {
    AdapterDir dir(j);
    e = load_error(dir.path);
    EXPECT_NE(e.find("r 10000000"), std::string::npos) << e;
  }
  j["r"] = 16;
  AdapterDir dir(j);
  e = load_error(dir.path);
  EXPECT_NE(e.find(dir.path + "/adapter_model.safetensors"), std::string::npos)
      << e;
  EXPECT_NE(
      e.find("'base_model.model.transformer.h.0.attn.c_attn.lora_A.weight' "
             "has shape [4, 32]"),
      std::string::npos)
      << e;
  EXPECT_NE(e.find("(r 16)"), std::string::npos) << e;
  EXPECT_NE(e.find("[16, 32]"), std::string::npos) << e;
  // lora_alpha must be finite.
  e = error_of([] {
    cl::LoraModel(
        gpt2(1).ptr(),
        gpt2_config().lora_alpha(std::numeric_limits<double>::infinity()));
  });
  EXPECT_NE(e.find("lora_alpha must be finite"), std::string::npos) << e;
}

TEST(LoraHostile, OnlyRegularFilesAreRead) {
  for (const char* name :
       {"adapter_config.json", "adapter_model.safetensors"}) {
    SCOPED_TRACE(name);
    AdapterDir dir(peft_config());
    const auto file = dir.path + "/" + name;
    fs::remove(file);
    // A FIFO no one writes: open() alone would block.
    ASSERT_EQ(::mkfifo(file.c_str(), 0600), 0);
    auto e = load_error(dir.path);
    EXPECT_NE(e.find(file), std::string::npos) << e;
    EXPECT_NE(e.find("is a FIFO, not a regular file"), std::string::npos) << e;
    fs::remove(file);
    fs::create_symlink("/dev/zero", file);
    e = load_error(dir.path);
    EXPECT_NE(e.find("a character device"), std::string::npos) << e;
  }
  // A config larger than any PEFT writes is not read whole.
  AdapterDir dir(peft_config());
  {
    std::ofstream big(dir.path + "/adapter_config.json");
    big << "{\"r\": 4, \"x\": \"" << std::string(17 << 20, 'x') << "\"}";
  }
  const auto e = load_error(dir.path);
  EXPECT_NE(e.find("more than the 16.0 MiB"), std::string::npos) << e;
}

} // namespace
