// The largest GPT one process can train under a fixed device budget:
// Gemini with auto placement (the budget enforced), Gemini with static
// placement (fp32 shards, gradients and optimizer states on the host,
// parameter shards on the device), FSDP with CPU offload (a unit per block)
// and ZeRO-2 with CPU offload. The width is gpt-small-cpu's (256, vocab
// 4096) and the depth grows; fp32, HybridAdam, one sequence of 32 tokens.
//
// On a CPU-only build the "device" is host memory, so its use is measured
// as the C heap's peak in use during a step (sampled every 100 us by a
// thread) minus the host tier at rest (the fp32 shards, gradient shards and
// optimizer states each setup offloads) minus what was in use before the
// model was built. A setup "fits" when that peak is within the budget (and,
// for auto placement, the run finished: it refuses a budget it cannot
// keep). Gemini and FSDP also report their own accounting (the device tier
// at their decision points) and the bytes moved between the tiers in the
// last step. Step times are not reported: the sampling thread competes with
// the step (step time at 2 ranks is bench_zero_step's).
//
//   bench_gemini_budget [--budget-mb 64] [--layers 2,4,8,16,32,64]
//                       [--setups
//                       gemini_auto,gemini_static,fsdp_offload,zero2_offload]
//                       [--steps 3] [--out FILE.json]

#include "bench_util.h"

#include <colossalai/colossalai.h>
#include <colossalai/nn/optimizer/hybrid_adam.h>
#include <colossalai/utils/compat.h>

#include <zoo/gpt.h>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

namespace cb = colossalai::booster;
namespace cz = colossalai::zero;

namespace {

using colossalai::bench::split;

int64_t heap_in_use() {
  return colossalai::compat::memory_allocated(at::kCPU);
}

struct Result {
  bool ran = false;
  std::string error;
  int64_t parameters = 0;
  int64_t device_peak = 0; // measured
  int64_t host_tier = 0;   // at rest
  int64_t own_peak = -1;   // the engine's accounting (-1: none)
  int64_t h2d_per_step = -1;
  int64_t d2h_per_step = -1;
  int64_t evictions = -1;
};

colossalai::zoo::GPTConfig config(int layers) {
  return colossalai::zoo::GPTConfig().block_size(32).n_layer(layers);
}

Result run(const std::string& name, int layers, int64_t budget, int steps) {
  Result r;
  const auto cfg = config(layers);
  r.parameters = cfg.num_parameters();
  const int64_t baseline = heap_in_use();
  std::shared_ptr<cb::plugin::Plugin> plugin;
  using GO = cb::plugin::GeminiPluginOptions;
  // Chunks of 1 Mi elements (the embedding, the largest parameter, on the
  // hidden-dim interval; no wider search), about one block each.
  auto gemini =
      GO().precision("fp32").min_chunk_size_m(1).search_range_m(0).hidden_dim(
          cfg.n_embd());
  if (name == "gemini_auto") {
    // 70% of the budget for model data in the warm-up step (ColossalAI's
    // default keeps 80% for activations: too little for a block's 4 MB
    // chunks, their gradient buffers and the root's chunks here).
    plugin = std::make_shared<cb::plugin::GeminiPlugin>(
        gemini.placement_policy("auto")
            .device_memory_capacity(budget)
            .warmup_non_model_data_ratio(0.3));
  } else if (name == "gemini_static") {
    plugin = std::make_shared<cb::plugin::GeminiPlugin>(
        gemini.offload_optim_frac(1.0));
  } else if (name == "fsdp_offload") {
    plugin = std::make_shared<cb::plugin::TorchFSDPPlugin>(
        cb::plugin::TorchFSDPPluginOptions()
            .auto_wrap_policy(
                cz::module_type_wrap_policy<colossalai::zoo::BlockImpl>())
            .cpu_offload(true));
  } else if (name == "zero2_offload") {
    plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
        cb::plugin::LowLevelZeroPluginOptions()
            .stage(2)
            .precision("fp32")
            .cpu_offload(true));
  } else {
    TORCH_CHECK(false, "unknown setup '", name, "'");
  }
  try {
    torch::manual_seed(0);
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    colossalai::zoo::GPT model(cfg);
    auto boosted = booster.boost(
        model,
        std::make_shared<colossalai::nn::optimizer::HybridAdam>(
            model->parameters(),
            colossalai::nn::optimizer::HybridAdamOptions(3e-4)));
    auto* f = colossalai::interface::find_wrapper<cz::FullyShardedModel>(
        *boosted.model.wrapper());
    auto batch = colossalai::zoo::random_tokens(1, cfg, 7);
    int64_t peak = 0;
    cz::PlacementStats before;
    for (int i = 0; i < steps; ++i) {
      if (f != nullptr && i + 1 == steps) {
        before = f->placement_stats();
        f->reset_peak_memory_stats();
      }
      colossalai::bench::PeakSampler sampler(heap_in_use, std::chrono::microseconds(100));
      boosted.optimizer->zero_grad();
      booster.backward(
          colossalai::zoo::gpt_loss(boosted.model(batch.first), batch.second),
          *boosted.optimizer);
      boosted.optimizer->step();
      peak = std::max(peak, sampler.peak());
    }
    r.ran = true;
    if (f != nullptr) {
      const auto s = f->placement_stats();
      r.host_tier = s.host_model;
      r.own_peak = s.peak_device;
      r.h2d_per_step = s.host_to_device - before.host_to_device;
      r.d2h_per_step = s.device_to_host - before.device_to_host;
      r.evictions = s.evictions - before.evictions;
    } else {
      auto* z =
          dynamic_cast<cz::LowLevelZeroOptimizer*>(boosted.optimizer.get());
      TORCH_CHECK(z != nullptr, "zero2_offload: no LowLevelZeroOptimizer");
      const auto s = z->memory_stats();
      // The fp32 master slices, their gradient slices and the moments.
      const int64_t master =
          s.master_weights > 0 ? s.master_weights : 4 * r.parameters;
      r.host_tier = master + master + s.optimizer_states;
    }
    r.device_peak = peak - baseline - r.host_tier;
  } catch (const std::exception& e) {
    r.error = colossalai::distributed::error_text(e);
    if (r.error.size() > 160) {
      r.error = r.error.substr(0, 160) + "...";
    }
  }
  return r;
}

std::string mb(int64_t b) {
  char s[32];
  std::snprintf(s, sizeof(s), "%.1f", b / 1048576.0);
  return s;
}

} // namespace

int main(int argc, char** argv) {
  int64_t budget_mb = 64;
  int steps = 3;
  std::string out,
      layers = "2,4,8,16,32,64",
      names = "gemini_auto,gemini_static,fsdp_offload,zero2_offload";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--budget-mb")
      budget_mb = std::stoll(v);
    else if (k == "--layers")
      layers = v;
    else if (k == "--setups")
      names = v;
    else if (k == "--steps")
      steps = std::stoi(v);
    else if (k == "--out")
      out = v;
    else {
      std::cerr << "unknown option " << k << "\n";
      return 2;
    }
  }
  try {
    colossalai::launch_from_env(); // one process
    at::set_num_threads(1);
    const int64_t budget = budget_mb << 20;
    std::ostringstream json;
    json << "{\n  \"benchmark\": \"gemini_budget\",\n  \"machine\": "
         << colossalai::bench::machine_json()
         << ",\n  \"budget_bytes\": " << budget << ",\n  \"steps\": " << steps
         << ",\n  \"runs\": [";
    std::printf(
        "| setup | layers | parameters (M) | model states MB | host tier MB | "
        "device peak MB (measured) | own accounting MB | fits %lld MB | "
        "MB host->device / step | MB device->host / step | "
        "evictions / step |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
        static_cast<long long>(budget_mb));
    std::map<std::string, int64_t> largest;
    bool first = true;
    for (const auto& name : split(names)) {
      for (const auto& l : split(layers)) {
        const int n = std::stoi(l);
        std::fprintf(stderr, "%s, %d layers...\n", name.c_str(), n);
        const auto r = run(name, n, budget, steps);
        const bool fits = r.ran && r.device_peak <= budget;
        if (fits) {
          largest[name] = std::max(largest[name], r.parameters);
        }
        auto opt = [](int64_t v) { return v < 0 ? std::string("-") : mb(v); };
        std::printf(
            "| %s | %d | %.1f | %s | %s | %s | %s | %s | %s | %s | %s |\n",
            name.c_str(),
            n,
            r.parameters / 1e6,
            mb(16 * r.parameters).c_str(),
            r.ran ? mb(r.host_tier).c_str() : "-",
            r.ran ? mb(r.device_peak).c_str() : "-",
            opt(r.own_peak).c_str(),
            fits ? "yes" : (r.ran ? "no" : ("refused: " + r.error).c_str()),
            opt(r.h2d_per_step).c_str(),
            opt(r.d2h_per_step).c_str(),
            r.evictions < 0 ? "-" : std::to_string(r.evictions).c_str());
        std::fflush(stdout);
        json << (first ? "" : ",") << "\n    {\"setup\": \"" << name
             << "\", \"layers\": " << n << ", \"parameters\": " << r.parameters
             << ", \"ran\": " << (r.ran ? "true" : "false")
             << ", \"fits\": " << (fits ? "true" : "false")
             << ", \"device_peak_bytes\": " << r.device_peak
             << ", \"own_peak_bytes\": " << r.own_peak
             << ", \"host_tier_bytes\": " << r.host_tier
             << ", \"host_to_device_per_step\": " << r.h2d_per_step
             << ", \"device_to_host_per_step\": " << r.d2h_per_step
             << ", \"evictions_per_step\": " << r.evictions << "}";
        first = false;
        if (!r.ran || r.device_peak > 2 * budget) {
          break; // deeper models only need more
        }
      }
    }
    json << "\n  ],\n  \"largest_fitting_parameters\": {";
    std::printf(
        "\n| setup | largest model within %lld MB |\n|---|---|\n",
        static_cast<long long>(budget_mb));
    first = true;
    for (const auto& name : split(names)) {
      json << (first ? "" : ", ") << "\"" << name << "\": " << largest[name];
      std::printf(
          "| %s | %.1f M parameters |\n", name.c_str(), largest[name] / 1e6);
      first = false;
    }
    json << "}\n}\n";
    if (!out.empty()) {
      std::ofstream(out) << json.str();
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "error: " << colossalai::distributed::error_text(e)
              << std::endl;
    return 1;
  }
}
