#pragma once

/// File helpers of checkpoint IO: atomic writes, Hugging Face indexes, reads
/// of regular files with a bound. For what builds on checkpoint IO (plugins'
/// checkpoint IO, LoRA adapters, models' from_pretrained); not part of the
/// Booster API.

#include <colossalai/checkpoint_io/state_dict.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace colossalai {
namespace checkpoint_io {
namespace detail {

/// Writes `path` atomically: `write(tmp)` fills a hidden temporary file
/// beside it (".<name>.<pid>.tmp"), which is flushed to disk and renamed over
/// `path`. Temporaries left by killed saves of the same path are removed
/// first.
void atomic_write_file(
    const std::string& path,
    const std::function<void(const std::string& tmp)>& write);

/// The hidden temporary name ".<name>.<pid>.<what>tmp" of `name` in `dir`.
std::string temp_path(
    const std::string& dir,
    const std::string& name,
    const std::string& what = "");
/// Removes temporaries of `name` in `dir` whose process is gone (a save
/// killed mid-way) or is this one (a save that failed).
void remove_stale_temps(const std::string& dir, const std::string& name);
/// Whether a directory entry is a temporary or hidden file that loads skip.
bool is_hidden(const std::string& file_name);

/// Flushes a file or directory entry to disk (best effort).
void fsync_path(const std::string& path, bool directory);

/// "model.safetensors" + prefix "x" -> "model.x.safetensors".
std::string add_prefix(const std::string& name, const std::string& prefix);
/// "model.safetensors", 2, 5 -> "model-00002-of-00005.safetensors".
std::string shard_name(const std::string& name, int index, int total);

int64_t nbytes(const at::Tensor& t);

/// Opens `path` for reading when it is a regular file; anything else (a
/// FIFO, a device such as /dev/zero, a directory) is refused naming it,
/// without blocking: a FIFO is opened non-blocking and checked before any
/// read. Returns the descriptor (blocking again, close-on-exec); `size`, when
/// given, receives the file's size.
int open_regular(const std::string& path, int64_t* size = nullptr);

/// The bytes of the regular file `path`; a file above `max_bytes` is refused
/// naming it and both sizes (`what` says what the file is for the message).
std::vector<char> read_bytes(
    const std::string& path,
    int64_t max_bytes = INT64_MAX,
    const char* what = "file");
/// Most bytes a JSON file read from a user (config.json, an index, an
/// adapter config) may have: far above any real one, it keeps a file linked
/// to something huge from being read whole.
constexpr int64_t kMaxJsonFileBytes = int64_t(64) << 20;
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
