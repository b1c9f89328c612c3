// Booster::save_checkpoint / resume_or_start and the manifest that makes a
// training checkpoint one verifiable set (NOTE [Training checkpoints]).

#include <colossalai/booster/booster.h>
#include <colossalai/booster/training_checkpoint.h>
#include <colossalai/checkpoint_io/io_utils.h>
#include <colossalai/checkpoint_io/safetensors.h>
#include <colossalai/checkpoint_io/torch_bin.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/error.h>
#include <colossalai/lora/lora_model.h>

#include "../utils/bounded_json.h"
#include "../utils/fault_point.h"

#include <nlohmann/json.hpp>
#include <zlib.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace colossalai {
namespace booster {

namespace {

namespace fs = std::filesystem;
namespace cd = checkpoint_io::detail;
using json = nlohmann::json;

constexpr const char* kPrefix = "checkpoint-";
constexpr const char* kManifest = "manifest.json";
constexpr const char* kState = "trainer_state.json";
constexpr const char* kScheduler = "scheduler.pt";

std::string final_name(int64_t step) {
  return kPrefix + std::to_string(step);
}

// The step of a "checkpoint-<step>" name, or -1 for any other name.
int64_t step_of(const std::string& name) {
  const std::string prefix(kPrefix);
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix)) {
    return -1;
  }
  const auto digits = name.substr(prefix.size());
  if (digits.size() > 18 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) {
        return c >= '0' && c <= '9';
      })) {
    return -1;
  }
  return std::stoll(digits);
}

bool distributed_run() {
  return distributed::is_initialized();
}

// Every rank's `mine`, in rank order (just `mine` without a process group).
std::vector<std::string> gather(const std::string& mine) {
  if (!distributed_run()) {
    return {mine};
  }
  return distributed::all_gather_bytes(mine, *distributed::world_group());
}

// The first rank's error, named, or empty: every rank gets the same.
std::string agreed_error(const std::string& mine) {
  const auto all = gather(mine);
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].empty()) {
      return all.size() > 1 ? "rank " + std::to_string(r) + ": " + all[r]
                            : all[r];
    }
  }
  return "";
}

bool is_rank0() {
  return !distributed_run() || distributed::get_rank() == 0;
}

// Runs `fn` capturing its error as text.
std::string guarded(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return distributed::error_text(e);
  }
  return "";
}

// CRC-32 (zlib's) and size of a file, read in 4 MiB blocks.
std::pair<uint32_t, int64_t> crc_of(const std::string& path) {
  int64_t size = 0;
  const int fd = cd::open_regular(path, &size);
  std::vector<unsigned char> buf(4 << 20);
  uLong crc = crc32(0L, Z_NULL, 0);
  int64_t at = 0;
  while (at < size) {
    const ssize_t n = ::pread(fd, buf.data(), buf.size(), at);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      const std::string why = n < 0 ? std::strerror(errno) : "unexpected end";
      ::close(fd);
      TORCH_CHECK(false, "cannot read '", path, "': ", why);
    }
    crc = crc32(crc, buf.data(), static_cast<uInt>(n));
    at += n;
  }
  ::close(fd);
  return {static_cast<uint32_t>(crc), size};
}

// Regular files under `dir` (relative paths, sorted), hidden ones (a
// checkpoint IO temporary) and the manifest aside.
std::vector<std::string> files_of(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const auto rel = fs::relative(e.path(), dir).string();
    if (e.is_regular_file() && rel != kManifest &&
        !cd::is_hidden(e.path().filename().string())) {
      out.push_back(rel);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

void write_json(const std::string& path, const json& j) {
  const auto text = j.dump(2) + "\n";
  const std::vector<char> bytes(text.begin(), text.end());
  cd::atomic_write_file(
      path, [&](const std::string& tmp) { cd::write_bytes(tmp, bytes); });
}

json read_json(const std::string& path) {
  const auto bytes = cd::read_bytes(path, cd::kMaxJsonFileBytes, "JSON file");
  return utils::parse_bounded_json(std::string(bytes.begin(), bytes.end()), path);
}

void write_manifest(const std::string& dir) {
  json files = json::array();
  for (const auto& rel : files_of(dir)) {
    const auto c = crc_of(cd::join(dir, rel));
    files.push_back({{"path", rel}, {"bytes", c.second}, {"crc32", c.first}});
  }
  write_json(cd::join(dir, kManifest), {{"files", files}});
}

// What does not match the manifest, or "".
std::string check_manifest(const std::string& dir) {
  const auto path = cd::join(dir, kManifest);
  if (!cd::exists(path)) {
    return "no manifest.json (not written by save_checkpoint)";
  }
  return guarded([&] {
    const auto m = read_json(path);
    TORCH_CHECK(
        m.is_object() && m.contains("files") && m["files"].is_array(),
        "manifest.json has no 'files' list");
    bool has_state = false;
    for (const auto& f : m["files"]) {
      TORCH_CHECK(
          f.is_object() && f.contains("path") && f["path"].is_string() &&
              f.contains("bytes") && f["bytes"].is_number_integer() &&
              f.contains("crc32") && f["crc32"].is_number_unsigned(),
          "manifest.json has a malformed entry: ",
          utils::json_excerpt(f));
      const auto rel = f["path"].get<std::string>();
      TORCH_CHECK(
          !rel.empty() && rel[0] != '/' && rel.find("..") == std::string::npos,
          "manifest.json names a path outside the checkpoint: ",
          rel);
      has_state = has_state || rel == kState;
      const auto file = cd::join(dir, rel);
      TORCH_CHECK(cd::exists(file), rel, " is missing");
      const auto c = crc_of(file);
      TORCH_CHECK(
          c.second == f["bytes"].get<int64_t>(),
          rel,
          " has ",
          c.second,
          " bytes, the manifest says ",
          f["bytes"].get<int64_t>());
      TORCH_CHECK(
          c.first == f["crc32"].get<uint32_t>(),
          rel,
          " does not match its checksum (its bytes changed after the save)");
    }
    TORCH_CHECK(has_state, "the manifest lists no ", kState);
  });
}

int64_t state_field(const json& j, const char* key, const std::string& file) {
  if (!j.contains(key)) {
    return 0;
  }
  const auto& v = j[key];
  TORCH_CHECK(
      v.is_number_integer() && v.get<int64_t>() >= 0,
      "'",
      file,
      "': '",
      key,
      "' must be an integer >= 0, got ",
      utils::json_excerpt(v));
  return v.get<int64_t>();
}

TrainingState read_state(const std::string& file) {
  const auto j = read_json(file);
  TORCH_CHECK(j.is_object(), "'", file, "' is not a JSON object");
  TORCH_CHECK(j.contains("step"), "'", file, "' has no 'step'");
  return TrainingState()
      .step(state_field(j, "step", file))
      .epoch(state_field(j, "epoch", file))
      .samples_in_epoch(state_field(j, "samples_in_epoch", file));
}

// Renames a directory hidden, then removes it: never seen half-deleted.
void retire(const std::string& dir, const std::string& name) {
  const auto from = cd::join(dir, name);
  const auto to = cd::join(dir, "." + name + ".retiring");
  std::error_code ec;
  fs::remove_all(to, ec);
  fs::rename(from, to, ec);
  utils::fault_point("training:retiring");
  if (!ec) {
    fs::remove_all(to, ec);
  }
}

} // namespace

std::vector<TrainingCheckpointInfo> list_training_checkpoints(
    const std::string& dir,
    bool verify) {
  std::vector<TrainingCheckpointInfo> out;
  if (!cd::is_dir(dir)) {
    return out;
  }
  for (const auto& e : fs::directory_iterator(dir)) {
    const auto name = e.path().filename().string();
    const int64_t step = step_of(name);
    if (step >= 0 && e.is_directory()) {
      TrainingCheckpointInfo info;
      info.path = e.path().string();
      info.step = step;
      out.push_back(std::move(info));
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.step > b.step;
  });
  for (auto& info : out) {
    info.problem = verify ? check_manifest(info.path) : "";
  }
  return out;
}

void Booster::save_checkpoint(
    const std::string& dir,
    const TrainingState& state,
    interface::ModelWrapper& model,
    interface::OptimizerWrapper* optimizer,
    nn::lr_scheduler::LRScheduler* scheduler,
    const TrainingCheckpointOptions& options) {
  TORCH_CHECK(
      state.step() >= 0 && state.epoch() >= 0 && state.samples_in_epoch() >= 0,
      "save_checkpoint: the state's step, epoch and samples_in_epoch must be "
      ">= 0, got ",
      state.step(),
      ", ",
      state.epoch(),
      ", ",
      state.samples_in_epoch());
  TORCH_CHECK(
      options.keep_last() >= 1,
      "save_checkpoint: keep_last must be >= 1, got ",
      options.keep_last());
  TORCH_CHECK(
      options.size_per_shard() >= 1,
      "save_checkpoint: size_per_shard must be >= 1 (MB), got ",
      options.size_per_shard());
  const auto name = final_name(state.step());
  const auto partial = cd::join(dir, "." + name + ".partial");
  // Rank 0 clears what a killed save left; every rank then writes its part.
  std::string error;
  if (is_rank0()) {
    error = guarded([&] {
      fs::create_directories(dir);
      for (const auto& e : fs::directory_iterator(dir)) {
        const auto n = e.path().filename().string();
        const bool leftover = n.size() > 1 && n[0] == '.' &&
            (n.rfind(".partial") == n.size() - 8 ||
             n.rfind(".retiring") == n.size() - 9);
        if (leftover && e.is_directory()) {
          fs::remove_all(e.path());
        }
      }
      fs::create_directories(partial);
    });
  }
  error = agreed_error(error);
  TORCH_CHECK(error.empty(), "save_checkpoint: cannot save in '", dir, "': ", error);

  error = guarded([&] {
    auto lora = lora_.find(model.unwrap().get());
    if (lora != lora_.end()) {
      model.synchronize_weights(); // the adapters as the last step left them
      if (is_rank0()) {
        lora->second->save_pretrained(
            cd::join(partial, "adapter"), options.use_safetensors());
      }
    } else {
      checkpoint_io_->save_model(
          model,
          cd::join(partial, "model"),
          checkpoint_io::SaveModelOptions()
              .shard(true)
              .use_safetensors(options.use_safetensors())
              .size_per_shard(options.size_per_shard()));
    }
    utils::fault_point("training:model_saved");
    if (optimizer != nullptr) {
      checkpoint_io_->save_optimizer(
          *optimizer,
          cd::join(partial, "optimizer"),
          checkpoint_io::SaveOptimizerOptions().shard(true).size_per_shard(
              options.size_per_shard()));
      utils::fault_point("training:optimizer_saved");
    }
    if (scheduler != nullptr) {
      checkpoint_io_->save_lr_scheduler(*scheduler, cd::join(partial, kScheduler));
    }
    checkpoint_io_->synchronize();
  });
  error = agreed_error(error);
  if (!error.empty()) {
    if (is_rank0()) {
      std::error_code ec;
      fs::remove_all(partial, ec);
    }
    TORCH_CHECK(false, "save_checkpoint: '", name, "' was not saved: ", error);
  }

  // The commit: state, manifest, one rename.
  if (is_rank0()) {
    error = guarded([&] {
      write_json(
          cd::join(partial, kState),
          {{"step", state.step()},
           {"epoch", state.epoch()},
           {"samples_in_epoch", state.samples_in_epoch()}});
      utils::fault_point("training:state_written");
      write_manifest(partial);
      cd::fsync_path(partial, /*directory=*/true);
      utils::fault_point("training:manifest_written");
      const auto target = cd::join(dir, name);
      if (cd::exists(target)) {
        retire(dir, name); // the same step saved again
      }
      fs::rename(partial, target);
      cd::fsync_path(dir, /*directory=*/true);
      utils::fault_point("training:committed");
      // The newest keep_last by step stay (this one among them).
      int64_t kept = 0;
      for (const auto& info : list_training_checkpoints(dir, false)) {
        if (kept < options.keep_last()) {
          ++kept;
        } else {
          retire(dir, fs::path(info.path).filename().string());
        }
      }
    });
  }
  error = agreed_error(error);
  TORCH_CHECK(error.empty(), "save_checkpoint: '", name, "' was not committed: ", error);
}

TrainingState Booster::resume_or_start(
    const std::string& dir,
    interface::ModelWrapper& model,
    interface::OptimizerWrapper* optimizer,
    nn::lr_scheduler::LRScheduler* scheduler) {
  // Rank 0 chooses (reading every byte once); all load the same set.
  std::string chosen, error;
  if (is_rank0()) {
    error = guarded([&] {
      for (const auto& info : list_training_checkpoints(dir)) {
        if (info.problem.empty()) {
          chosen = info.path;
          break;
        }
        std::fprintf(
            stderr,
            "resume_or_start: skipping '%s': %s\n",
            info.path.c_str(),
            info.problem.c_str());
      }
    });
  }
  error = agreed_error(error);
  TORCH_CHECK(error.empty(), "resume_or_start: '", dir, "': ", error);
  chosen = gather(chosen).front();
  if (chosen.empty()) {
    return TrainingState();
  }
  TrainingState state;
  error = guarded([&] {
    state = read_state(cd::join(chosen, kState));
    auto lora = lora_.find(model.unwrap().get());
    if (lora != lora_.end()) {
      const auto adapter = cd::join(chosen, "adapter");
      const auto st = cd::join(adapter, "adapter_model.safetensors");
      const auto file = cd::exists(st) ? st : cd::join(adapter, "adapter_model.bin");
      const auto state = cd::exists(st)
          ? checkpoint_io::safetensors::load_file(file)
          : checkpoint_io::load_bin(file);
      // In the plugin's scope: ZeRO's master weights follow the adapters
      // (a bf16 resume used to step from the masters of the fresh start).
      checkpoint_io_->load_model_tensors(
          model, [&] { lora->second->load_adapter_state_dict(state, file); });
    } else {
      checkpoint_io_->load_model(model, cd::join(chosen, "model"));
    }
    if (optimizer != nullptr) {
      const auto path = cd::join(chosen, "optimizer");
      TORCH_CHECK(
          cd::exists(path),
          "the checkpoint has no optimizer state (it was saved without one)");
      checkpoint_io_->load_optimizer(*optimizer, path);
    }
    if (scheduler != nullptr) {
      const auto path = cd::join(chosen, kScheduler);
      TORCH_CHECK(
          cd::exists(path),
          "the checkpoint has no scheduler state (it was saved without one)");
      checkpoint_io_->load_lr_scheduler(*scheduler, path);
    }
  });
  error = agreed_error(error);
  TORCH_CHECK(
      error.empty(), "resume_or_start: cannot load '", chosen, "': ", error);
  return state;
}

} // namespace booster
} // namespace colossalai
