#pragma once

// File-system helpers shared by the checkpoint IO classes (internal).

#include <colossalai/checkpoint_io/state_dict.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace colossalai {
namespace checkpoint_io {
namespace detail {

/// Writes `path` atomically: `write(tmp)` fills a temporary file beside it,
/// which is flushed to disk and renamed over `path`.
void atomic_write_file(
    const std::string& path,
    const std::function<void(const std::string& tmp)>& write);

/// Same for a directory: `write(tmp_dir)` fills a fresh temporary directory
/// that replaces `dir`. An existing `dir` is first renamed to `dir.old` and
/// removed after the swap; `resolve` falls back to it if a crash hit between
/// the two renames.
void atomic_write_dir(
    const std::string& dir,
    const std::function<void(const std::string& tmp_dir)>& write);

/// `path`, or `path.old` when only that survived an interrupted swap.
std::string resolve(const std::string& path);

/// "model.safetensors" + prefix "x" -> "model.x.safetensors".
std::string add_prefix(const std::string& name, const std::string& prefix);
/// "model.safetensors", 2, 5 -> "model-00002-of-00005.safetensors".
std::string shard_name(const std::string& name, int index, int total);

int64_t nbytes(const at::Tensor& t);

std::vector<char> read_bytes(const std::string& path);
void write_bytes(const std::string& path, const std::vector<char>& bytes);

/// Hugging Face / ColossalAI index: {"metadata": {...}, "weight_map": {...}}.
struct Index {
  int64_t total_size = 0;
  std::map<std::string, std::string> metadata; // extra string entries
  /// key -> shard file name, in insertion order.
  std::vector<std::pair<std::string, std::string>> weight_map;
};
void write_index(const std::string& path, const Index& index);
Index read_index(const std::string& path);

bool is_dir(const std::string& path);
bool exists(const std::string& path);
std::string join(const std::string& dir, const std::string& name);

} // namespace detail
} // namespace checkpoint_io
} // namespace colossalai
