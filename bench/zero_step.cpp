// Step time and model-state memory of DDP, ZeRO-1 and ZeRO-2 on
// gpt-small-cpu, 2 ranks x 1 thread, fp32 AdamW. The three setups live in
// the same processes and their timed rounds alternate, so the ratios compare
// like with like on a noisy machine. Model-state bytes are counted per rank
// from the tensors each setup holds, beside the ZeRO formulas.
//
//   bench_zero_step [--nproc 2] [--steps 4] [--rounds 3] [--out FILE.json]

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

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2]
                      : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

struct Setup {
  std::string name;
  cb::Booster booster;
  colossalai::zoo::GPT model;
  cb::Boosted<colossalai::zoo::GPT, std::nullptr_t, std::nullptr_t> boosted;
};

int64_t tensor_bytes(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (const auto& t : ts) {
    if (t.defined())
      n += t.numel() * t.element_size();
  }
  return n;
}

int run_rank(int steps, int rounds, const std::string& out) {
  colossalai::launch_from_env();
  at::set_num_threads(1);
  const int rank = cd::get_rank(), world = cd::get_world_size();
  auto cfg = colossalai::zoo::GPTConfig::small_cpu();
  auto batch = colossalai::zoo::random_tokens(8, cfg, 100 + rank);

  auto make = [&](const std::string& name) {
    std::shared_ptr<cb::plugin::Plugin> plugin;
    if (name == "ddp") {
      plugin = std::make_shared<cb::plugin::TorchDDPPlugin>();
    } else {
      plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
          cb::plugin::LowLevelZeroPluginOptions()
              .stage(name == "zero1" ? 1 : 2)
              .precision("fp32"));
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
  for (auto name : {"ddp", "zero1", "zero2"}) {
    setups.push_back(make(name));
  }
  auto step = [&](Setup& s) {
    auto t0 = std::chrono::steady_clock::now();
    s.boosted.optimizer->zero_grad();
    auto loss =
        colossalai::zoo::gpt_loss(s.boosted.model(batch.first), batch.second);
    s.booster.backward(loss, *s.boosted.optimizer);
    s.boosted.optimizer->step();
    return std::chrono::duration<double, std::milli>(
               std::chrono::steady_clock::now() - t0)
        .count();
  };
  std::map<std::string, std::vector<double>> times;
  for (auto& s : setups)
    step(*s); // warm up, creates optimizer states
  for (int r = 0; r < rounds; ++r) {
    for (auto& s : setups) {
      cd::barrier(*cd::world_group()).wait();
      for (int i = 0; i < steps; ++i)
        times[s->name].push_back(step(*s));
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
  for (size_t i = 1; i < setups.size(); ++i) {
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
  // full gradients.
  const double n = world;
  std::map<std::string, double> formula = {
      {"ddp", 16.0 * psi},
      {"zero1", (8.0 + 8.0 / n) * psi},
      {"zero2", (4.0 + 12.0 / n) * psi}};
  std::map<std::string, double> layout = {
      {"ddp", 16.0 * psi},
      {"zero1", (4.0 + 12.0 / n) * psi},
      {"zero2", (4.0 + 12.0 / n) * psi}};
  if (rank != 0)
    return 0;
  std::ostringstream json;
  json << "{\n  \"benchmark\": \"zero_step\",\n  \"model\": \"gpt-small-cpu\","
       << "\n  \"parameters\": " << psi << ",\n  \"world_size\": " << world
       << ",\n  \"setups\": {";
  std::printf(
      "| setup | step ms (median) | vs DDP | model-state MB/rank | "
      "ZeRO formula MB | our layout MB |\n|---|---|---|---|---|---|\n");
  const double ddp_ms = median(times["ddp"]);
  for (size_t i = 0; i < setups.size(); ++i) {
    const auto& name = setups[i]->name;
    double ms = median(times[name]);
    json << (i ? "," : "") << "\n    \"" << name << "\": {\"step_ms\": " << ms
         << ", \"vs_ddp\": " << ms / ddp_ms
         << ", \"model_state_bytes\": " << measured[name]
         << ", \"formula_bytes\": " << formula[name]
         << ", \"layout_bytes\": " << layout[name] << "}";
    std::printf(
        "| %s | %.1f | %.2fx | %.1f | %.1f | %.1f |\n",
        name.c_str(),
        ms,
        ms / ddp_ms,
        measured[name] / 1e6,
        formula[name] / 1e6,
        layout[name] / 1e6);
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
  std::string out;
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
    else {
      std::cerr << "unknown option " << k << "\n";
      return 2;
    }
  }
  try {
    if (!colossalai::launcher::launched_by_launcher()) {
      return colossalai::launcher::run_self(nproc, argc, argv);
    }
    return run_rank(steps, rounds, out);
  } catch (const std::exception& e) {
    std::cerr << "error: " << cd::error_text(e) << std::endl;
    return 1;
  }
}
