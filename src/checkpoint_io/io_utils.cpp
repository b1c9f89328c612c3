#include "io_utils.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace fs = std::filesystem;

namespace colossalai {
namespace checkpoint_io {
namespace detail {

namespace {

void fsync_path(const std::string& path, bool directory) {
  int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) {
    return; // best effort: durability, not correctness
  }
  ::fsync(fd);
  ::close(fd);
}

std::string parent_of(const std::string& path) {
  auto parent = fs::path(path).parent_path();
  return parent.empty() ? "." : parent.string();
}

std::string temp_name(const std::string& path) {
  return path + ".tmp-" + std::to_string(::getpid());
}

} // namespace

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

void atomic_write_file(
    const std::string& path,
    const std::function<void(const std::string& tmp)>& write) {
  TORCH_CHECK(
      !is_dir(path),
      "cannot save '",
      path,
      "': a directory of that name exists (a sharded checkpoint?)");
  auto parent = parent_of(path);
  std::error_code ec;
  fs::create_directories(parent, ec);
  const auto tmp = temp_name(path);
  try {
    write(tmp);
    fsync_path(tmp, false);
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
  fsync_path(parent, true);
}

void atomic_write_dir(
    const std::string& dir,
    const std::function<void(const std::string& tmp_dir)>& write) {
  TORCH_CHECK(
      !exists(dir) || is_dir(dir),
      "cannot save sharded checkpoint '",
      dir,
      "': a file of that name exists");
  const auto tmp = temp_name(dir);
  std::error_code ec;
  fs::remove_all(tmp, ec);
  TORCH_CHECK(
      fs::create_directories(tmp, ec),
      "cannot create '",
      tmp,
      "': ",
      ec.message());
  try {
    write(tmp);
    for (const auto& entry : fs::directory_iterator(tmp)) {
      fsync_path(entry.path().string(), false);
    }
    fsync_path(tmp, true);
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  const auto old = dir + ".old";
  fs::remove_all(old, ec);
  if (exists(dir)) {
    TORCH_CHECK(
        ::rename(dir.c_str(), old.c_str()) == 0,
        "cannot move '",
        dir,
        "' aside: ",
        std::strerror(errno));
  }
  TORCH_CHECK(
      ::rename(tmp.c_str(), dir.c_str()) == 0,
      "cannot rename '",
      tmp,
      "' to '",
      dir,
      "': ",
      std::strerror(errno));
  fsync_path(parent_of(dir), true);
  fs::remove_all(old, ec);
}

std::string resolve(const std::string& path) {
  if (!exists(path) && exists(path + ".old")) {
    return path + ".old";
  }
  return path;
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
