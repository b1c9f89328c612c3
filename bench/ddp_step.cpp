// DDP step benchmark on gpt-small-cpu (shared reference workload).
//
// Each rank trains with TorchDDPPlugin. Every round runs three timed blocks
// in turn, so all three are measured under the same machine conditions:
//   ddp      steps with gradient synchronization;
//   no_sync  steps under no_sync (no communication at all: the floor for N
//            processes sharing this machine);
//   lockstep no_sync steps that end in a barrier: the floor plus what any
//            synchronous step pays, waiting for the slowest rank, so
//            DDP / lockstep is the cost of the gradient bytes alone;
//   single   rank 0 alone trains a plain (unboosted) copy of the model while
//            the other ranks wait: the single-process floor.
//   ddp_fp8  (--fp8 1) steps of a second copy boosted with
//            fp8_communication: gradients all-reduced through FP8 where the
//            ranks span nodes (`colossalai run --nnodes`, e.g. across the
//            rate-limited link of bench/netns_link.sh).
// Each block also records the process CPU time per step (all threads:
// compute, the collectives' worker, Gloo's), which tells communication
// work apart from waiting. Reports medians with p10/p90, peak RSS per rank,
// machine and bytes communicated per step, as JSON and one table line.
//
//   bench_ddp_step [--nproc 2] [--steps 10] [--rounds 3] [--warmup 2]
//                  [--threads 1] [--bucket-cap-mb 25] [--fp8 0|1]
//                  [--out FILE.json]

#include <colossalai/colossalai.h>

#include <zoo/gpt.h>

#include "bench_util.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

namespace cb = colossalai::booster;
namespace cd = colossalai::distributed;

namespace {

using clock = std::chrono::steady_clock;

double ms(clock::time_point a, clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// CPU time of the whole process (every thread), in ms.
double process_cpu_ms() {
  timespec t{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

// {"name": stats, ...} for `names`, in that order.
std::string stats_json(
    std::map<std::string, std::vector<double>>& samples,
    std::initializer_list<const char*> names) {
  std::ostringstream os;
  const char* sep = "{";
  for (const char* name : names) {
    os << sep << "\"" << name
       << "\": " << colossalai::bench::stats_json(samples[name]);
    sep = ", ";
  }
  os << "}";
  return os.str();
}

std::string phases_json(std::map<std::string, std::vector<double>>& phases) {
  return stats_json(phases, {"forward", "backward", "optimizer"});
}

struct Args {
  int nproc = 2;
  int steps = 10;
  int rounds = 3;
  int warmup = 2;
  int threads = 1;
  double bucket_cap_mb = 25;
  bool fp8 = false;
  std::string out;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    TORCH_CHECK(i + 1 < argc, "option ", k, " needs a value");
    std::string v = argv[++i];
    if (k == "--nproc")
      a.nproc = std::stoi(v);
    else if (k == "--steps")
      a.steps = std::stoi(v);
    else if (k == "--rounds")
      a.rounds = std::stoi(v);
    else if (k == "--warmup")
      a.warmup = std::stoi(v);
    else if (k == "--threads")
      a.threads = std::stoi(v);
    else if (k == "--bucket-cap-mb")
      a.bucket_cap_mb = std::stod(v);
    else if (k == "--fp8")
      a.fp8 = std::stoi(v) != 0;
    else if (k == "--out")
      a.out = v;
    else
      TORCH_CHECK(false, "unknown option ", k);
  }
  return a;
}

using colossalai::bench::median;
using colossalai::bench::percentile;

// Every copy of the model trains with the same optimizer settings.
torch::optim::AdamWOptions adamw_options() {
  return torch::optim::AdamWOptions(3e-4)
      .betas({0.9, 0.999})
      .eps(1e-8)
      .weight_decay(0.01);
}

int run_rank(const Args& a) {
  colossalai::launch_from_env();
  at::set_num_threads(a.threads);
  const int rank = cd::get_rank(), world = cd::get_world_size();
  auto cfg = colossalai::zoo::GPTConfig::small_cpu();

  auto plugin = std::make_shared<cb::plugin::TorchDDPPlugin>(
      cb::plugin::TorchDDPPluginOptions().bucket_cap_mb(a.bucket_cap_mb));
  cb::Booster booster(cb::BoosterOptions().plugin(plugin));
  torch::manual_seed(0);
  colossalai::zoo::GPT model(cfg);
  auto optimizer = std::make_shared<torch::optim::AdamW>(
      model->parameters(), adamw_options());
  auto boosted = booster.boost(model, optimizer);
  auto* ddp = colossalai::interface::find_wrapper<cb::plugin::TorchDDPModel>(
      *boosted.model.wrapper());

  // --fp8: the same model and optimizer boosted with fp8_communication.
  auto fp8_plugin = std::make_shared<cb::plugin::TorchDDPPlugin>(
      cb::plugin::TorchDDPPluginOptions()
          .bucket_cap_mb(a.bucket_cap_mb)
          .fp8_communication(a.fp8));
  cb::Booster fp8_booster(cb::BoosterOptions().plugin(fp8_plugin));
  torch::manual_seed(0);
  colossalai::zoo::GPT fp8_model(cfg);
  auto fp8_optimizer = std::make_shared<torch::optim::AdamW>(
      fp8_model->parameters(), adamw_options());
  auto fp8_boosted = a.fp8 ? fp8_booster.boost(fp8_model, fp8_optimizer)
                           : decltype(fp8_booster.boost(fp8_model)){};
  const bool fp8_compressed = a.fp8 &&
      colossalai::interface::find_wrapper<cb::plugin::TorchDDPModel>(
          *fp8_boosted.model.wrapper())
          ->fp8_communication();

  // The single-process floor: a plain copy of the model on rank 0.
  torch::manual_seed(0);
  colossalai::zoo::GPT single_model(cfg);
  torch::optim::AdamW single_opt(single_model->parameters(), adamw_options());

  auto batch = colossalai::zoo::random_tokens(8, cfg, 100 + rank);
  // Phases of the single-process step (zero_grad + forward + loss,
  // backward, optimizer), for the side-by-side breakdown with PyTorch's.
  std::map<std::string, std::vector<double>> phases;
  auto single_step = [&]() {
    auto t0 = clock::now();
    single_opt.zero_grad();
    auto loss =
        colossalai::zoo::gpt_loss(single_model(batch.first), batch.second);
    auto t1 = clock::now();
    loss.backward();
    auto t2 = clock::now();
    single_opt.step();
    auto t3 = clock::now();
    phases["forward"].push_back(ms(t0, t1));
    phases["backward"].push_back(ms(t1, t2));
    phases["optimizer"].push_back(ms(t2, t3));
    return ms(t0, t3);
  };
  std::map<std::string, std::vector<double>> ddp_phases; // synced steps
  enum class Mode { kDdp, kNoSync, kLockstep, kDdpFp8 };
  auto step = [&](Mode mode) {
    const bool sync = mode == Mode::kDdp;
    auto& b = mode == Mode::kDdpFp8 ? fp8_boosted : boosted;
    auto& bo = mode == Mode::kDdpFp8 ? fp8_booster : booster;
    auto t0 = clock::now();
    b.optimizer->zero_grad();
    auto loss = colossalai::zoo::gpt_loss(b.model(batch.first), batch.second);
    auto t1 = clock::now();
    if (mode == Mode::kNoSync || mode == Mode::kLockstep) {
      auto guard = bo.no_sync(b.model, b.optimizer.get());
      bo.backward(loss, *b.optimizer);
    } else {
      bo.backward(loss, *b.optimizer);
    }
    auto t2 = clock::now();
    b.optimizer->step();
    if (mode == Mode::kLockstep) {
      cd::barrier(*cd::world_group()).wait();
    }
    auto t3 = clock::now();
    if (sync) {
      ddp_phases["forward"].push_back(ms(t0, t1));
      ddp_phases["backward"].push_back(ms(t1, t2));
      ddp_phases["optimizer"].push_back(ms(t2, t3));
    }
    return ms(t0, t3);
  };
  std::vector<std::pair<Mode, std::string>> modes = {
      {Mode::kDdp, "ddp"},
      {Mode::kNoSync, "no_sync"},
      {Mode::kLockstep, "lockstep"}};
  if (a.fp8) {
    modes.push_back({Mode::kDdpFp8, "ddp_fp8"});
  }

  std::map<std::string, std::vector<double>> times, cpu;
  int64_t bytes = 0, synced_steps = 0, fp8_bytes = 0;
  for (int w = 0; w < a.warmup; ++w) {
    for (const auto& m : modes) {
      step(m.first);
    }
    if (rank == 0) {
      single_step();
    }
  }
  phases.clear(); // warm-up steps are not timed
  ddp_phases.clear();
  for (int r = 0; r < a.rounds; ++r) {
    for (const auto& m : modes) {
      // Start each block together so neither mode eats the other's tail.
      cd::barrier(*cd::world_group()).wait();
      int64_t b0 = cd::bytes_communicated();
      for (int s = 0; s < a.steps; ++s) {
        const double c0 = process_cpu_ms();
        times[m.second].push_back(step(m.first));
        cpu[m.second].push_back(process_cpu_ms() - c0);
      }
      if (m.first == Mode::kDdp) {
        bytes += cd::bytes_communicated() - b0;
        synced_steps += a.steps;
      }
      if (m.first == Mode::kDdpFp8) {
        fp8_bytes += cd::bytes_communicated() - b0;
      }
      if (rank == 0) {
        std::fprintf(
            stderr, "round %d/%d %s done\n", r + 1, a.rounds, m.second.c_str());
      }
    }
    cd::barrier(*cd::world_group()).wait();
    if (rank == 0) {
      for (int s = 0; s < a.steps; ++s) {
        times["single"].push_back(single_step());
      }
      std::fprintf(stderr, "round %d/%d single done\n", r + 1, a.rounds);
    }
  }
  cd::barrier(*cd::world_group()).wait();

  // Per-rank peak RSS and medians to rank 0.
  auto local = at::tensor(
      {static_cast<double>(colossalai::bench::peak_rss_bytes()),
       median(times["ddp"]),
       median(times["no_sync"])},
      at::kDouble);
  auto all = at::empty({3 * world}, at::kDouble);
  cd::all_gather(all, local, *cd::world_group()).wait();
  if (rank != 0) {
    return 0;
  }
  double ddp_ms = median(times["ddp"]), floor_ms = median(times["no_sync"]);
  double single_ms = median(times["single"]);
  const double lockstep_ms = median(times["lockstep"]);
  std::ostringstream rss, per_rank;
  for (int r = 0; r < world; ++r) {
    rss << (r ? ", " : "") << static_cast<int64_t>(all[3 * r].item<double>());
    per_rank << (r ? ", " : "") << "{\"ddp\": " << all[3 * r + 1].item<double>()
             << ", \"no_sync\": " << all[3 * r + 2].item<double>() << "}";
  }
  const int64_t params = cfg.num_parameters();
  const double bytes_per_step = static_cast<double>(bytes) / synced_steps;
  std::ostringstream json;
  json << "{\n"
       << "  \"benchmark\": \"ddp_step\",\n"
       << "  \"model\": \"gpt-small-cpu\",\n"
       << "  \"parameters\": " << params << ",\n"
       << "  \"config\": {\"world_size\": " << world
       << ", \"micro_batch\": 8, \"seq_len\": " << cfg.block_size()
       << ", \"threads_per_rank\": " << a.threads
       << ", \"bucket_cap_mb\": " << a.bucket_cap_mb
       << ", \"steps_per_round\": " << a.steps << ", \"rounds\": " << a.rounds
       << ", \"optimizer\": \"AdamW(3e-4, wd 0.01)\", \"dtype\": \"fp32\"},\n"
       << "  \"implementation\": \"ours (C++, TorchDDPPlugin)\",\n"
       << "  \"machine\": " << colossalai::bench::machine_json() << ",\n"
       << "  \"step_ms\": "
       << (a.fp8
               ? stats_json(
                     times, {"ddp", "no_sync", "lockstep", "single", "ddp_fp8"})
               : stats_json(times, {"ddp", "no_sync", "lockstep", "single"}))
       << ",\n"
       << "  \"cpu_ms_per_step\": "
       << stats_json(cpu, {"ddp", "no_sync", "lockstep"}) << ",\n"
       << "  \"single_phases_ms\": " << phases_json(phases) << ",\n"
       << "  \"ddp_phases_ms\": " << phases_json(ddp_phases) << ",\n"
       << "  \"ratios\": {\"ddp_over_no_sync\": " << ddp_ms / floor_ms
       << ", \"ddp_over_lockstep\": " << ddp_ms / lockstep_ms
       << ", \"lockstep_over_no_sync\": " << lockstep_ms / floor_ms
       << ", \"ddp_over_single\": " << ddp_ms / single_ms
       << ", \"single_over_no_sync\": " << single_ms / floor_ms << "},\n"
       << (a.fp8 ? "  \"fp8\": {\"compressed\": " +
                   std::string(fp8_compressed ? "true" : "false") +
                   ", \"ddp_fp8_over_ddp\": " +
                   std::to_string(median(times["ddp_fp8"]) / ddp_ms) +
                   ", \"ddp_fp8_over_no_sync\": " +
                   std::to_string(median(times["ddp_fp8"]) / floor_ms) +
                   ", \"bytes_per_step\": " +
                   std::to_string(
                       static_cast<double>(fp8_bytes) / synced_steps) +
                   "},\n"
                 : std::string())
       << "  \"ddp_step_ms\": {\"median\": " << ddp_ms
       << ", \"p10\": " << percentile(times["ddp"], 0.1)
       << ", \"p90\": " << percentile(times["ddp"], 0.9) << "},\n"
       << "  \"no_sync_step_ms\": {\"median\": " << floor_ms
       << ", \"p10\": " << percentile(times["no_sync"], 0.1)
       << ", \"p90\": " << percentile(times["no_sync"], 0.9) << "},\n"
       << "  \"ratio_ddp_over_floor\": " << ddp_ms / floor_ms << ",\n"
       << "  \"buckets\": " << ddp->bucket_numels().size() << ",\n"
       << "  \"bytes_allreduced_per_step\": " << bytes_per_step << ",\n"
       << "  \"bus_bytes_per_rank_per_step\": "
       << bytes_per_step * 2.0 * (world - 1) / world << ",\n"
       << "  \"peak_rss_bytes_per_rank\": [" << rss.str() << "],\n"
       << "  \"step_ms_median_per_rank\": [" << per_rank.str() << "]\n"
       << "}\n";
  if (!a.out.empty()) {
    std::ofstream(a.out) << json.str();
  }
  std::cout << json.str();
  std::printf(
      "| gpt-small-cpu | %d ranks | DDP %.1f ms | no-sync floor %.1f ms | "
      "single process %.1f ms | ratio %.2fx | %.1f MB all-reduced/step | "
      "peak RSS rank0 %.0f MB |\n",
      world,
      ddp_ms,
      floor_ms,
      single_ms,
      ddp_ms / floor_ms,
      bytes_per_step / 1e6,
      all[0].item<double>() / 1e6);
  if (a.fp8) {
    std::printf(
        "| fp8_communication | %s | DDP through FP8 %.1f ms (%.2fx DDP) | "
        "%.1f MB/step |\n",
        fp8_compressed ? "compressed" : "not compressed (one node)",
        median(times["ddp_fp8"]),
        median(times["ddp_fp8"]) / ddp_ms,
        static_cast<double>(fp8_bytes) / synced_steps / 1e6);
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  try {
    Args a = parse(argc, argv);
    if (!colossalai::launcher::launched_by_launcher()) {
      return colossalai::launcher::run_self(a.nproc, argc, argv);
    }
    return run_rank(a);
  } catch (const std::exception& e) {
    std::cerr << "error: " << cd::error_text(e) << std::endl;
    return 1;
  }
}
