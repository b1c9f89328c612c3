// Extra memory a sharded save takes, per rank, under FSDP (a unit per
// block) and ZeRO-2 (several buckets) on gpt-small-cpu, fp32 AdamW, 2 ranks:
// the rise of each process's resident set (VmHWM after resetting it) over
// its resident set right before the save (after returning free heap pages to
// the system), for save_model and save_optimizer with shard(true).
//
// A save that gathered everything everywhere would add the whole model
// (4 Psi) or optimizer (8 Psi) to every rank; a streamed save adds, on the
// writer, at most one shard (size_per_shard, or one larger tensor) plus the
// group in flight (a unit or bucket, gathered once per state key), and on
// the other ranks only their own part of that group.
//
//   bench_save_memory [--nproc 2] [--setups fsdp,zero2] [--size_per_shard 4]
//                     [--out FILE.json]

#include "bench_launch.h"
#include "bench_util.h"

#include <colossalai/colossalai.h>

#include <zoo/gpt.h>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <malloc.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

namespace cb = colossalai::booster;
namespace cd = colossalai::distributed;
namespace ck = colossalai::checkpoint_io;

namespace {

using colossalai::bench::split;

int64_t rss() {
  return colossalai::bench::proc_kb("/proc/self/status", "VmRSS:");
}

// Bytes the resident set rose to above its level before `fn`.
int64_t extra_during(const std::function<void()>& fn) {
  cd::barrier(*cd::world_group()).wait();
  malloc_trim(0);
  const int64_t before = rss();
  {
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5"; // resets VmHWM to the current resident set
  }
  fn();
  return colossalai::bench::peak_rss_bytes() - before;
}

struct Row {
  std::string setup;
  int64_t largest_group = 0; // elements of the largest unit / bucket
  std::vector<int64_t> model_extra, optim_extra; // per rank
  int64_t model_file_bytes = 0, optim_file_bytes = 0;
};

int64_t bytes_under(const std::string& dir) {
  int64_t n = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) {
      n += static_cast<int64_t>(e.file_size());
    }
  }
  return n;
}

int run_rank(
    const std::string& names,
    int64_t size_per_shard,
    const std::string& out) {
  colossalai::launch_from_env();
  at::set_num_threads(1);
  // Large blocks mapped and unmapped on their own, so that the resident set
  // follows live memory (glibc's adaptive threshold would keep freed blocks
  // in the heap and hide or inflate what a save takes).
  mallopt(M_MMAP_THRESHOLD, 128 * 1024);
  const int rank = cd::get_rank(), world = cd::get_world_size();
  const auto cfg = colossalai::zoo::GPTConfig::small_cpu();
  const int64_t psi = cfg.num_parameters();
  int64_t largest_tensor = 0;
  auto dir = std::filesystem::temp_directory_path() /
      ("colossalai_save_memory_" + std::to_string(::getppid()));
  std::vector<Row> rows;
  for (const auto& name : split(names)) {
    std::shared_ptr<cb::plugin::Plugin> plugin;
    if (name == "fsdp") {
      plugin = std::make_shared<cb::plugin::TorchFSDPPlugin>(
          cb::plugin::TorchFSDPPluginOptions().auto_wrap_policy(
              colossalai::zero::module_type_wrap_policy<
                  colossalai::zoo::BlockImpl>()));
    } else if (name == "zero2") {
      plugin = std::make_shared<cb::plugin::LowLevelZeroPlugin>(
          cb::plugin::LowLevelZeroPluginOptions()
              .stage(2)
              .precision("fp32")
              .reduce_bucket_size_in_m(1)); // several buckets
    } else {
      TORCH_CHECK(false, "unknown setup '", name, "'");
    }
    torch::manual_seed(0);
    cb::Booster booster(cb::BoosterOptions().plugin(plugin));
    colossalai::zoo::GPT model(cfg);
    for (const auto& p : model->parameters()) {
      largest_tensor = std::max<int64_t>(largest_tensor, p.numel());
    }
    auto opt = std::make_shared<torch::optim::AdamW>(
        model->parameters(), torch::optim::AdamWOptions(3e-4));
    auto boosted = booster.boost(model, opt);
    auto batch = colossalai::zoo::random_tokens(8, cfg, 100 + rank);
    booster.backward(
        colossalai::zoo::gpt_loss(boosted.model(batch.first), batch.second),
        *boosted.optimizer);
    boosted.optimizer->step();

    Row row;
    row.setup = name;
    if (auto* f = colossalai::interface::find_wrapper<
            colossalai::zero::FullyShardedModel>(*boosted.model.wrapper())) {
      for (auto n : f->unit_numels()) {
        row.largest_group = std::max(row.largest_group, n);
      }
    } else if (
        auto* z = dynamic_cast<colossalai::zero::LowLevelZeroOptimizer*>(
            boosted.optimizer.get())) {
      for (auto n : z->bucket_numels()) {
        row.largest_group = std::max(row.largest_group, n);
      }
    }
    const auto path = (dir / name).string();
    int64_t model_extra = extra_during([&] {
      booster.save_model(
          boosted.model,
          path + "/model",
          ck::SaveModelOptions()
              .shard(true)
              .use_safetensors(true)
              .size_per_shard(size_per_shard));
    });
    int64_t optim_extra = extra_during([&] {
      booster.save_optimizer(
          *boosted.optimizer,
          path + "/optimizer",
          ck::SaveOptimizerOptions().shard(true).size_per_shard(
              size_per_shard));
    });
    auto t = at::tensor({model_extra, optim_extra}, at::kLong);
    auto all = at::empty({2 * world}, at::kLong);
    cd::all_gather(all, t, *cd::world_group()).wait();
    for (int r = 0; r < world; ++r) {
      row.model_extra.push_back(all[2 * r].item<int64_t>());
      row.optim_extra.push_back(all[2 * r + 1].item<int64_t>());
    }
    if (rank == 0) {
      row.model_file_bytes = bytes_under(path + "/model");
      row.optim_file_bytes = bytes_under(path + "/optimizer");
    }
    rows.push_back(row);
    if (rank == 0) {
      std::printf("%s done\n", name.c_str());
      std::fflush(stdout);
    }
  }
  cd::barrier(*cd::world_group()).wait();
  if (rank != 0) {
    return 0;
  }
  std::filesystem::remove_all(dir);
  const double mb = 1 << 20;
  std::printf(
      "\ngpt-small-cpu, %d ranks, fp32 AdamW: model %.1f MB, optimizer "
      "states %.1f MB, largest tensor %.1f MB, size_per_shard %lld MB\n\n",
      world,
      4.0 * psi / mb,
      8.0 * psi / mb,
      4.0 * largest_tensor / mb,
      static_cast<long long>(size_per_shard));
  std::printf(
      "| setup | largest unit/bucket MB | rank | save_model extra MB | "
      "save_optimizer extra MB | files written MB (model, optimizer) "
      "|\n|---|---|---|---|---|---|\n");
  std::ostringstream json;
  json << "{\n  \"benchmark\": \"save_memory\",\n  \"model\": \"gpt-small-cpu\""
       << ",\n  \"parameters\": " << psi << ",\n  \"world_size\": " << world
       << ",\n  \"largest_tensor_bytes\": " << 4 * largest_tensor
       << ",\n  \"size_per_shard_bytes\": " << size_per_shard * (1 << 20)
       << ",\n  \"machine\": " << colossalai::bench::machine_json()
       << ",\n  \"setups\": {";
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    json << (i ? "," : "") << "\n    \"" << r.setup
         << "\": {\"largest_group_bytes\": " << 4 * r.largest_group
         << ", \"save_model_extra_bytes\": [";
    for (int k = 0; k < world; ++k) {
      json << (k ? ", " : "") << r.model_extra[k];
      std::printf(
          "| %s | %.1f | %d%s | %.1f | %.1f | %s |\n",
          r.setup.c_str(),
          4.0 * r.largest_group / mb,
          k,
          k == 0 ? " (writer)" : "",
          r.model_extra[k] / mb,
          r.optim_extra[k] / mb,
          k == 0 ? (std::to_string(r.model_file_bytes / (1 << 20)) + ", " +
                    std::to_string(r.optim_file_bytes / (1 << 20)))
                       .c_str()
                 : "");
    }
    json << "], \"model_file_bytes\": " << r.model_file_bytes
         << ", \"optimizer_file_bytes\": " << r.optim_file_bytes;
    json << ", \"save_optimizer_extra_bytes\": [";
    for (int k = 0; k < world; ++k) {
      json << (k ? ", " : "") << r.optim_extra[k];
    }
    json << "]}";
  }
  json << "\n  }\n}\n";
  if (!out.empty()) {
    std::ofstream(out) << json.str();
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  int nproc = 2;
  int64_t size_per_shard = 4;
  std::string out, names = "fsdp,zero2";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--nproc")
      nproc = std::stoi(v);
    else if (k == "--setups")
      names = v;
    else if (k == "--size_per_shard")
      size_per_shard = std::stoll(v);
    else if (k == "--out")
      out = v;
    else {
      std::cerr << "unknown option " << k << "\n";
      return 2;
    }
  }
  return colossalai::bench::launch_ranks(
      nproc, argc, argv, [&] { return run_rank(names, size_per_shard, out); });
}
