#include <colossalai/checkpoint_io/io_utils.h>

#include "../utils/bounded_json.h"
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

int open_regular(const std::string& path, int64_t* size) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a
  // writer, before any check could refuse it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot open '", path, "': ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    TORCH_CHECK(false, "cannot open '", path, "': not a regular file");
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  if (size != nullptr) {
    *size = static_cast<int64_t>(st.st_size);
  }
  return fd;
}

std::vector<char> read_bytes(
    const std::string& path,
    int64_t max_bytes,
    const char* what) {
  int64_t size = 0;
  const int fd = open_regular(path, &size);
  struct Closer {
    int fd;
    ~Closer() {
      ::close(fd);
    }
  } closer{fd};
  auto too_large = [&](int64_t bytes) {
    TORCH_CHECK(
        bytes <= max_bytes,
        "'",
        path,
        "' has ",
        bytes,
        " bytes or more, above the ",
        max_bytes,
        "-byte limit of a ",
        what);
  };
  too_large(size);
  // Read to the end, not to the size seen: the file may have grown since.
  std::vector<char> bytes;
  bytes.reserve(static_cast<size_t>(size));
  char chunk[1 << 16];
  while (true) {
    const ssize_t got = ::read(fd, chunk, sizeof(chunk));
    if (got < 0 && errno == EINTR) {
      continue;
    }
    TORCH_CHECK(got >= 0, "cannot read '", path, "': ", std::strerror(errno));
    if (got == 0) {
      return bytes;
    }
    too_large(static_cast<int64_t>(bytes.size()) + got);
    bytes.insert(bytes.end(), chunk, chunk + got);
  }
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
  const auto bytes = read_bytes(path, kMaxJsonFileBytes, "checkpoint index");
  const auto j = utils::parse_bounded_json<nlohmann::ordered_json>(
      std::string(bytes.begin(), bytes.end()), "index '" + path + "'");
  auto field = [&](const nlohmann::ordered_json& parent,
                   const char* key) -> const nlohmann::ordered_json& {
    TORCH_CHECK(
        parent.contains(key) && parent[key].is_object(),
        "index '",
        path,
        "': field '",
        key,
        "' must be an object",
        parent.contains(key) ? ", got " + utils::json_excerpt(parent[key])
                             : std::string(" (it is missing)"));
    return parent[key];
  };
  TORCH_CHECK(j.is_object(), "index '", path, "' is not a JSON object");
  Index index;
  // metadata is optional (transformers reads only weight_map).
  static const nlohmann::ordered_json kNone = nlohmann::ordered_json::object();
  const auto& meta = j.contains("metadata") ? field(j, "metadata") : kNone;
  for (auto it = meta.begin(); it != meta.end(); ++it) {
    if (it.key() == "total_size") {
      // transformers writes an integer; some tools a float of one.
      const auto& v = it.value();
      const double size = v.is_number() ? v.get<double>() : -1;
      TORCH_CHECK(
          size >= 0 && size < 9e18,
          "index '",
          path,
          "': field 'metadata.total_size' must be a non-negative number of "
          "bytes, got ",
          utils::json_excerpt(v));
      index.total_size =
          v.is_number_float() ? static_cast<int64_t>(size) : v.get<int64_t>();
    } else if (it.value().is_string()) {
      index.metadata[it.key()] = it.value().get<std::string>();
    }
  }
  const auto& map = field(j, "weight_map");
  for (auto it = map.begin(); it != map.end(); ++it) {
    TORCH_CHECK(
        it.value().is_string(),
        "index '",
        path,
        "': weight_map entry '",
        it.key(),
        "' must be a file name, got ",
        utils::json_excerpt(it.value()));
    auto file = it.value().get<std::string>();
    TORCH_CHECK(
        !file.empty() && file.find('/') == std::string::npos && file != "." &&
            file != "..",
        "index '",
        path,
        "': shard file '",
        file,
        "' for key '",
        it.key(),
        "' must be a plain file name");
    index.weight_map.emplace_back(it.key(), file);
  }
  return index;
}

} // namespace detail
} // namespace checkpoint_io
} // namespace colossalai
