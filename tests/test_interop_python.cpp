// Files exchanged with Python's torch: Python reads our safetensors (with a
// reader written from the spec) and .bin files (torch.load), and writes files
// of its own that we read back, model and optimizer checkpoints included.
// Needs the Python of COLOSSALAI_PYTHON with torch.

#include <colossalai/booster/booster.h>
#include <colossalai/checkpoint_io/general_checkpoint_io.h>
#include <colossalai/checkpoint_io/safetensors.h>
#include <colossalai/checkpoint_io/torch_bin.h>
#include <colossalai/models/gpt2.h>
#include <colossalai/models/llama.h>
#include <colossalai/nn/lr_scheduler/all.h>
#include <colossalai/nn/optimizer/hybrid_adam.h>
#include <colossalai/utils/compat.h>
#include <harness/scheduler_exchange.h>
#include <harness/test_util.h>

#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
namespace models = colossalai::models;
namespace st = colossalai::checkpoint_io::safetensors;
using colossalai::checkpoint_io::StateDict;

using colossalai::testing::kPython;
using colossalai::testing::expect_values;
using colossalai::testing::lrs_and_momenta;
using colossalai::testing::sched_optimizer;
using colossalai::testing::SchedulerCase;
using colossalai::testing::python_has_torch;

/// The tensors both sides write; `expected()` in tests/python/interop.py
/// builds the same.
StateDict expected() {
  StateDict sd;
  sd.insert("f32", at::arange(12, at::kFloat).reshape({3, 4}) / 4 - 1);
  sd.insert("bf16", ((at::arange(10) - 5) * 0.5).to(at::kBFloat16));
  sd.insert(
      "i64", at::arange(6, at::kLong).reshape({2, 3}) * (int64_t(1) << 40) - 3);
  sd.insert("f16", ((at::arange(8) - 4) / 8).to(at::kHalf).reshape({2, 2, 2}));
  sd.insert("bool", at::arange(5).remainder(2) == 0);
  sd.insert("scalar", at::scalar_tensor(3.25, at::kDouble));
  return sd;
}

std::string quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  }
  return out + "'";
}

void expect_tensor(
    const std::string& what,
    const at::Tensor& want,
    const at::Tensor* got) {
  ASSERT_NE(got, nullptr) << what << " is missing";
  EXPECT_EQ(got->scalar_type(), want.scalar_type()) << what;
  EXPECT_EQ(got->sizes(), want.sizes()) << what;
  EXPECT_TRUE(got->equal(want)) << what << ": " << *got << " vs " << want;
}

/// A fresh directory, removed at the end of the test.
struct ScratchDir {
  ScratchDir() {
    std::string pattern =
        (fs::temp_directory_path() / "interop_XXXXXX").string();
    EXPECT_NE(::mkdtemp(&pattern[0]), nullptr);
    path = pattern;
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path path;
};

fs::path script_path() {
  // The script sits beside this source file.
  return fs::path(__FILE__).parent_path() / "python" / "interop.py";
}

TEST(InteropPython, ExchangesFilesWithPythonTorch) {
  if (!python_has_torch()) {
    GTEST_SKIP() << "Python torch absent: install python3-torch";
  }
  const fs::path script = script_path();
  ASSERT_TRUE(fs::exists(script)) << script;

  ScratchDir scratch;
  const fs::path dir = scratch.path;

  const StateDict want = expected();
  st::save_file(
      (dir / "cpp.safetensors").string(), want, {{"writer", "colossalai"}});
  colossalai::checkpoint_io::save_bin((dir / "cpp.bin").string(), want);

  const auto result = colossalai::testing::run_shell(
      std::string(kPython) + " " + quote(script.string()) + " check " +
      quote(dir.string()));
  ASSERT_EQ(result.first, 0) << "interop.py failed:\n" << result.second;

  auto file = st::MappedFile::open((dir / "py.safetensors").string());
  EXPECT_EQ(file->header().metadata.at("writer"), "python");
  const StateDict from_st = file->tensors();
  EXPECT_EQ(from_st.size(), want.size());
  for (const auto& item : want) {
    expect_tensor(
        "py.safetensors:" + item.key(), item.value(), from_st.find(item.key()));
  }

  const StateDict from_bin =
      colossalai::checkpoint_io::load_bin((dir / "py.bin").string());
  std::vector<std::string> keys = want.keys();
  keys.push_back("f32_t");
  EXPECT_EQ(from_bin.keys(), keys);
  for (const auto& item : want) {
    expect_tensor(
        "py.bin:" + item.key(), item.value(), from_bin.find(item.key()));
  }
  expect_tensor("py.bin:f32_t", want["f32"].t(), from_bin.find("f32_t"));
  EXPECT_TRUE(from_bin["f32_t"].is_alias_of(from_bin["f32"]));

  const StateDict one =
      colossalai::checkpoint_io::load_bin((dir / "py_one.bin").string());
  ASSERT_EQ(one.keys(), std::vector<std::string>{"only"});
  expect_tensor("py_one.bin:only", at::arange(3), one.find("only"));
}

TEST(InteropPython, LoadsPythonModelAndOptimizerCheckpoints) {
  if (!python_has_torch()) {
    GTEST_SKIP() << "Python torch absent: install python3-torch";
  }
  ScratchDir scratch;
  const auto dir = scratch.path;
  const auto result = colossalai::testing::run_shell(
      std::string(kPython) + " " + quote(script_path().string()) + " optim " +
      quote(dir.string()));
  ASSERT_EQ(result.first, 0) << "interop.py optim failed:\n" << result.second;

  // optim_batch() in interop.py.
  const auto x = at::arange(8, at::kFloat).reshape({2, 4}) / 8;
  const auto y = at::arange(6, at::kFloat).reshape({2, 3}) / 6 - 0.5;
  using Make = std::function<std::shared_ptr<torch::optim::Optimizer>(
      std::vector<at::Tensor>)>;
  const std::vector<std::pair<std::string, Make>> cases = {
      {"adamw",
       [](std::vector<at::Tensor> p) {
         // Different hyperparameters: the checkpoint's must win.
         return std::make_shared<torch::optim::AdamW>(
             p, torch::optim::AdamWOptions(1.0).weight_decay(0.5));
       }},
      {"adam",
       [](std::vector<at::Tensor> p) {
         return std::make_shared<torch::optim::Adam>(
             p, torch::optim::AdamOptions(1.0).weight_decay(0.5));
       }},
      {"sgd",
       [](std::vector<at::Tensor> p) {
         return std::make_shared<torch::optim::SGD>(
             p, torch::optim::SGDOptions(1.0).momentum(0.5));
       }},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.first);
    const auto file = [&](const std::string& kind) {
      return (dir / (kind + "_" + c.first + ".bin")).string();
    };
    torch::nn::Linear model(4, 3);
    auto optimizer = c.second(model->parameters());
    colossalai::booster::Booster booster;
    auto boosted = booster.boost(model.ptr(), optimizer);
    booster.load_model(boosted.model, file("model"));
    booster.load_optimizer(*boosted.optimizer, file("optim"));

    // The state is Python's, bit for bit.
    const StateDict expect =
        colossalai::checkpoint_io::load_bin(file("expect"));
    auto& state = optimizer->state();
    using Map = std::decay_t<decltype(state)>;
    const std::vector<at::Tensor> params = {model->weight, model->bias};
    for (size_t id = 0; id < params.size(); ++id) {
      auto it =
          state.find(colossalai::compat::optimizer_state_key<Map>(params[id]));
      ASSERT_NE(it, state.end()) << "no state for parameter " << id;
      const auto prefix = std::to_string(id) + ".";
      if (c.first == "sgd") {
        auto& s = static_cast<torch::optim::SGDParamState&>(*it->second);
        expect_tensor(
            "momentum_buffer",
            expect[prefix + "momentum_buffer"],
            &s.momentum_buffer());
      } else {
        auto& s = static_cast<torch::optim::AdamParamState&>(*it->second);
        EXPECT_EQ(s.step(), 2);
        expect_tensor("exp_avg", expect[prefix + "exp_avg"], &s.exp_avg());
        expect_tensor(
            "exp_avg_sq", expect[prefix + "exp_avg_sq"], &s.exp_avg_sq());
      }
    }
    // One more step equals Python's third step. Tolerance: the same update
    // formula in a different operation order (Python's functional optimizer
    // vs LibTorch's) differs by a few float32 ulps of values below 1; a wrong
    // hyperparameter (lr 1.0 vs 0.01) or a lost moment moves them by >1e-3.
    optimizer->zero_grad();
    (model(x) - y).pow(2).mean().backward();
    optimizer->step();
    const StateDict after = colossalai::checkpoint_io::load_bin(file("after"));
    EXPECT_TRUE(at::allclose(model->weight, after["weight"], 1e-5, 1e-6))
        << (model->weight - after["weight"]).abs().max();
    EXPECT_TRUE(at::allclose(model->bias, after["bias"], 1e-5, 1e-6))
        << (model->bias - after["bias"]).abs().max();
  }
}

// The other way: optimizer checkpoints we write carry the param-group keys
// PyTorch's optimizers read in their step (maximize, foreach, capturable,
// differentiable, fused, ...), so Python trains on from them even when the
// groups are installed verbatim, as ColossalAI's sharded and HybridParallel
// loaders do; its third step equals ours. Tolerance as above: the same
// update in another operation order.
TEST(InteropPython, PythonTrainsOnFromOurOptimizerCheckpoints) {
  if (!python_has_torch()) {
    GTEST_SKIP() << "Python torch absent: install python3-torch";
  }
  ScratchDir scratch;
  const auto dir = scratch.path;
  const auto x = at::arange(8, at::kFloat).reshape({2, 4}) / 8;
  const auto y = at::arange(6, at::kFloat).reshape({2, 3}) / 6 - 0.5;
  using Make = std::function<std::shared_ptr<torch::optim::Optimizer>(
      std::vector<at::Tensor>)>;
  namespace o = torch::optim;
  const std::vector<std::pair<std::string, Make>> cases = {
      {"adamw",
       [](auto p) {
         return std::make_shared<o::AdamW>(
             p, o::AdamWOptions(1e-2).weight_decay(0.05));
       }},
      {"adam",
       [](auto p) {
         return std::make_shared<o::Adam>(p, o::AdamOptions(1e-2));
       }},
      {"sgd",
       [](auto p) {
         return std::make_shared<o::SGD>(p, o::SGDOptions(0.1).momentum(0.9));
       }},
      {"rmsprop",
       [](auto p) {
         return std::make_shared<o::RMSprop>(p, o::RMSpropOptions(1e-2));
       }},
      {"adagrad",
       [](auto p) {
         return std::make_shared<o::Adagrad>(p, o::AdagradOptions(0.1));
       }},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.first);
    const auto file = [&](const std::string& kind) {
      return (dir / (kind + "_" + c.first + ".bin")).string();
    };
    torch::manual_seed(0);
    torch::nn::Linear model(4, 3);
    auto optimizer = c.second(model->parameters());
    colossalai::booster::Booster booster;
    auto boosted = booster.boost(model.ptr(), optimizer);
    auto step = [&] {
      optimizer->zero_grad();
      (model(x) - y).pow(2).mean().backward();
      optimizer->step();
    };
    step();
    step();
    booster.save_model(boosted.model, file("model"));
    booster.save_optimizer(*boosted.optimizer, file("optim"));
    step();
    booster.save_model(boosted.model, file("after"));
  }
  {
    torch::manual_seed(0);
    torch::nn::Linear model(4, 3);
    auto optimizer = std::make_shared<colossalai::nn::optimizer::HybridAdam>(
        model->parameters(),
        colossalai::nn::optimizer::HybridAdamOptions(1e-2).weight_decay(0.05));
    colossalai::booster::Booster booster;
    auto boosted = booster.boost(model.ptr(), optimizer);
    for (int s = 0; s < 2; ++s) {
      optimizer->zero_grad();
      (model(x) - y).pow(2).mean().backward();
      optimizer->step();
    }
    booster.save_optimizer(
        *boosted.optimizer, (dir / "optim_hybrid_adam.bin").string());
  }
  const auto result = colossalai::testing::run_shell(
      std::string(kPython) + " " + quote(script_path().string()) + " groups " +
      quote(dir.string()));
  ASSERT_EQ(result.first, 0) << "interop.py groups failed:\n" << result.second;
}

// Hugging Face-layout checkpoints written by Python (names and shapes of
// transformers' GPT2LMHeadModel and LlamaForCausalLM) load into the zoo's
// models unchanged and give the logits of a plain PyTorch implementation
// of the same configs (tests/python/hf_reference.py). Bound: both sides run
// the same fp32 operations on O(1) activations; BLAS summation orders differ
// by a few ulps per dot product of 32-128 terms, through 2 blocks, so 1e-4
// on O(1) logits leaves two orders of magnitude.
TEST(InteropPython, HuggingFaceLayoutCheckpointsGiveTheReferenceLogits) {
  if (!python_has_torch()) {
    GTEST_SKIP() << "Python torch absent: install python3-torch";
  }
  const fs::path script =
      fs::path(__FILE__).parent_path() / "python" / "hf_reference.py";
  ScratchDir scratch;
  const fs::path dir = scratch.path;
  const auto result = colossalai::testing::run_shell(
      std::string(kPython) + " " + quote(script.string()) + " " +
      quote(dir.string()));
  ASSERT_EQ(result.first, 0) << "hf_reference.py failed:\n" << result.second;
  const auto ids = st::MappedFile::open((dir / "ids.safetensors").string())
                       ->tensors()["ids"];
  const StateDict logits =
      st::MappedFile::open((dir / "logits.safetensors").string())->tensors();
  colossalai::checkpoint_io::GeneralCheckpointIO io;
  auto check = [&](std::shared_ptr<torch::nn::Module> module,
                   const std::function<at::Tensor()>& forward,
                   const std::string& name) {
    colossalai::interface::ModelWrapper wrapped(module);
    io.load_model(wrapped, (dir / (name + ".safetensors")).string());
    torch::NoGradGuard no_grad;
    const auto got = forward();
    const auto& want = logits[name];
    ASSERT_EQ(got.sizes(), want.sizes()) << name;
    EXPECT_LE((got - want).abs().max().item<double>(), 1e-4) << name;
  };
  models::GPT2LMHeadModel gpt2(models::GPT2Config::tiny_test());
  check(
      gpt2.ptr(), [&] { return gpt2->forward(ids); }, "gpt2");
  models::LlamaForCausalLM llama(models::LlamaConfig::tiny_test());
  check(
      llama.ptr(), [&] { return llama->forward(ids); }, "llama");
}

namespace sched = colossalai::nn::lr_scheduler;

/// torch's own classes with the same options as SCHEDULERS in interop.py.
/// Left out: LinearWarmupLR and PolynomialLR are ColossalAI's own (torch's
/// PolynomialLR has another formula: no end_lr, total_iters), and the
/// two-stage schedulers are ColossalAI classes torch does not have.
std::vector<SchedulerCase> scheduler_cases() {
  using Opt = torch::optim::Optimizer;
  return {
      {"StepLR",
       [](Opt& o) {
         return std::make_unique<sched::StepLR>(
             o, sched::StepLROptions(50).step_size(3).gamma(0.5));
       },
       8},
      {"MultiStepLR",
       [](Opt& o) {
         return std::make_unique<sched::MultiStepLR>(
             o,
             sched::MultiStepLROptions(50)
                 .milestones({3, 8, 8, 12})
                 .gamma(0.5));
       },
       7},
      {"ExponentialLR",
       [](Opt& o) {
         return std::make_unique<sched::ExponentialLR>(
             o, sched::ExponentialLROptions(50).gamma(0.9));
       },
       5},
      {"CosineAnnealingLR",
       [](Opt& o) {
         return std::make_unique<sched::CosineAnnealingLR>(
             o, sched::CosineAnnealingLROptions(20).eta_min(0.001));
       },
       6},
      {"OneCycleLR",
       [](Opt& o) {
         return std::make_unique<sched::OneCycleLR>(
             o, sched::OneCycleLROptions(20));
       },
       6},
      {"LambdaLR",
       [](Opt& o) {
         return std::make_unique<sched::LambdaLR>(
             o, sched::LambdaLROptions(50, [](int64_t e) {
               return std::pow(0.97, static_cast<double>(e));
             }));
       },
       5},
      {"MultiplicativeLR",
       [](Opt& o) {
         return std::make_unique<sched::MultiplicativeLR>(
             o, sched::MultiplicativeLROptions(50, [](int64_t e) {
               return 0.9 + 0.002 * static_cast<double>(e);
             }));
       },
       5},
  };
}

// Scheduler files cross both ways: Python's torch scheduler loads what the
// booster saved (torch.load, with weights_only=True from torch 2.4: 1.13's
// restricted unpickler takes no floats) and its next step equals ours; we
// load what torch.save(scheduler.state_dict()) wrote (MultiStepLR's
// milestones are a collections.Counter there) and our next step equals
// Python's.
TEST(InteropPython, LRSchedulerFilesCrossBothWays) {
  if (!python_has_torch()) {
    GTEST_SKIP() << "Python torch absent: install python3-torch";
  }
  ScratchDir scratch;
  const auto dir = scratch.path;
  colossalai::booster::Booster booster;
  std::map<std::string, std::vector<double>> ours;
  for (const auto& c : scheduler_cases()) {
    auto optimizer = sched_optimizer();
    auto scheduler = c.make(*optimizer);
    for (int64_t i = 0; i < c.steps; ++i) {
      scheduler->step();
    }
    booster.save_lr_scheduler(
        *scheduler, (dir / ("cpp_" + c.name + ".pt")).string());
    scheduler->step();
    ours[c.name] = lrs_and_momenta(*optimizer, *scheduler);
  }
  const auto result = colossalai::testing::run_shell(
      std::string(kPython) + " " + quote(script_path().string()) + " sched " +
      quote(dir.string()));
  ASSERT_EQ(result.first, 0) << "interop.py sched failed:\n" << result.second;

  const StateDict from_ours =
      colossalai::checkpoint_io::load_bin((dir / "from_cpp_next.bin").string());
  const StateDict pythons =
      colossalai::checkpoint_io::load_bin((dir / "py_next.bin").string());
  for (const auto& c : scheduler_cases()) {
    SCOPED_TRACE(c.name);
    {
      SCOPED_TRACE("Python's step after loading our file");
      expect_values(from_ours.find(c.name), ours[c.name], "Python");
    }
    auto optimizer = sched_optimizer();
    auto scheduler = c.make(*optimizer);
    booster.load_lr_scheduler(
        *scheduler, (dir / ("py_" + c.name + ".pt")).string());
    EXPECT_EQ(scheduler->last_epoch(), c.steps);
    scheduler->step();
    SCOPED_TRACE("our step after loading Python's file");
    expect_values(
        pythons.find(c.name),
        lrs_and_momenta(*optimizer, *scheduler),
        "Python");
  }
}

} // namespace
