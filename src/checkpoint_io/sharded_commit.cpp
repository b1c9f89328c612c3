#include "sharded_commit.h"

#include "../utils/fault_point.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>

namespace fs = std::filesystem;

namespace colossalai {
namespace checkpoint_io {
namespace detail {

namespace {

std::string journal_path(const std::string& dir, const std::string& index) {
  return join(dir, "." + index + ".journal");
}

void rename_or_throw(const std::string& from, const std::string& to) {
  TORCH_CHECK(
      ::rename(from.c_str(), to.c_str()) == 0,
      "cannot rename '",
      from,
      "' to '",
      to,
      "': ",
      std::strerror(errno));
}

// The index at `path`, or nullopt when there is none or it is unreadable
// (then nothing it names is protected or retired).
std::optional<Index> try_read_index(const std::string& path) {
  if (!exists(path)) {
    return std::nullopt;
  }
  try {
    return read_index(path);
  } catch (const c10::Error&) {
    return std::nullopt;
  }
}

// Files a checkpoint owns: its shards and the file of its param groups.
std::set<std::string> owned_files(const Index& index) {
  std::set<std::string> out;
  for (const auto& kv : index.weight_map) {
    out.insert(kv.second);
  }
  auto groups = index.metadata.find("param_groups");
  if (groups != index.metadata.end() &&
      groups->second.find('/') == std::string::npos) {
    out.insert(groups->second);
  }
  return out;
}

std::string random_tag() {
  std::random_device rd;
  std::mt19937_64 gen(
      rd() ^ static_cast<uint64_t>(::getpid()) ^
      static_cast<uint64_t>(
          std::chrono::steady_clock::now().time_since_epoch().count()));
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%08x", static_cast<unsigned>(gen()));
  return buf;
}

} // namespace

ShardedCommit::ShardedCommit(
    std::string dir,
    std::string index_name,
    std::string stem,
    int64_t max_bytes,
    std::string part_label)
    : dir_(std::move(dir)),
      index_name_(std::move(index_name)),
      stem_(std::move(stem)),
      label_(std::move(part_label)),
      max_bytes_(max_bytes),
      tag_(random_tag()) {
  TORCH_CHECK(
      !exists(dir_) || is_dir(dir_),
      "cannot save sharded checkpoint '",
      dir_,
      "': a file of that name exists");
  std::error_code ec;
  fs::create_directories(dir_, ec);
  TORCH_CHECK(
      is_dir(dir_),
      "cannot create checkpoint directory '",
      dir_,
      "': ",
      ec.message());
  if (label_.empty()) {
    recover();
  }
}

ShardedCommit::~ShardedCommit() {
  if (committed_) {
    return;
  }
  // Exactly the files this object owns: another writer's temporaries (of a
  // live process on another host, perhaps) are not ours to judge.
  std::error_code ec;
  for (const auto& p : parts_) {
    fs::remove(p.temp, ec);
  }
  for (const auto& e : extras_) {
    fs::remove(e.temp, ec);
  }
  if (label_.empty()) {
    remove_stale_temps(dir_, index_name_);
  }
}

void ShardedCommit::recover() {
  const auto journal = journal_path(dir_, index_name_);
  if (exists(journal)) {
    std::set<std::string> live;
    if (auto index = try_read_index(join(dir_, index_name_))) {
      live = owned_files(*index);
    }
    std::vector<std::string> listed;
    try {
      auto bytes = read_bytes(journal);
      auto j = nlohmann::json::parse(bytes.begin(), bytes.end());
      listed = j.at("files").get<std::vector<std::string>>();
    } catch (const std::exception&) {
      listed.clear(); // torn journals cannot exist (atomic); be safe anyway
    }
    std::error_code ec;
    for (const auto& f : listed) {
      if (!live.count(f) && f.find('/') == std::string::npos && f != "..") {
        fs::remove(join(dir_, f), ec);
      }
    }
    fs::remove(journal, ec);
  }
  remove_stale_temps(dir_, index_name_);
}

bool ShardedCommit::full(int64_t bytes) const {
  return current_ > 0 && current_ + bytes > max_bytes_;
}

void ShardedCommit::add(const std::string& key, int64_t bytes) {
  if (parts_.empty() || sealed_) {
    Part p;
    p.temp = temp_path(
        dir_, index_name_, label_ + "part" + std::to_string(parts_.size() + 1));
    parts_.push_back(std::move(p));
    sealed_ = false;
  }
  parts_.back().keys.push_back(key);
  parts_.back().bytes += bytes;
  current_ += bytes;
}

std::string ShardedCommit::seal() {
  TORCH_INTERNAL_ASSERT(pending(), "seal() without entries");
  if (parts_.size() > 1) {
    utils::fault_point("sharded:part_written"); // the previous part
  }
  sealed_ = true;
  current_ = 0;
  return parts_.back().temp;
}

bool ShardedCommit::pending() const {
  return !parts_.empty() && !sealed_;
}

std::vector<ShardedCommit::Part> ShardedCommit::hand_over() {
  TORCH_INTERNAL_ASSERT(!pending(), "hand_over() with an unsealed shard");
  TORCH_INTERNAL_ASSERT(extras_.empty(), "a part writer has no extras");
  for (const auto& p : parts_) {
    fsync_path(p.temp, false);
  }
  auto out = std::move(parts_);
  parts_.clear();
  return out;
}

void ShardedCommit::adopt(const std::vector<Part>& parts) {
  TORCH_INTERNAL_ASSERT(label_.empty(), "only the coordinator adopts parts");
  TORCH_INTERNAL_ASSERT(!pending(), "adopt() with an unsealed shard");
  parts_.insert(parts_.end(), parts.begin(), parts.end());
  sealed_ = true; // written by their owners
}

std::string ShardedCommit::extra(
    const std::string& name,
    const std::string& metadata_key) {
  extras_.push_back(
      {name,
       metadata_key,
       temp_path(dir_, index_name_, "extra" + std::to_string(extras_.size()))});
  return extras_.back().temp;
}

std::string ShardedCommit::free_name(
    const std::string& wanted,
    std::set<std::string>& taken) const {
  auto name = wanted;
  const auto dot = wanted.rfind('.');
  for (int attempt = 0; taken.count(name) || exists(join(dir_, name));
       ++attempt) {
    const auto tag = attempt == 0 ? tag_ : tag_ + "-" + std::to_string(attempt);
    name = wanted.substr(0, dot) + "." + tag + wanted.substr(dot);
  }
  taken.insert(name);
  return name;
}

void ShardedCommit::commit(Index index, const std::string& single) {
  TORCH_INTERNAL_ASSERT(label_.empty(), "a part writer does not commit");
  TORCH_INTERNAL_ASSERT(!pending(), "commit() with an unsealed shard");
  if (!parts_.empty()) {
    utils::fault_point("sharded:part_written"); // the last part
  }
  for (const auto& p : parts_) {
    fsync_path(p.temp, false);
  }
  for (const auto& e : extras_) {
    fsync_path(e.temp, false);
  }

  // Step 3: names no file has, so the live checkpoint stays intact.
  const auto index_path = join(dir_, index_name_);
  std::set<std::string> taken;
  const int n = static_cast<int>(parts_.size());
  std::vector<std::string> finals;
  for (int i = 0; i < n; ++i) {
    finals.push_back(free_name(
        n == 1 && !single.empty() ? single : shard_name(stem_, i + 1, n),
        taken));
  }
  std::vector<std::string> extra_finals;
  for (const auto& e : extras_) {
    extra_finals.push_back(free_name(e.name, taken));
  }
  std::set<std::string> retired;
  if (auto old = try_read_index(index_path)) {
    retired = owned_files(*old);
  }

  // Step 4: the journal names every file this save adds or retires.
  {
    nlohmann::json j;
    std::vector<std::string> files(taken.begin(), taken.end());
    files.insert(files.end(), retired.begin(), retired.end());
    j["files"] = files;
    const auto text = j.dump();
    const auto journal = journal_path(dir_, index_name_);
    const auto tmp = temp_path(dir_, index_name_, "journal");
    write_bytes(tmp, std::vector<char>(text.begin(), text.end()));
    fsync_path(tmp, false);
    rename_or_throw(tmp, journal);
    fsync_path(dir_, true);
  }
  utils::fault_point("sharded:journal");

  // Step 5.
  for (int i = 0; i < n; ++i) {
    rename_or_throw(parts_[i].temp, join(dir_, finals[i]));
    utils::fault_point("sharded:renamed");
    for (const auto& k : parts_[i].keys) {
      index.weight_map.emplace_back(k, finals[i]);
    }
    index.total_size += parts_[i].bytes;
  }
  for (size_t i = 0; i < extras_.size(); ++i) {
    rename_or_throw(extras_[i].temp, join(dir_, extra_finals[i]));
    utils::fault_point("sharded:renamed");
    index.metadata[extras_[i].metadata_key] = extra_finals[i];
  }
  fsync_path(dir_, true);

  // Step 6: the commit point.
  const auto tmp = temp_path(dir_, index_name_);
  write_index(tmp, index);
  fsync_path(tmp, false);
  utils::fault_point("sharded:index_written");
  rename_or_throw(tmp, index_path);
  committed_ = true;
  fsync_path(dir_, true);
  utils::fault_point("sharded:published");

  // Step 7.
  std::error_code ec;
  for (const auto& f : retired) {
    if (!taken.count(f)) {
      fs::remove(join(dir_, f), ec);
      utils::fault_point("sharded:retired");
    }
  }
  fs::remove(journal_path(dir_, index_name_), ec);
  fsync_path(dir_, true);
}

} // namespace detail
} // namespace checkpoint_io
} // namespace colossalai
