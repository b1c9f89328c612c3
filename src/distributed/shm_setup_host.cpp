// This host's processes, as the shared-memory set-up and channel read them
// from /proc: a process's identity (host, boot, namespaces), its state and
// start time; the memory it may use (the default shared-memory budget); and
// the bytes of segments this process maps.

#include "shm_channel.h"

#if defined(__linux__)

#include "shm_segment.h"
#include "shm_setup_internal.h"

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <fstream>
#include <optional>
#include <sstream>

namespace colossalai {
namespace distributed {
namespace detail {

std::atomic<int64_t>& mapped_segment_bytes() {
  static std::atomic<int64_t> bytes{0};
  return bytes;
}

std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

bool process_state(int pid, char* state, uint64_t* start_time) {
  const std::string s = read_line("/proc/" + std::to_string(pid) + "/stat");
  const auto close = s.rfind(')');
  if (close == std::string::npos) {
    return false;
  }
  std::istringstream is(s.substr(close + 2));
  std::string field;
  is >> *state;
  for (int i = 4; i < 22 && (is >> field); ++i) {
  }
  return static_cast<bool>(is >> *start_time);
}

namespace {

std::string read_link(const char* path) {
  char buf[256];
  ssize_t n = ::readlink(path, buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

} // namespace

// Equal on two processes when they share the host, its boot, and the IPC,
// PID and network namespaces (a peer's pid means the same process; ranks
// in separate network namespaces are kept apart as separate hosts).
std::string identity() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::string boot = read_line("/proc/sys/kernel/random/boot_id");
  const std::string ipc = read_link("/proc/self/ns/ipc");
  const std::string pid = read_link("/proc/self/ns/pid");
  const std::string net = read_link("/proc/self/ns/net");
  if (boot.empty() || ipc.empty() || pid.empty() || net.empty()) {
    return "unknown:" + std::to_string(::getpid()); // never shared
  }
  return std::string(host) + "|" + boot + "|" + ipc + "|" + pid + "|" + net;
}

bool process_alive(int pid) {
  char state = 0;
  uint64_t start = 0;
  return process_state(pid, &state, &start) && state != 'Z' && state != 'X';
}

namespace {

// A number from the first line of `path` (cgroup files: "max" is none).
std::optional<int64_t> read_number(const std::string& path) {
  const std::string s = read_line(path);
  if (s.empty() || !std::isdigit(static_cast<unsigned char>(s[0]))) {
    return std::nullopt;
  }
  return std::stoll(s);
}

} // namespace

int64_t ShmChannel::default_budget_bytes() {
  // MemAvailable, and what this process's cgroup (v2) still allows.
  int64_t available = INT64_MAX;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  while (meminfo >> key >> kb) {
    if (key == "MemAvailable:") {
      available = kb * 1024;
      break;
    }
    meminfo.ignore(INT_MAX, '\n');
  }
  const std::string cgroup = read_line("/proc/self/cgroup"); // "0::/path"
  if (cgroup.rfind("0::", 0) == 0) {
    const std::string dir = "/sys/fs/cgroup" + cgroup.substr(3);
    auto limit = read_number(dir + "/memory.max");
    auto used = read_number(dir + "/memory.current");
    if (limit && used) {
      available = std::min(available, std::max<int64_t>(*limit - *used, 0));
    }
  }
  if (available == INT64_MAX) {
    available = 4LL << 30; // unknown: as if 4 GiB were free
  }
  return std::min<int64_t>(available / 16, 256LL << 20);
}

} // namespace detail
} // namespace distributed
} // namespace colossalai

#endif
