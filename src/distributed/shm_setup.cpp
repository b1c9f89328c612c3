#include "shm_channel.h"

// Setting up a group's shared-memory segment (ShmChannel::open) and its
// budget. See NOTE [Segments that cannot outlive their job].

#if defined(__linux__)

#include "../utils/fault_point.h"
#include "shm_segment.h"

#include <colossalai/distributed/error.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

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

std::vector<uint8_t> bytes_of(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

std::string string_of(const std::vector<uint8_t>& v) {
  return std::string(v.begin(), v.end());
}

// NOTE [Segments that cannot outlive their job]
// A named segment (shm_open in /dev/shm) outlives every process that dies
// before unlinking it: a rank killed while a group sets up leaves 8-32 MiB
// of memory behind until reboot. So the segment has no name: group
// rank 0 makes an anonymous memory file (memfd_create), reserves its pages,
// and hands the descriptor to each member over a Unix socket in the
// abstract namespace (SCM_RIGHTS, as torch.multiprocessing shares tensors).
// That socket has no file either and closes with its process; it answers
// only the group's members (the peer's pid and uid, SO_PEERCRED). The
// memory lives exactly as long as some member maps it, however the
// processes end. It is also not bounded by the size of the /dev/shm mount
// (64 MiB under Docker's default), only by the memory the processes may
// use: segments are sized to a per-process budget (NOTE [Shared-memory
// budget]).

// A mapping unmapped on every way out of open(), until a channel owns it.
struct Mapping {
  void* p = nullptr;
  size_t bytes = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    reset();
  }
  void reset() {
    if (p != nullptr) {
      ::munmap(p, bytes);
      p = nullptr;
    }
  }
  void* release() {
    void* q = p;
    p = nullptr;
    return q;
  }
};

struct Fd {
  int fd = -1;
  explicit Fd(int f = -1) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) {
      ::close(fd);
    }
  }
};

std::string errno_text(const char* what) {
  return std::string(what) + ": " + std::strerror(errno);
}

// The segment's memory file, its pages reserved (so a shortage gives an
// error here, not a SIGBUS later), mapped.
void* make_segment(size_t bytes, Fd* fd) {
  fd->fd = ::memfd_create("colossalai.shm", MFD_CLOEXEC);
  TORCH_CHECK(fd->fd >= 0, errno_text("memfd_create"));
  TORCH_CHECK(
      ::ftruncate(fd->fd, static_cast<off_t>(bytes)) == 0,
      errno_text("ftruncate"));
  if (int rc = ::posix_fallocate(fd->fd, 0, static_cast<off_t>(bytes))) {
    TORCH_CHECK(
        false,
        "reserving ",
        bytes >> 20,
        " MiB of shared memory: ",
        std::strerror(rc));
  }
  void* p =
      ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd->fd, 0);
  TORCH_CHECK(p != MAP_FAILED, errno_text("mmap"));
  return p;
}

void* map_received(int fd, size_t bytes) {
  struct stat st {};
  TORCH_CHECK(
      ::fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == bytes,
      "the received segment has an unexpected size");
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  TORCH_CHECK(p != MAP_FAILED, errno_text("mmap"));
  return p;
}

// An address in the abstract namespace: no file, gone with its socket.
socklen_t abstract_address(const std::string& name, sockaddr_un* addr) {
  TORCH_INTERNAL_ASSERT(name.size() + 1 < sizeof(addr->sun_path));
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  std::memcpy(addr->sun_path + 1, name.data(), name.size());
  return static_cast<socklen_t>(
      offsetof(sockaddr_un, sun_path) + 1 + name.size());
}

// A one-byte message with room for one descriptor (SCM_RIGHTS).
struct FdMessage {
  char byte = 's';
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  FdMessage() {
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
  }
  FdMessage(const FdMessage&) = delete; // points into itself
  FdMessage& operator=(const FdMessage&) = delete;
};

void send_fd(int sock, int fd) {
  FdMessage m;
  auto& msg = m.msg;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  TORCH_CHECK(
      ::sendmsg(sock, &msg, MSG_NOSIGNAL) == 1,
      errno_text("sending the segment"));
}

// Connects to `name` and receives the segment's descriptor (waits at most
// `timeout` for it).
int receive_fd(const std::string& name, std::chrono::milliseconds timeout) {
  Fd sock(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  TORCH_CHECK(sock.fd >= 0, errno_text("socket"));
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>(timeout.count() % 1000 * 1000);
  ::setsockopt(sock.fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_un addr{};
  const socklen_t len = abstract_address(name, &addr);
  TORCH_CHECK(
      ::connect(sock.fd, reinterpret_cast<sockaddr*>(&addr), len) == 0,
      errno_text("connecting to group rank 0 for the segment"));
  FdMessage m;
  auto& msg = m.msg;
  const ssize_t n = ::recvmsg(sock.fd, &msg, MSG_CMSG_CLOEXEC);
  TORCH_CHECK(
      n == 1, n < 0 ? errno_text("receiving the segment") : "rank 0 hung up");
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  TORCH_CHECK(
      c != nullptr && c->cmsg_level == SOL_SOCKET &&
          c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(sizeof(int)),
      "rank 0 sent no descriptor");
  int fd = -1;
  std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
  return fd;
}

// Lines of a store value: identity, pid, budget.
std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream is(s);
  std::string line;
  while (std::getline(is, line)) {
    out.push_back(line);
  }
  return out;
}

bool process_alive(int pid) {
  char state = 0;
  uint64_t start = 0;
  return process_state(pid, &state, &start) && state != 'Z' && state != 'X';
}

// The value of `key`, which group rank `q` (process `pid`) writes: fails as
// soon as that process has exited (all members run on this host), not only
// at the timeout.
std::string await_key(
    ::c10d::Store& store,
    const std::string& key,
    int q,
    int pid,
    std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto check = [&] {
    try {
      return store.check({key});
    } catch (const std::exception& e) {
      // The store lives in global rank 0's process.
      TORCH_CHECK(
          false, "lost the rendezvous store (global rank 0): ", error_text(e));
    }
  };
  while (!check()) {
    TORCH_CHECK(
        process_alive(pid),
        "group rank ",
        q,
        " (pid ",
        pid,
        ") exited while the group set up its shared memory");
    TORCH_CHECK(
        std::chrono::steady_clock::now() < deadline,
        "waited ",
        timeout.count(),
        " ms for group rank ",
        q,
        " (pid ",
        pid,
        ") to set up the group's shared memory");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return string_of(store.get(key));
}

std::string mib(int64_t bytes) {
  std::ostringstream os;
  os.precision(3);
  if (bytes < (1 << 20)) {
    os << static_cast<double>(bytes) / 1024 << " KiB";
  } else {
    os << static_cast<double>(bytes) / (1 << 20) << " MiB";
  }
  return os.str();
}

} // namespace

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

// NOTE [Shared-memory budget]
// Two buffers of one slot per rank: up to 2 MiB a slot (a piece then costs
// far more to copy than its three phase changes), at most 16 MiB in all up
// to 32 ranks (8 MiB for 2). A hybrid mesh makes many groups, and each
// member maps every segment of its groups, so each process keeps its
// segments within a budget (LaunchOptions::shm_budget_mb; by default 1/16
// of the memory it may use, at most 256 MiB). Every member publishes what
// is left of its budget; all take the smallest, so they agree on the size
// without another round: slots shrink to fit, down to 64 KiB, and below
// that the group stays on Gloo and says why.

std::shared_ptr<ShmChannel> ShmChannel::open(
    ::c10d::Store& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    int64_t budget_bytes,
    std::string* why) {
  TORCH_INTERNAL_ASSERT(size > 1 && rank >= 0 && rank < size && why);
  const std::string me = identity();
  const int64_t left =
      std::max<int64_t>(budget_bytes - mapped_segment_bytes().load(), 0);
  store.set(
      "shm/id/" + std::to_string(rank),
      bytes_of(
          me + "\n" + std::to_string(::getpid()) + "\n" +
          std::to_string(left)));
  std::vector<int> pids(size);
  int64_t smallest = INT64_MAX;
  int poorest = 0; // the first member with the least left: the same on all
  for (int q = 0; q < size; ++q) {
    const auto v =
        split_lines(string_of(store.get("shm/id/" + std::to_string(q))));
    TORCH_INTERNAL_ASSERT(v.size() == 3);
    if (v[0] != me) {
      *why = "its members run on more than one host";
      return nullptr; // every member sees the same ids
    }
    pids[q] = std::stoi(v[1]);
    if (std::stoll(v[2]) < smallest) {
      smallest = std::stoll(v[2]);
      poorest = q;
    }
  }
  const int64_t fixed = data_offset(size);
  constexpr int64_t kMinSlot = 64 << 10;
  int64_t slot = std::clamp<int64_t>(
      (16LL << 20) / (2 * size) / kPage * kPage, 256 << 10, 2 << 20);
  if (fixed + 2 * size * slot > smallest) {
    slot = std::max<int64_t>(smallest - fixed, 0) / (2 * size) / kPage * kPage;
  }
  if (slot < kMinSlot) {
    std::ostringstream os;
    os << "the shared-memory budget is spent: group rank " << poorest << " has "
       << mib(smallest) << " left, a segment needs "
       << mib(fixed + 2 * size * kMinSlot)
       << " (raise LaunchOptions::shm_budget_mb or COLOSSALAI_SHM_BUDGET_MB)";
    *why = os.str();
    return nullptr;
  }
  const size_t bytes = static_cast<size_t>(fixed + 2 * size * slot);

  Mapping base;
  base.bytes = bytes;
  std::string failure;
  if (rank == 0) {
    static std::atomic<int> counter{0};
    Fd segment, listener;
    std::string name;
    try {
      base.p = make_segment(bytes, &segment);
      auto* h = static_cast<Header*>(base.p);
      h->magic = kMagic;
      h->size = static_cast<uint64_t>(size);
      h->slot_bytes = static_cast<uint64_t>(slot);
      utils::fault_point("shm:created");
      std::ostringstream os;
      os << "colossalai." << ::getpid() << "." << counter++ << "." << std::hex
         << std::random_device()();
      name = os.str();
      listener.fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      TORCH_CHECK(listener.fd >= 0, errno_text("socket"));
      sockaddr_un addr{};
      const socklen_t len = abstract_address(name, &addr);
      TORCH_CHECK(
          ::bind(listener.fd, reinterpret_cast<sockaddr*>(&addr), len) == 0 &&
              ::listen(listener.fd, size) == 0,
          errno_text("listening for the group's members"));
    } catch (const std::exception& e) {
      failure = error_text(e);
      name.clear();
    }
    store.set("shm/name", bytes_of(name));
    if (!name.empty()) {
      utils::fault_point("shm:serving");
      // Hands the descriptor to each member that asks, until every member
      // has it or has reported that it gave up (then it never asks).
      std::vector<bool> done(size, false);
      done[0] = true;
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      for (;;) {
        int waiting = 0;
        for (int q = 1; q < size; ++q) {
          if (!done[q] && store.check({"shm/ok/" + std::to_string(q)})) {
            done[q] = true; // answered without asking: it could not connect
          }
          TORCH_CHECK(
              done[q] || process_alive(pids[q]),
              "group rank ",
              q,
              " (pid ",
              pids[q],
              ") exited before it fetched the shared-memory segment");
          waiting += done[q] ? 0 : 1;
        }
        if (waiting == 0) {
          break;
        }
        if (std::chrono::steady_clock::now() > deadline) {
          TORCH_CHECK(
              false,
              waiting,
              " member(s) did not fetch the shared-memory segment within ",
              timeout.count(),
              " ms");
        }
        pollfd p{listener.fd, POLLIN, 0};
        if (::poll(&p, 1, 50) <= 0) {
          continue;
        }
        Fd conn(::accept4(listener.fd, nullptr, nullptr, SOCK_CLOEXEC));
        ucred cred{};
        socklen_t cred_len = sizeof(cred);
        if (conn.fd < 0 ||
            ::getsockopt(conn.fd, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) !=
                0 ||
            cred.uid != ::getuid()) {
          continue;
        }
        const auto member = std::find(pids.begin() + 1, pids.end(), cred.pid);
        if (member == pids.end() || done[member - pids.begin()]) {
          continue; // not a member (or asking twice): no descriptor
        }
        try {
          send_fd(conn.fd, segment.fd);
          done[member - pids.begin()] = true;
        } catch (const std::exception&) {
          // It hung up; it reports that through the store.
        }
      }
    }
  } else {
    const std::string name = await_key(store, "shm/name", 0, pids[0], timeout);
    if (name.empty()) {
      failure = "group rank 0 could not make the segment";
    } else {
      try {
        Fd segment(receive_fd(name, timeout));
        utils::fault_point("shm:received");
        base.p = map_received(segment.fd, bytes);
        const auto* h = static_cast<const Header*>(base.p);
        TORCH_CHECK(
            h->magic == kMagic && h->size == static_cast<uint64_t>(size) &&
                h->slot_bytes == static_cast<uint64_t>(slot),
            "the segment's header does not match this group");
      } catch (const std::exception& e) {
        failure = error_text(e);
        base.reset();
      }
    }
  }
  // This rank's process, for the peers' liveness checks.
  if (base.p != nullptr) {
    auto* flag =
        reinterpret_cast<Flag*>(static_cast<uint8_t*>(base.p) + 64) + rank;
    char state = 0;
    uint64_t start = 0;
    process_state(::getpid(), &state, &start);
    flag->pid = ::getpid();
    flag->start_time = start;
    utils::fault_point("shm:mapped");
  }
  // Rank 0 decides from every member's report; a failure names its rank.
  std::string verdict;
  if (rank == 0) {
    verdict = failure.empty() ? "" : "group rank 0: " + failure;
    for (int q = 1; q < size; ++q) {
      const std::string ok =
          await_key(store, "shm/ok/" + std::to_string(q), q, pids[q], timeout);
      if (ok != "1" && verdict.empty()) {
        verdict = "group rank " + std::to_string(q) + ": " + ok;
      }
    }
    store.set("shm/use", bytes_of(verdict.empty() ? "1" : verdict));
  } else {
    store.set(
        "shm/ok/" + std::to_string(rank),
        bytes_of(failure.empty() ? "1" : failure));
    verdict = await_key(store, "shm/use", 0, pids[0], timeout);
    if (verdict == "1") {
      verdict.clear();
    }
  }
  if (!verdict.empty()) {
    *why = "a member could not map the segment (" + verdict + ")";
    return nullptr;
  }
  *why = "all " + std::to_string(size) + " members run on this host; " +
      mib(static_cast<int64_t>(bytes)) + " segment";
  return std::shared_ptr<ShmChannel>(
      new ShmChannel(base.release(), bytes, rank, size, slot, timeout));
}

} // namespace detail
} // namespace distributed
} // namespace colossalai

#else // !__linux__: no memfd; every group stays on its backend.

namespace colossalai {
namespace distributed {
namespace detail {

std::shared_ptr<ShmChannel> ShmChannel::open(
    ::c10d::Store&,
    int,
    int,
    std::chrono::milliseconds,
    int64_t,
    std::string* why) {
  *why = "shared-memory collectives are built only on Linux";
  return nullptr;
}

int64_t ShmChannel::default_budget_bytes() {
  return 0;
}

} // namespace detail
} // namespace distributed
} // namespace colossalai

#endif
