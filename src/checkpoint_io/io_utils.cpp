#include "io_utils.h"

#include "../utils/fault_point.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace fs = std::filesystem;

namespace colossalai {
namespace checkpoint_io {
namespace detail {

namespace {

std::string parent_of(const std::string& path) {
  auto parent = fs::path(path).parent_path();
  return parent.empty() ? "." : parent.string();
}

bool process_alive(long pid) {
  return pid > 0 && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM);
}

} // namespace

void fsync_path(const std::string& path, bool directory) {
  int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) {
    return; // best effort: durability, not correctness
  }
  ::fsync(fd);
  ::close(fd);
}

bool is_dir(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec);
}

bool exists(const std::string& path) {
  std::error_code ec;
  return fs::exists(path, ec);
}

std::string join(const std::string& dir, const std::string& name) {
  return (fs::path(dir) / name).string();
}

std::string temp_path(
    const std::string& dir,
    const std::string& name,
    const std::string& what) {
  return join(
      dir,
      "." + name + "." + std::to_string(::getpid()) + "." + what +
          (what.empty() ? "" : ".") + "tmp");
}

bool is_hidden(const std::string& file_name) {
  return !file_name.empty() && file_name[0] == '.';
}

void remove_stale_temps(const std::string& dir, const std::string& name) {
  const std::string head = "." + name + ".";
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const auto file = e.path().filename().string();
    if (file.size() < head.size() + 4 || file.compare(0, head.size(), head) ||
        file.compare(file.size() - 4, 4, ".tmp")) {
      continue;
    }
    const long pid = std::strtol(file.c_str() + head.size(), nullptr, 10);
    if (pid == ::getpid() || !process_alive(pid)) {
      fs::remove(e.path(), ec);
    }
  }
}

void atomic_write_file(
    const std::string& path,
    const std::function<void(const std::string& tmp)>& write) {
  TORCH_CHECK(
      !is_dir(path),
      "cannot save '",
      path,
      "': a directory of that name exists (a sharded checkpoint?)");
  const auto parent = parent_of(path);
  const auto name = fs::path(path).filename().string();
  std::error_code ec;
  fs::create_directories(parent, ec);
  remove_stale_temps(parent, name);
  const auto tmp = temp_path(parent, name);
  try {
    write(tmp);
    fsync_path(tmp, false);
    utils::fault_point("file:written");
    TORCH_CHECK(
        ::rename(tmp.c_str(), path.c_str()) == 0,
        "cannot rename '",
        tmp,
        "' to '",
        path,
        "': ",
        std::strerror(errno));
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  utils::fault_point("file:renamed");
  fsync_path(parent, true);
}

std::string add_prefix(const std::string& name, const std::string& prefix) {
  if (prefix.empty()) {
    return name;
  }
  auto dot = name.rfind('.');
  return name.substr(0, dot) + "." + prefix + name.substr(dot);
}

std::string shard_name(const std::string& name, int index, int total) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "-%05d-of-%05d", index, total);
  auto dot = name.rfind('.');
  return name.substr(0, dot) + buf + name.substr(dot);
}

int64_t nbytes(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

std::vector<char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  TORCH_CHECK(in.good(), "cannot open '", path, "': ", std::strerror(errno));
  std::vector<char> bytes(static_cast<size_t>(in.tellg()));
  in.seekg(0);
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  TORCH_CHECK(in.good() || bytes.empty(), "cannot read '", path, "'");
  return bytes;
}

void write_bytes(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  TORCH_CHECK(out.good(), "cannot create '", path, "': ", std::strerror(errno));
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.flush();
  TORCH_CHECK(out.good(), "cannot write '", path, "': ", std::strerror(errno));
}

void write_index(const std::string& path, const Index& index) {
  nlohmann::ordered_json j;
  j["metadata"]["total_size"] = index.total_size;
  for (const auto& kv : index.metadata) {
    j["metadata"][kv.first] = kv.second;
  }
  j["weight_map"] = nlohmann::ordered_json::object();
  for (const auto& kv : index.weight_map) {
    j["weight_map"][kv.first] = kv.second;
  }
  auto text = j.dump(2);
  write_bytes(path, std::vector<char>(text.begin(), text.end()));
}

Index read_index(const std::string& path) {
  auto bytes = read_bytes(path);
  Index index;
  try {
    auto j = nlohmann::ordered_json::parse(bytes.begin(), bytes.end());
    const auto& meta = j.at("metadata");
    for (auto it = meta.begin(); it != meta.end(); ++it) {
      if (it.key() == "total_size") {
        index.total_size = it.value().get<int64_t>();
      } else if (it.value().is_string()) {
        index.metadata[it.key()] = it.value().get<std::string>();
      }
    }
    const auto& map = j.at("weight_map");
    for (auto it = map.begin(); it != map.end(); ++it) {
      auto file = it.value().get<std::string>();
      TORCH_CHECK(
          file.find('/') == std::string::npos && file != "..",
          "index '",
          path,
          "': shard file '",
          file,
          "' for key '",
          it.key(),
          "' must be a plain file name");
      index.weight_map.emplace_back(it.key(), file);
    }
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(
        false, "index file '", path, "' is not a valid index: ", e.what());
  }
  return index;
}

} // namespace detail
} // namespace checkpoint_io
} // namespace colossalai
