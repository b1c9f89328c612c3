// LoRA vs full fine-tuning, one process, 1 thread: step time (forward,
// backward, AdamW step), trainable parameters, gradient and optimizer-state
// bytes, on gpt-small-cpu (torch::nn::Linear: LoRA by weight
// reparametrisation) and a GPT-2 of the same width (colossalai's Linear1D
// layers: LoRA's own adapter path). NOTE [LoRA in C++] says why they differ.
//
// bench_lora_step [--rounds R] [--steps S] [--warmup W] [--r RANK]
//                 [--out FILE.json]

#include <colossalai/booster/booster.h>
#include <colossalai/lora/lora_model.h>
#include <colossalai/models/gpt2.h>
#include <zoo/gpt.h>

#include "bench_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/optim/adamw.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>

namespace {

namespace cb = colossalai::booster;
namespace cl = colossalai::lora;
namespace zoo = colossalai::zoo;
namespace models = colossalai::models;
using colossalai::bench::stats_json;
using colossalai::bench::tensor_bytes;

constexpr int64_t kBatch = 8, kSeq = 128, kVocab = 4096;

// One setup: a boosted model and its optimizer, stepping on fixed tokens.
struct Setup {
  std::string name, model, mode;
  std::function<void()> step;
  std::function<std::vector<at::Tensor>()> grads, states;
  int64_t trainable = 0, total = 0;
  std::vector<double> ms;
};

template <class M, class Loss>
Setup make(
    const std::string& model_name,
    M model,
    bool lora,
    const cl::LoraConfig& config,
    Loss loss) {
  Setup s;
  s.model = model_name;
  s.mode = lora ? "LoRA r " + std::to_string(config.r()) : "full";
  s.name = model_name + ", " + s.mode;
  auto booster = std::make_shared<cb::Booster>();
  if (lora) {
    booster->enable_lora(model, "", config);
  }
  for (const auto& p : model->parameters()) {
    s.total += p.numel();
    s.trainable += p.requires_grad() ? p.numel() : 0;
  }
  auto opt = std::make_shared<torch::optim::AdamW>(
      model->parameters(), torch::optim::AdamWOptions(3e-4).weight_decay(0.01));
  auto boosted = std::make_shared<decltype(booster->boost(model, opt))>(
      booster->boost(model, opt));
  auto gen = at::detail::createCPUGenerator(7);
  auto tokens = at::randint(kVocab, {kBatch, kSeq + 1}, gen);
  auto x = tokens.narrow(1, 0, kSeq).contiguous();
  auto y = tokens.narrow(1, 1, kSeq).contiguous();
  s.step = [booster, boosted, model, x, y, loss]() mutable {
    boosted->optimizer->zero_grad();
    booster->backward(loss(model, boosted->model(x), y), *boosted->optimizer);
    boosted->optimizer->step();
  };
  s.grads = [model]() {
    std::vector<at::Tensor> g;
    for (const auto& p : model->parameters()) {
      g.push_back(p.grad());
    }
    return g;
  };
  s.states = [opt]() {
    std::vector<at::Tensor> out;
    for (const auto& kv : opt->state()) {
      const auto& st =
          static_cast<const torch::optim::AdamWParamState&>(*kv.second);
      out.push_back(st.exp_avg());
      out.push_back(st.exp_avg_sq());
    }
    return out;
  };
  return s;
}

} // namespace

int main(int argc, char** argv) {
  int rounds = 3, steps = 3, warmup = 1;
  int64_t rank = 8;
  std::string out;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--rounds") {
      rounds = std::stoi(v);
    } else if (k == "--steps") {
      steps = std::stoi(v);
    } else if (k == "--warmup") {
      warmup = std::stoi(v);
    } else if (k == "--r") {
      rank = std::stoll(v);
    } else if (k == "--out") {
      out = v;
    } else {
      std::cerr << "unknown option " << k << "\n";
      return 2;
    }
  }
  at::set_num_threads(1);
  auto gpt_loss = [](auto&, const at::Tensor& logits, const at::Tensor& y) {
    return at::cross_entropy_loss(
        logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
  };
  auto gpt2_loss = [](auto& m, const at::Tensor& logits, const at::Tensor& y) {
    return m->loss(logits, y);
  };
  // The attention and MLP projections, as LoRA recipes adapt them.
  const auto gpt_lora = cl::LoraConfig()
                            .r(rank)
                            .lora_alpha(2.0 * rank)
                            .target_modules({"qkv", "proj", "fc", "out"});
  const auto gpt2_lora = cl::LoraConfig()
                             .r(rank)
                             .lora_alpha(2.0 * rank)
                             .target_modules({"c_attn", "c_proj", "c_fc"});
  std::vector<Setup> setups;
  for (const bool lora : {false, true}) {
    torch::manual_seed(1);
    setups.push_back(make(
        "gpt-small-cpu",
        zoo::GPT(zoo::GPTConfig::small_cpu()),
        lora,
        gpt_lora,
        gpt_loss));
  }
  for (const bool lora : {false, true}) {
    torch::manual_seed(1);
    setups.push_back(make(
        "GPT-2 (width 256, 4 blocks)",
        models::GPT2LMHeadModel(models::GPT2Config::small_cpu()),
        lora,
        gpt2_lora,
        gpt2_loss));
  }
  for (auto& s : setups) {
    for (int i = 0; i < warmup; ++i) {
      s.step();
    }
  }
  // Setups alternate, so drift in the machine's speed hits all alike.
  for (int r = 0; r < rounds; ++r) {
    for (auto& s : setups) {
      for (int i = 0; i < steps; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        s.step();
        s.ms.push_back(std::chrono::duration<double, std::milli>(
                           std::chrono::steady_clock::now() - t0)
                           .count());
      }
    }
    std::fprintf(stderr, "[lora_step] round %d/%d done\n", r + 1, rounds);
  }
  std::ostringstream js;
  js << "{\n  \"batch\": " << kBatch << ", \"seq\": " << kSeq
     << ", \"r\": " << rank << ", \"rounds\": " << rounds
     << ", \"steps\": " << steps << ", \"warmup\": " << warmup
     << ",\n  \"setups\": [\n";
  for (size_t i = 0; i < setups.size(); ++i) {
    auto& s = setups[i];
    js << "    {\"name\": \"" << s.name << "\", \"model\": \"" << s.model
       << "\", \"mode\": \"" << s.mode << "\", \"params\": " << s.total
       << ", \"trainable\": " << s.trainable
       << ", \"grad_bytes\": " << tensor_bytes(s.grads())
       << ", \"optimizer_state_bytes\": " << tensor_bytes(s.states())
       << ", \"step_ms\": " << stats_json(s.ms) << "}"
       << (i + 1 < setups.size() ? "," : "") << "\n";
    std::printf(
        "%-40s trainable %9lld  grads %6.1f MB  states %6.1f MB  step %.0f ms\n",
        s.name.c_str(),
        static_cast<long long>(s.trainable),
        tensor_bytes(s.grads()) / 1e6,
        tensor_bytes(s.states()) / 1e6,
        colossalai::bench::median(s.ms));
  }
  js << "  ]\n}\n";
  if (!out.empty()) {
    std::ofstream(out) << js.str();
  }
  return 0;
}
