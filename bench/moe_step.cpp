// Expert parallelism against plain data parallelism on the same global
// batch: a Mixtral of gpt-small-cpu's size (LlamaConfig::small_cpu with
// 8 experts of width 688 in every layer, top 2), fp32 AdamW, ZeRO-1, 1
// thread per rank, every rank data-parallel. ep1 is HybridParallelPlugin
// (every rank holds every expert); ep2 and ep4 are MoeHybridParallelPlugin
// (each rank holds 1/ep of them and exchanges tokens by all-to-all). Every
// setup lives in the same processes and their timed rounds alternate, so
// the ratios compare like with like on a noisy machine.
//
// Per setup: step time (median and spread over every step of every round,
// rank 0), tokens per second of the global batch, bytes handed to the
// expert-parallel group per step, mean over ranks beside the formula (per
// sparse layer: dispatch and combine in forward and backward, 4 x N k C x 4
// bytes, plus the E counts) and the most any rank handed over (routing is
// uneven; -1 where ep spans the whole data-parallel group, one group object
// whose count holds ZeRO's traffic too), parameters and model-state bytes
// per rank.
//
//   bench_moe_step [--nproc 4] [--global-batch 8] [--steps 3] [--rounds 3]
//                  [--setups ep1,ep2,ep4] [--out FILE.json]

#include "bench_launch.h"
#include "bench_util.h"

#include <colossalai/colossalai.h>
#include <colossalai/models/llama.h>
#include <colossalai/models/moe.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

namespace cb = colossalai::booster;
namespace cd = colossalai::distributed;
namespace models = colossalai::models;
using HPO = cb::plugin::HybridParallelPluginOptions;

namespace {

using colossalai::bench::median;
using colossalai::bench::split;

struct Options {
  int global_batch = 8, steps = 3, rounds = 3;
  std::string setups = "ep1,ep2,ep4", out;
};

models::LlamaConfig config() {
  return models::LlamaConfig::small_cpu().model_type("mixtral").moe(
      models::MoeConfig()
          .num_experts(8)
          .num_experts_per_tok(2)
          .output_router_logits(true)
          .router_aux_loss_coef(0.01));
}

struct Setup {
  std::string name;
  int ep = 1;
  std::shared_ptr<cb::plugin::HybridParallelPlugin> plugin;
  std::unique_ptr<cb::Booster> booster;
  models::LlamaForCausalLM model{nullptr};
  cb::Boosted<models::LlamaForCausalLM, std::nullptr_t, std::nullptr_t> boosted;
  std::vector<double> ms;
  int64_t ep_bytes = 0, ep_bytes_max = 0, params = 0, model_state = 0;
};

int run_rank(const Options& o) {
  colossalai::launch_from_env();
  at::set_num_threads(1);
  const int rank = cd::get_rank(), world = cd::get_world_size();
  const auto c = config();
  std::vector<std::unique_ptr<Setup>> setups;
  for (const auto& name : split(o.setups)) {
    TORCH_CHECK(name.rfind("ep", 0) == 0, "unknown setup '", name, "'");
    const int ep = std::stoi(name.substr(2));
    if (world % ep != 0 || c.moe().num_experts() % ep != 0) {
      if (rank == 0)
        std::fprintf(
            stderr, "%s: does not fit %d ranks\n", name.c_str(), world);
      continue;
    }
    auto s = std::make_unique<Setup>();
    s->name = name;
    s->ep = ep;
    auto opts = HPO().precision("fp32").zero_stage(1).ep_size(ep);
    s->plugin = ep > 1
        ? std::make_shared<cb::plugin::MoeHybridParallelPlugin>(opts)
        : std::make_shared<cb::plugin::HybridParallelPlugin>(opts);
    s->booster =
        std::make_unique<cb::Booster>(cb::BoosterOptions().plugin(s->plugin));
    torch::manual_seed(0);
    s->model = models::LlamaForCausalLM(c);
    auto opt = std::make_shared<torch::optim::AdamW>(
        s->model->parameters(),
        torch::optim::AdamWOptions(3e-4).weight_decay(0.01));
    s->boosted = s->booster->boost(s->model, opt);
    setups.push_back(std::move(s));
  }
  TORCH_CHECK(!setups.empty(), "no setup fits ", world, " ranks");
  const int dp = setups[0]->plugin->dp_size();
  TORCH_CHECK(
      o.global_batch % dp == 0,
      "--global-batch must divide by the data-parallel size ",
      dp);
  const int64_t micro = o.global_batch / dp, seq = c.max_position_embeddings();
  auto step = [&](Setup& s, int i) {
    auto gen = at::detail::createCPUGenerator(900 + i);
    auto tokens = at::randint(c.vocab_size(), {o.global_batch, seq + 1}, gen);
    auto x = tokens.narrow(0, micro * s.plugin->dp_rank(), micro)
                 .narrow(1, 0, seq)
                 .contiguous();
    auto y = tokens.narrow(0, micro * s.plugin->dp_rank(), micro)
                 .narrow(1, 1, seq)
                 .contiguous();
    auto t0 = std::chrono::steady_clock::now();
    s.boosted.optimizer->zero_grad();
    auto loss = s.model->loss(s.boosted.model(x), y);
    s.booster->backward(loss, *s.boosted.optimizer);
    s.boosted.optimizer->step();
    return std::chrono::duration<double, std::milli>(
               std::chrono::steady_clock::now() - t0)
        .count();
  };
  for (auto& s : setups)
    step(*s, 0); // warm up, creates optimizer states
  int counter = 1;
  for (int r = 0; r < o.rounds; ++r) {
    for (auto& s : setups) {
      cd::barrier(*cd::world_group()).wait();
      // When ep spans the whole data-parallel group (moe_dp 1) the two are
      // one group object, whose count then holds ZeRO's traffic too: not
      // reported (-1).
      const auto& ep = s->plugin->ep_group();
      const bool own = ep != nullptr && ep != s->plugin->mixed_dp_group();
      const int64_t b0 = own ? ep->bytes_communicated() : 0;
      for (int i = 0; i < o.steps; ++i)
        s->ms.push_back(step(*s, counter++));
      if (own)
        s->ep_bytes += ep->bytes_communicated() - b0;
      else if (ep != nullptr)
        s->ep_bytes = -1;
    }
    if (rank == 0)
      std::fprintf(stderr, "round %d/%d done\n", r + 1, o.rounds);
  }
  for (auto& s : setups) {
    if (s->ep_bytes < 0) {
      s->ep_bytes_max = -1; // shared with the data-parallel group (above)
    } else {
      s->ep_bytes /= static_cast<int64_t>(o.rounds) * o.steps;
      // What a rank sends depends on where its tokens go, what it returns
      // on what it received; over every rank the rows sent are the rows
      // received, so the mean over ranks meets the formula exactly.
      auto total = at::tensor({static_cast<double>(s->ep_bytes)}, at::kDouble);
      auto most = total.clone();
      cd::all_reduce(total, *cd::world_group()).wait();
      cd::all_reduce(most, *cd::world_group(), cd::ReduceOp::kMax).wait();
      s->ep_bytes = static_cast<int64_t>(total.item<double>() / world + 0.5);
      s->ep_bytes_max = static_cast<int64_t>(most.item<double>());
    }
    for (const auto& p : s->model->parameters())
      s->params += p.numel();
    auto* z = dynamic_cast<colossalai::zero::LowLevelZeroOptimizer*>(
        s->boosted.optimizer.get());
    TORCH_INTERNAL_ASSERT(z != nullptr);
    const auto st = z->memory_stats();
    s->model_state = st.working_params + st.gradients + st.master_weights +
        st.optimizer_states;
  }
  if (rank != 0)
    return 0;
  const int64_t layers = c.num_hidden_layers(), e = c.moe().num_experts(),
                k = c.moe().num_experts_per_tok(), width = c.hidden_size();
  const double tokens = static_cast<double>(o.global_batch) * seq;
  const double base = median(setups[0]->ms);
  std::ostringstream json;
  json << "{\n  \"benchmark\": \"moe_step\",\n  \"world_size\": " << world
       << ",\n  \"global_batch\": " << o.global_batch << ",\n  \"seq\": " << seq
       << ",\n  \"experts\": " << e << ",\n  \"top_k\": " << k
       << ",\n  \"machine\": " << colossalai::bench::machine_json()
       << ",\n  \"setups\": {";
  std::printf(
      "Mixtral-shaped (%lld layers, %lld experts, top %lld, width %lld), %d "
      "ranks, ZeRO-1, global batch %d x %lld\n"
      "| setup | step ms (median) | spread | vs ep1 | tokens/s | ep bytes/step "
      "(mean) | formula | most, one rank | parameters/rank | model state "
      "MB/rank |\n"
      "|---|---|---|---|---|---|---|---|---|---|\n",
      (long long)layers,
      (long long)e,
      (long long)k,
      (long long)width,
      world,
      o.global_batch,
      (long long)seq);
  for (size_t i = 0; i < setups.size(); ++i) {
    const auto& s = *setups[i];
    const double ms = median(s.ms);
    const double lo = colossalai::bench::percentile(s.ms, 0.0),
                 hi = colossalai::bench::percentile(s.ms, 1.0);
    const int64_t formula =
        s.ep > 1 ? layers * (4 * micro * seq * k * width * 4 + 8 * e) : 0;
    json << (i ? "," : "") << "\n    \"" << s.name << "\": {\"ep\": " << s.ep
         << ", \"step_ms\": " << colossalai::bench::stats_json(s.ms)
         << ", \"vs_ep1\": " << ms / base
         << ", \"tokens_per_s\": " << tokens / (ms / 1e3)
         << ", \"ep_bytes_per_step_mean\": " << s.ep_bytes
         << ", \"ep_bytes_per_step_max\": " << s.ep_bytes_max
         << ", \"ep_formula_bytes\": " << formula
         << ", \"parameters_per_rank\": " << s.params
         << ", \"model_state_bytes\": " << s.model_state << "}";
    std::printf(
        "| %s | %.0f | %.0f-%.0f | %.2fx | %.0f | %lld | %lld | %lld | %lld | "
        "%.1f |\n",
        s.name.c_str(),
        ms,
        lo,
        hi,
        ms / base,
        tokens / (ms / 1e3),
        (long long)s.ep_bytes,
        (long long)formula,
        (long long)s.ep_bytes_max,
        (long long)s.params,
        s.model_state / 1e6);
  }
  json << "\n  }\n}\n";
  if (!o.out.empty()) {
    std::ofstream(o.out) << json.str();
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  int nproc = 4;
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--nproc")
      nproc = std::stoi(v);
    else if (k == "--global-batch")
      o.global_batch = std::stoi(v);
    else if (k == "--steps")
      o.steps = std::stoi(v);
    else if (k == "--rounds")
      o.rounds = std::stoi(v);
    else if (k == "--setups")
      o.setups = v;
    else if (k == "--out")
      o.out = v;
    else {
      std::cerr << "unknown option " << k << "\n";
      return 2;
    }
  }
  return colossalai::bench::launch_ranks(
      nproc, argc, argv, [&] { return run_rank(o); });
}
