// Step time and model-state memory of DDP, ZeRO-1, ZeRO-2, FSDP
// (FULL_SHARD, one unit per transformer block, with and without backward
// prefetch) and Gemini (1 Mi-element chunks, prefetch on) on gpt-small-cpu, 2
// ranks x 1 thread, fp32 AdamW. The setups live in the same processes and their
// timed rounds alternate, so the ratios compare like with like on a noisy
// machine. Beside them, every rank trains a plain copy of the model at the
// same time with no communication at all: the floor each setup's
// communication is measured against (what no_sync gives DDP, for stages
// that have no no_sync), and the same plain steps ending in a barrier: the
// lockstep floor, which also pays what every synchronous step does, the
// wait for the slower rank. Model-state bytes are counted per rank from the
// tensors each setup holds, beside the ZeRO formulas; FSDP also reports its
// peak during a step.
//
//   bench_zero_step [--nproc 2] [--steps 4] [--rounds 3]
//                   [--setups ddp,zero1,zero2,zero1_overlap_ag,
//                             zero2_overlap_ag,zero1_fp8,zero2_fp8,fsdp,
//                             fsdp_noprefetch,fsdp_fp8,gemini,
//                             gemini_auto,gemini_fp8]
//                   [--zero-bucket-m 12] [--out FILE.json]

#include "bench_launch.h"
#include "bench_util.h"

#include <colossalai/colossalai.h>

#include <zoo/gpt.h>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

namespace cb = colossalai::booster;
namespace cd = colossalai::distributed;

namespace {

struct Setup {
  std::string name;
  cb::Booster booster;
  colossalai::zoo::GPT model;
  cb::Boosted<colossalai::zoo::GPT, std::nullptr_t, std::nullptr_t> boosted;
};

using colossalai::bench::median;
using colossalai::bench::stats_json;
using colossalai::bench::tensor_bytes;

using colossalai::bench::split;

colossalai::zero::FullyShardedModel* fsdp_of(Setup& s) {
  return colossalai::interface::find_wrapper<
      colossalai::zero::FullyShardedModel>(*s.boosted.model.wrapper());
}

int run_rank(
    int steps,
    int rounds,
    double bucket_m,
    const std::string& names,
    const std::string& out) {
  colossalai::launch_from_env();
  at::set_num_threads(1);
  const int rank = cd::get_rank(), world = cd::get_world_size();
  auto cfg = colossalai::zoo::GPTConfig::small_cpu();
  auto batch = colossalai::zoo::random_tokens(8, cfg, 100 + rank);

  auto make = [&](const std::string& name) {
    std::shared_ptr<cb::plugin::Plugin> plugin;
    if (name == "ddp") {
      plugin = std::make_shared<cb::plugin::TorchDDPPlugin>();
    } else if (
        name == "fsdp" || name == "fsdp_noprefetch" || name == "fsdp_fp8") {
      // _fp8: fp8_communication, gathers and reduce-scatters through FP8
      // where the ranks span nodes.
      namespace cz = colossalai::zero;
      plugin = std::make_shared<cb::plugin::TorchFSDPPlugin>(
          cb::plugin::TorchFSDPPluginOptions()
              .auto_wrap_policy(
                  cz::module_type_wrap_policy<colossalai::zoo::BlockImpl>())
              .backward_prefetch(
                  name == "fsdp_noprefetch"
                      ? cz::BackwardPrefetch::kNone
                      : cz::BackwardPrefetch::kBackwardPre)
              .fp8_communication(name == "fsdp_fp8"));
    } else if (
        name == "gemini" || name == "gemini_auto" || name == "gemini_fp8") {
      // gpt-small-cpu is below the default min_chunk_size_m (32 Mi
      // elements, where it would be one gathered chunk): 1 Mi-element
      // chunks on the hidden-dim interval make it ~6 sharded chunks. Auto
      // placement has no device budget here: every fp32 shard, gradient and
      // optimizer state in the host tier, every parameter shard cached.
      plugin = std::make_shared<cb::plugin::GeminiPlugin>(
          cb::plugin::GeminiPluginOptions()
              .precision("fp32")
              .min_chunk_size_m(1)
              .search_range_m(1)
              .hidden_dim(cfg.n_embd())
              .max_prefetch(1)
              .placement_policy(name == "gemini_auto" ? "auto" : "static")
              .fp8_communication(name == "gemini_fp8"));
    } else if (
        name == "zero1" || name == "zero2" || name == "zero1_overlap_ag" ||
        name == "zero2_overlap_ag" || name == "zero1_fp8" ||
        name == "zero2_fp8") {
      // _overlap_ag: overlap_allgather, the step's all-gathers waited for
      // block by block in the next forward. _fp8: fp8_communication, the
      // all-gathers and reduce-scatters through FP8 where the ranks span
      // nodes (float32 weights then keep masters of their own).
      plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
          cb::plugin::LowLevelZeroPluginOptions()
              .stage(name.rfind("zero1", 0) == 0 ? 1 : 2)
              .precision("fp32")
              .reduce_bucket_size_in_m(bucket_m)
              .overlap_allgather(name.find("_overlap_ag") != name.npos)
              .fp8_communication(name.find("_fp8") != name.npos));
    } else {
      TORCH_CHECK(false, "unknown setup '", name, "'");
    }
    torch::manual_seed(0);
    auto s = std::make_unique<Setup>(Setup{
        name,
        cb::Booster(cb::BoosterOptions().plugin(plugin)),
        colossalai::zoo::GPT(cfg),
        {}});
    auto opt = std::make_shared<torch::optim::AdamW>(
        s->model->parameters(),
        torch::optim::AdamWOptions(3e-4).weight_decay(0.01));
    s->boosted = s->booster.boost(s->model, opt);
    return s;
  };
  std::vector<std::unique_ptr<Setup>> setups;
  for (const auto& name : split(names)) {
    setups.push_back(make(name));
  }
  TORCH_CHECK(
      !setups.empty() && setups[0]->name == "ddp",
      "--setups must start with ddp (the baseline of every ratio)");
  // `last`: the last timed step of a round also waits for what its step
  // left in flight (overlap_allgather's all-gathers), which the next step
  // would otherwise find done.
  auto step = [&](Setup& s, bool last = false) {
    auto t0 = std::chrono::steady_clock::now();
    s.boosted.optimizer->zero_grad();
    auto loss =
        colossalai::zoo::gpt_loss(s.boosted.model(batch.first), batch.second);
    s.booster.backward(loss, *s.boosted.optimizer);
    s.boosted.optimizer->step();
    if (last) {
      s.boosted.model.wrapper()->synchronize_weights();
    }
    return std::chrono::duration<double, std::milli>(
               std::chrono::steady_clock::now() - t0)
        .count();
  };
  torch::manual_seed(0);
  colossalai::zoo::GPT plain(cfg);
  torch::optim::AdamW plain_opt(
      plain->parameters(), torch::optim::AdamWOptions(3e-4).weight_decay(0.01));
  auto floor_step = [&] {
    auto t0 = std::chrono::steady_clock::now();
    plain_opt.zero_grad();
    colossalai::zoo::gpt_loss(plain(batch.first), batch.second).backward();
    plain_opt.step();
    return std::chrono::duration<double, std::milli>(
               std::chrono::steady_clock::now() - t0)
        .count();
  };
  std::map<std::string, std::vector<double>> times;
  std::map<std::string, int64_t> bytes; // handed to collectives, timed steps
  floor_step();
  for (auto& s : setups)
    step(*s); // warm up, creates optimizer states
  for (auto& s : setups) {
    if (auto* f = fsdp_of(*s))
      f->reset_peak_memory_stats();
  }
  for (int r = 0; r < rounds; ++r) {
    for (auto& s : setups) {
      cd::barrier(*cd::world_group()).wait();
      const int64_t b0 = cd::bytes_communicated();
      for (int i = 0; i < steps; ++i)
        times[s->name].push_back(step(*s, i == steps - 1));
      bytes[s->name] += cd::bytes_communicated() - b0;
    }
    cd::barrier(*cd::world_group()).wait();
    for (int i = 0; i < steps; ++i)
      times["floor"].push_back(floor_step());
    cd::barrier(*cd::world_group()).wait();
    for (int i = 0; i < steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      floor_step();
      cd::barrier(*cd::world_group()).wait();
      times["lockstep"].push_back(std::chrono::duration<double, std::milli>(
                                      std::chrono::steady_clock::now() - t0)
                                      .count());
    }
    if (rank == 0)
      std::fprintf(stderr, "round %d/%d done\n", r + 1, rounds);
  }

  // Model-state bytes held per rank at rest (after a step).
  const int64_t psi = cfg.num_parameters();
  std::map<std::string, int64_t> measured;
  {
    auto& d = *setups[0];
    int64_t states = 0;
    for (auto& kv : d.boosted.optimizer->unwrap().state()) {
      auto* a = dynamic_cast<torch::optim::AdamWParamState*>(kv.second.get());
      states += tensor_bytes({a->exp_avg(), a->exp_avg_sq()});
    }
    std::vector<at::Tensor> grads;
    for (auto& p : d.model->parameters())
      grads.push_back(p.grad());
    measured["ddp"] =
        tensor_bytes(d.model->parameters()) + tensor_bytes(grads) + states;
  }
  std::map<std::string, int64_t> peak;
  int64_t largest_unit = 0;
  std::vector<int64_t> unit_numels;
  for (size_t i = 1; i < setups.size(); ++i) {
    if (auto* f = fsdp_of(*setups[i])) {
      measured[setups[i]->name] = f->memory_stats().total();
      peak[setups[i]->name] = f->peak_memory_stats().total();
      unit_numels = f->unit_numels();
      for (auto n : unit_numels)
        largest_unit = std::max(largest_unit, n);
      continue;
    }
    auto* z = dynamic_cast<colossalai::zero::LowLevelZeroOptimizer*>(
        setups[i]->boosted.optimizer.get());
    auto st = z->memory_stats();
    measured[setups[i]->name] = st.working_params + st.gradients +
        st.master_weights + st.optimizer_states;
  }
  // fp32 formulas (shared/NOTES.md): DDP (4+4+8)Psi, ZeRO-1 (4+4+8/N)Psi,
  // ZeRO-2 (4+(4+8)/N)Psi. Our layout at rest, both stages: working
  // parameters 4Psi plus fp32 slices of gradients and the two moments
  // (4+8)Psi/N (in fp32 the master slice is the weights' own storage);
  // stage 1 also reduces through buckets into slices rather than keeping
  // full gradients. ZeRO-3 / FSDP: 16 Psi / N at rest, plus the units in
  // flight during a step (reported as the peak).
  const double n = world;
  std::map<std::string, double> formula = {
      {"ddp", 16.0 * psi},
      {"zero1", (8.0 + 8.0 / n) * psi},
      {"zero2", (4.0 + 12.0 / n) * psi},
      {"zero1_overlap_ag", (8.0 + 8.0 / n) * psi},
      {"zero2_overlap_ag", (4.0 + 12.0 / n) * psi},
      {"zero1_fp8", (8.0 + 12.0 / n) * psi},
      {"zero2_fp8", (4.0 + 16.0 / n) * psi},
      {"fsdp", 16.0 / n * psi},
      {"fsdp_noprefetch", 16.0 / n * psi},
      {"fsdp_fp8", 16.0 / n * psi},
      {"gemini", 16.0 / n * psi},
      {"gemini_auto", 16.0 / n * psi},
      {"gemini_fp8", 16.0 / n * psi}};
  std::map<std::string, double> layout = {
      {"ddp", 16.0 * psi},
      {"zero1", (4.0 + 12.0 / n) * psi},
      {"zero2", (4.0 + 12.0 / n) * psi},
      {"zero1_overlap_ag", (4.0 + 12.0 / n) * psi},
      {"zero2_overlap_ag", (4.0 + 12.0 / n) * psi},
      {"zero1_fp8", (4.0 + 16.0 / n) * psi},
      {"zero2_fp8", (4.0 + 16.0 / n) * psi},
      {"fsdp", 16.0 / n * psi},
      {"fsdp_noprefetch", 16.0 / n * psi},
      {"fsdp_fp8", 16.0 / n * psi},
      {"gemini", 16.0 / n * psi},
      {"gemini_auto", 20.0 / n * psi}, // + cached parameter shards
      {"gemini_fp8", 16.0 / n * psi}};
  if (rank != 0)
    return 0;
  std::ostringstream json;
  json << "{\n  \"benchmark\": \"zero_step\",\n  \"model\": \"gpt-small-cpu\","
       << "\n  \"parameters\": " << psi << ",\n  \"world_size\": " << world
       << ",\n  \"zero_bucket_m\": " << bucket_m
       << ",\n  \"floor_ms\": " << median(times["floor"])
       << ",\n  \"lockstep_floor_ms\": " << median(times["lockstep"])
       << ",\n  \"largest_unit_parameters\": " << largest_unit
       << ",\n  \"fsdp_unit_parameters\": [";
  for (size_t i = 0; i < unit_numels.size(); ++i)
    json << (i ? ", " : "") << unit_numels[i];
  json << "]"
       << ",\n  \"setups\": {";
  std::printf(
      "| setup | step ms (median) | vs DDP | vs no-comm floor | vs lockstep "
      "floor | model-state MB/rank | ZeRO formula MB | our layout MB | "
      "peak in step MB |\n|---|---|---|---|---|---|---|---|---|\n");
  const double ddp_ms = median(times["ddp"]);
  const double floor_ms = median(times["floor"]);
  const double lockstep_ms = median(times["lockstep"]);
  for (size_t i = 0; i < setups.size(); ++i) {
    const auto& name = setups[i]->name;
    double ms = median(times[name]);
    json << (i ? "," : "") << "\n    \"" << name << "\": {\"step_ms\": " << ms
         << ", \"step_ms_spread\": " << stats_json(times[name])
         << ", \"vs_ddp\": " << ms / ddp_ms
         << ", \"vs_floor\": " << ms / floor_ms
         << ", \"vs_lockstep_floor\": " << ms / lockstep_ms
         << ", \"model_state_bytes\": " << measured[name]
         << ", \"formula_bytes\": " << formula[name]
         << ", \"layout_bytes\": " << layout[name];
    if (peak.count(name))
      json << ", \"peak_model_state_bytes\": " << peak[name];
    json << ", \"bytes_communicated_per_step\": "
         << bytes[name] / std::max<size_t>(1, times[name].size());
    json << ", \"vs_ddp_memory\": "
         << static_cast<double>(measured[name]) / measured["ddp"] << "}";
    std::printf(
        "| %s | %.1f | %.2fx | %.2fx | %.2fx | %.1f | %.1f | %.1f | %s |\n",
        name.c_str(),
        ms,
        ms / ddp_ms,
        ms / floor_ms,
        ms / lockstep_ms,
        measured[name] / 1e6,
        formula[name] / 1e6,
        layout[name] / 1e6,
        peak.count(name) ? std::to_string(peak[name] / 1000000).c_str() : "-");
  }
  json << "\n  }\n}\n";
  std::cout << json.str();
  if (!out.empty())
    std::ofstream(out) << json.str();
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  int nproc = 2, steps = 4, rounds = 3;
  double bucket_m = 12; // ColossalAI's reduce_bucket_size_in_m
  std::string out, names = "ddp,zero1,zero2,fsdp,fsdp_noprefetch,gemini";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--nproc")
      nproc = std::stoi(v);
    else if (k == "--steps")
      steps = std::stoi(v);
    else if (k == "--rounds")
      rounds = std::stoi(v);
    else if (k == "--out")
      out = v;
    else if (k == "--setups")
      names = v;
    else if (k == "--zero-bucket-m")
      bucket_m = std::stod(v);
    else {
      std::cerr << "unknown option " << k << "\n";
      return 2;
    }
  }
  return colossalai::bench::launch_ranks(nproc, argc, argv, [&] {
    return run_rank(steps, rounds, bucket_m, names, out);
  });
}
