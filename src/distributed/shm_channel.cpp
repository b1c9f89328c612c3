#include "shm_channel.h"

#if defined(__linux__)

#include "../utils/fault_point.h"
#include "local_reduce.h"

#include <colossalai/distributed/error.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <random>
#include <sstream>

// NOTE [Shared-memory collectives]
// Gloo moves every byte through a TCP socket, also between two processes
// on one host: the kernel copies it into the socket and out again, and its
// threads take CPU from the ranks' compute (a 16 MB all-reduce on two
// ranks takes about 18 ms on an idle 2-core machine). When every member of
// a Gloo group runs on one host, the group maps one shared segment and its
// collectives (all-reduce, reduce-scatter, all-gather, broadcast,
// all-to-all, barrier) run through it instead, as MPI and oneCCL do on a
// node:
//  * each rank owns one slot in each of two buffers; an operation goes in
//    slot-sized pieces, alternating buffers, so a rank can fill the next
//    piece while slower ranks still read the previous one;
//  * all-reduce of a piece: every rank copies its piece into its slot;
//    rank r sums part r of the piece over all slots (in rank order, so
//    every rank's result has the same bits) into slot 0; every rank copies
//    slot 0 out. Reduce-scatter stops after the sum, written straight into
//    the output; all-gather copies slots out;
//  * ranks advance through numbered phases: each rank publishes the last
//    phase it finished in its own counter and waits on the others' with a
//    futex (a short spin first), so a waiting rank burns no CPU that a
//    rank still computing needs;
//  * a wait checks the peer's process every 100 ms and gives up at the
//    group timeout, naming the peer; after an error every later operation
//    on the channel fails with it;
//  * operations run on the channel's own thread in call order, like Gloo's
//    work queue, so they overlap the caller's compute.
// The segment has no name, so nothing is left behind whatever way the
// processes end (NOTE [Segments that cannot outlive their job]). Barriers
// are one phase of the segment. Sends and receives stay on Gloo, unordered
// with collectives as in c10d; gathers run on Gloo in the group's one
// order (NOTE [One order per group]).

namespace colossalai {
namespace distributed {
namespace detail {

struct ShmChannel::Flag {
  std::atomic<uint32_t> phase;
  std::atomic<uint32_t> waiters;
  int32_t pid;
  uint32_t unused;
  uint64_t start_time; // of the process, in clock ticks since boot
  char pad[40];
};

namespace {

static_assert(
    sizeof(std::atomic<uint32_t>) == sizeof(uint32_t),
    "futex words are 32-bit");

constexpr uint64_t kMagic = 0x636f6c6f7373686dULL; // "colosshm"
constexpr int64_t kPage = 4096;
constexpr auto kPoll = std::chrono::milliseconds(100);

// Header, then one 64-byte flag per rank; the slots start on the next page.
int64_t data_offset(int size) {
  return (64 + 64 * static_cast<int64_t>(size) + kPage - 1) / kPage * kPage;
}

struct Header {
  uint64_t magic;
  uint64_t size;
  uint64_t slot_bytes;
};

std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

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

// Process state and start time (fields 3 and 22 of /proc/<pid>/stat).
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

std::vector<uint8_t> bytes_of(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

std::string string_of(const std::vector<uint8_t>& v) {
  return std::string(v.begin(), v.end());
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, timespec* t) {
  return ::syscall(
      SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, t, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

at::Tensor view(uint8_t* p, int64_t numel, at::ScalarType dtype) {
  return at::from_blob(p, {numel}, at::TensorOptions().dtype(dtype));
}

// Where each rank's shard starts in the whole tensor (prefix sums).
std::vector<int64_t> offsets_of(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> offset(sizes.size() + 1, 0);
  for (size_t q = 0; q < sizes.size(); ++q) {
    offset[q + 1] = offset[q] + sizes[q];
  }
  return offset;
}

int64_t clamp_len(int64_t size, int64_t at, int64_t piece) {
  return std::clamp<int64_t>(size - at, 0, piece);
}

// NOTE [Streaming copies out of the segment]
// All-gather and broadcast copy pieces out of the (cache-resident) segment
// into the output. Ordinary stores first read every destination line from
// memory (read for ownership); non-temporal stores write around the cache.
// Measured on 2 ranks in alternation: a 64 MB broadcast took 6.8-7.6
// against 14.0-14.7 ms, a 256 MB all-gather 45-46 against 65-73 ms. They
// also leave the result out of the cache, which a reader of a small result
// would miss, so only operations of at least kStreamBytes stream. At that
// size the miss did not show: 2 ranks, an all-gather followed at once by a
// sum over the whole result, 3 alternated runs, streamed vs ordinary
// stores: 16 MB 3.1-4.3 vs 4.1-4.8 ms, 32 MB 8.1-8.9 vs 8.4-9.2 ms (the sum
// alone 1.0-1.3 vs 1.1-1.4 ms at 16 MB). The all-reduce's copy-out gained
// nothing measurable (64 MB: 16.0-18.8 against 14.5-17.0 ms) and a
// reduce-scatter summed in a cached piece and streamed out lost (11.0-12.6
// against 9.2-10.8 ms): both keep ordinary stores. The fence makes the stores
// visible before the operation reports completion or signals a peer.
constexpr int64_t kStreamBytes = 16 << 20;

void copy_out(uint8_t* dst, const uint8_t* src, size_t n, bool stream) {
#if defined(__SSE2__)
  if (stream) {
    const size_t head =
        std::min(n, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
    std::memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
      const auto* s = reinterpret_cast<const __m128i*>(src + i);
      auto* d = reinterpret_cast<__m128i*>(dst + i);
      const __m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1),
                    c = _mm_loadu_si128(s + 2), e = _mm_loadu_si128(s + 3);
      _mm_stream_si128(d, a);
      _mm_stream_si128(d + 1, b);
      _mm_stream_si128(d + 2, c);
      _mm_stream_si128(d + 3, e);
    }
    std::memcpy(dst + i, src + i, n - i);
    _mm_sfence();
    return;
  }
#endif
  (void)stream;
  std::memcpy(dst, src, n);
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

std::atomic<int64_t> g_mapped{0};

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
  const int64_t left = std::max<int64_t>(budget_bytes - g_mapped.load(), 0);
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

ShmChannel::ShmChannel(
    void* base,
    size_t bytes,
    int rank,
    int size,
    int64_t slot_bytes,
    std::chrono::milliseconds timeout)
    : base_(base),
      bytes_(bytes),
      rank_(rank),
      size_(size),
      slot_bytes_(slot_bytes),
      timeout_(timeout) {
  static_assert(sizeof(Flag) == 64, "one flag per cache line");
  auto* b = static_cast<uint8_t*>(base);
  flags_ = reinterpret_cast<Flag*>(b + 64);
  data_ = b + data_offset(size);
  g_mapped += static_cast<int64_t>(bytes);
  thread_ = std::thread([this] { worker(); });
}

ShmChannel::~ShmChannel() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) {
    thread_.join();
  }
  ::munmap(base_, bytes_);
  g_mapped -= static_cast<int64_t>(bytes_);
}

bool ShmChannel::carries(const at::Tensor& t, bool reduces) {
  if (!t.device().is_cpu() || t.is_sparse()) {
    return false;
  }
  return !reduces || at::isFloatingType(t.scalar_type()) ||
      at::isIntegralType(t.scalar_type(), /*includeBool=*/false);
}

std::shared_future<void> ShmChannel::enqueue(std::function<void()> fn) {
  std::packaged_task<void()> task([this, fn = std::move(fn)] {
    if (!broken_.empty()) {
      throw std::runtime_error(broken_);
    }
    try {
      fn();
    } catch (const std::exception& e) {
      broken_ = error_text(e);
      throw;
    }
  });
  auto future = task.get_future().share();
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
  return future;
}

void ShmChannel::worker() {
  // The local sums write into callers' tensors, never into autograd graphs.
  at::NoGradGuard no_grad;
  for (;;) {
    std::packaged_task<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) {
        return;
      }
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task(); // errors land in the task's future
  }
}

uint8_t* ShmChannel::slot(int buffer, int rank) const {
  return data_ + (static_cast<int64_t>(buffer) * size_ + rank) * slot_bytes_;
}

void ShmChannel::signal() {
  Flag& f = flags_[rank_];
  f.phase.store(++phase_, std::memory_order_seq_cst);
  if (f.waiters.load(std::memory_order_seq_cst) > 0) {
    futex(&f.phase, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

bool ShmChannel::alive(int peer) const {
  const Flag& f = flags_[peer];
  char state = 0;
  uint64_t start = 0;
  if (!process_state(f.pid, &state, &start)) {
    return false;
  }
  return state != 'Z' && state != 'X' && start == f.start_time;
}

void ShmChannel::wait_one(int peer, uint32_t phase) {
  Flag& f = flags_[peer];
  auto reached = [&] {
    return static_cast<int32_t>(
               f.phase.load(std::memory_order_acquire) - phase) >= 0;
  };
  for (int i = 0; i < 256; ++i) {
    if (reached()) {
      return;
    }
    cpu_relax();
  }
  const auto start = std::chrono::steady_clock::now();
  auto checked = start;
  for (;;) {
    // Counted as a waiter before the last look, so a signal after it wakes us.
    f.waiters.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = f.phase.load(std::memory_order_seq_cst);
    if (static_cast<int32_t>(seen - phase) < 0) {
      timespec t{0, 20 * 1000 * 1000};
      futex(&f.phase, FUTEX_WAIT, seen, &t);
    }
    f.waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (reached()) {
      return;
    }
    TORCH_CHECK(!stopping_, "the group is being destroyed");
    const auto now = std::chrono::steady_clock::now();
    if (now - checked >= kPoll) {
      checked = now;
      TORCH_CHECK(
          alive(peer),
          "group rank ",
          peer,
          " (pid ",
          f.pid,
          ") exited during a shared-memory collective");
    }
    TORCH_CHECK(
        now - start < timeout_,
        "waited ",
        timeout_.count(),
        " ms for group rank ",
        peer,
        " (pid ",
        f.pid,
        ") in a shared-memory collective");
  }
}

void ShmChannel::wait_all(uint32_t phase) {
  for (int q = 0; q < size_; ++q) {
    if (q != rank_) {
      wait_one(q, phase);
    }
  }
}

int ShmChannel::take_buffer() {
  const int b = next_buffer_;
  next_buffer_ ^= 1;
  wait_all(read_done_[b]);
  return b;
}

void ShmChannel::run_all_reduce(const at::Tensor& t, ReduceOp op) {
  const auto dtype = t.scalar_type();
  const int64_t es = t.element_size();
  const int64_t piece = slot_bytes_ / es;
  const int64_t numel = t.numel();
  auto* p = static_cast<uint8_t*>(t.data_ptr());
  std::vector<at::Tensor> srcs(size_);
  for (int64_t at = 0; at < numel; at += piece) {
    const int64_t len = std::min(piece, numel - at);
    const int b = take_buffer();
    std::memcpy(slot(b, rank_), p + at * es, len * es);
    signal();
    wait_all(phase_);
    const auto part = shard_range(len, size_, rank_);
    if (part.second > part.first) {
      for (int q = 0; q < size_; ++q) {
        srcs[q] =
            view(slot(b, q) + part.first * es, part.second - part.first, dtype);
      }
      reduce_into(srcs[0], srcs, op, &scratch_);
    }
    signal();
    wait_all(phase_);
    std::memcpy(p + at * es, slot(b, 0), len * es);
    signal();
    read_done_[b] = phase_;
  }
}

void ShmChannel::run_reduce_scatter(
    const at::Tensor& out,
    const at::Tensor& in,
    const std::vector<int64_t>& sizes,
    ReduceOp op) {
  const auto dtype = in.scalar_type();
  const int64_t es = in.element_size();
  // Slot layout: one piece per destination rank.
  const int64_t piece = std::max<int64_t>(slot_bytes_ / es / size_, 1);
  const auto offset = offsets_of(sizes);
  const int64_t longest = *std::max_element(sizes.begin(), sizes.end());
  auto* src = static_cast<uint8_t*>(in.data_ptr());
  std::vector<at::Tensor> srcs(size_);
  for (int64_t at = 0; at < longest; at += piece) {
    const int b = take_buffer();
    uint8_t* mine = slot(b, rank_);
    for (int q = 0; q < size_; ++q) {
      const int64_t len = clamp_len(sizes[q], at, piece);
      // The own piece is read from the input: no peer reads it.
      if (q != rank_ && len > 0) {
        std::memcpy(
            mine + q * piece * es, src + (offset[q] + at) * es, len * es);
      }
    }
    signal();
    wait_all(phase_);
    const int64_t len = clamp_len(sizes[rank_], at, piece);
    if (len > 0) {
      for (int q = 0; q < size_; ++q) {
        srcs[q] = q == rank_
            ? view(src + (offset[rank_] + at) * es, len, dtype)
            : view(slot(b, q) + rank_ * piece * es, len, dtype);
      }
      reduce_into(out.narrow(0, at, len), srcs, op, &scratch_);
    }
    signal();
    read_done_[b] = phase_;
  }
}

void ShmChannel::run_all_gather(
    const at::Tensor& out,
    const at::Tensor& in,
    const std::vector<int64_t>& sizes) {
  const int64_t es = out.element_size();
  const int64_t piece = slot_bytes_ / es;
  const auto offset = offsets_of(sizes);
  const int64_t longest = *std::max_element(sizes.begin(), sizes.end());
  auto* src = static_cast<uint8_t*>(in.data_ptr());
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  const bool stream = out.numel() * es >= kStreamBytes;
  for (int64_t at = 0; at < longest; at += piece) {
    const int b = take_buffer();
    const int64_t mine = clamp_len(sizes[rank_], at, piece);
    if (mine > 0) {
      std::memcpy(slot(b, rank_), src + at * es, mine * es);
    }
    signal();
    wait_all(phase_);
    for (int q = 0; q < size_; ++q) {
      const int64_t len = clamp_len(sizes[q], at, piece);
      uint8_t* to = dst + (offset[q] + at) * es;
      if (len <= 0) {
        continue;
      }
      if (q != rank_) {
        copy_out(to, slot(b, q), len * es, stream);
      } else if (to != src + at * es) {
        std::memmove(to, src + at * es, len * es); // may overlap the input
      }
    }
    signal();
    read_done_[b] = phase_;
  }
}

void ShmChannel::run_broadcast(const at::Tensor& t, int src) {
  const int64_t bytes = t.numel() * t.element_size();
  auto* p = static_cast<uint8_t*>(t.data_ptr());
  const bool stream = bytes >= kStreamBytes;
  for (int64_t at = 0; at < bytes; at += slot_bytes_) {
    const int64_t len = std::min(slot_bytes_, bytes - at);
    const int b = take_buffer();
    if (rank_ == src) {
      std::memcpy(slot(b, src), p + at, len);
    }
    signal();
    wait_one(src, phase_);
    if (rank_ != src) {
      copy_out(p + at, slot(b, src), len, stream);
    }
    signal();
    read_done_[b] = phase_;
  }
}

// All-to-all in rounds: each slot holds one piece per destination rank;
// round k moves bytes [k * piece, (k + 1) * piece) of every block. Ranks
// know only their own blocks' lengths, so a first phase shares them: the
// longest block sets the number of rounds.
void ShmChannel::run_all_to_all(
    const at::Tensor& out,
    const at::Tensor& in,
    const std::vector<int64_t>& send_bytes,
    const std::vector<int64_t>& recv_bytes) {
  const int64_t piece = slot_bytes_ / size_ / 64 * 64;
  TORCH_INTERNAL_ASSERT(piece > 0);
  const auto send_at = offsets_of(send_bytes);
  const auto recv_at = offsets_of(recv_bytes);
  auto* src = static_cast<uint8_t*>(in.data_ptr());
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  // Every rank's lengths: the longest block sets the number of rounds, and
  // every rank checks every pair, so all fail alike when a sender and its
  // receiver disagree (none is left waiting for the others).
  int64_t longest = 0;
  {
    const int b = take_buffer();
    const size_t row = size_ * sizeof(int64_t);
    std::memcpy(slot(b, rank_), send_bytes.data(), row);
    std::memcpy(slot(b, rank_) + row, recv_bytes.data(), row);
    signal();
    wait_all(phase_);
    std::vector<int64_t> sends(size_ * size_), recvs(size_ * size_);
    for (int q = 0; q < size_; ++q) {
      std::memcpy(&sends[q * size_], slot(b, q), row);
      std::memcpy(&recvs[q * size_], slot(b, q) + row, row);
    }
    signal();
    read_done_[b] = phase_;
    for (int from = 0; from < size_; ++from) {
      for (int to = 0; to < size_; ++to) {
        const int64_t sent = sends[from * size_ + to];
        const int64_t expected = recvs[to * size_ + from];
        TORCH_CHECK(
            sent == expected,
            "all_to_all: group rank ",
            from,
            " sends ",
            sent,
            " bytes to group rank ",
            to,
            ", which expects ",
            expected,
            " (input_splits and output_splits disagree)");
        longest = from != to ? std::max(longest, sent) : longest;
      }
    }
  }
  if (recv_bytes[rank_] > 0) {
    std::memmove(dst + recv_at[rank_], src + send_at[rank_], recv_bytes[rank_]);
  }
  for (int64_t at = 0; at < longest; at += piece) {
    const int b = take_buffer();
    uint8_t* mine = slot(b, rank_);
    for (int q = 0; q < size_; ++q) {
      const int64_t len = clamp_len(send_bytes[q], at, piece);
      if (q != rank_ && len > 0) {
        std::memcpy(mine + q * piece, src + send_at[q] + at, len);
      }
    }
    signal();
    wait_all(phase_);
    for (int q = 0; q < size_; ++q) {
      const int64_t len = clamp_len(recv_bytes[q], at, piece);
      if (q != rank_ && len > 0) {
        std::memcpy(dst + recv_at[q] + at, slot(b, q) + rank_ * piece, len);
      }
    }
    signal();
    read_done_[b] = phase_;
  }
}

std::shared_future<void> ShmChannel::all_to_all(
    at::Tensor out,
    at::Tensor in,
    std::vector<int64_t> send_bytes,
    std::vector<int64_t> recv_bytes) {
  TORCH_INTERNAL_ASSERT(
      static_cast<int>(send_bytes.size()) == size_ &&
      static_cast<int>(recv_bytes.size()) == size_ &&
      send_bytes[rank_] == recv_bytes[rank_]);
  return enqueue([this,
                  out = std::move(out),
                  in = std::move(in),
                  send_bytes = std::move(send_bytes),
                  recv_bytes = std::move(recv_bytes)] {
    run_all_to_all(out, in, send_bytes, recv_bytes);
  });
}

std::shared_future<void> ShmChannel::all_reduce(at::Tensor t, ReduceOp op) {
  TORCH_CHECK(
      op != ReduceOp::kAvg || at::isFloatingType(t.scalar_type()),
      "all_reduce: ReduceOp::kAvg needs a floating tensor, got ",
      t.scalar_type());
  return enqueue([this, t = t.view({-1}), op] { run_all_reduce(t, op); });
}

std::shared_future<void> ShmChannel::reduce_scatter(
    at::Tensor out,
    at::Tensor in,
    std::vector<int64_t> sizes,
    ReduceOp op) {
  TORCH_CHECK(
      op != ReduceOp::kAvg || at::isFloatingType(in.scalar_type()),
      "reduce_scatter: ReduceOp::kAvg needs a floating tensor, got ",
      in.scalar_type());
  TORCH_INTERNAL_ASSERT(static_cast<int>(sizes.size()) == size_);
  return enqueue([this,
                  out = out.view({-1}),
                  in = in.view({-1}),
                  sizes = std::move(sizes),
                  op] { run_reduce_scatter(out, in, sizes, op); });
}

std::shared_future<void> ShmChannel::broadcast(at::Tensor t, int src) {
  TORCH_INTERNAL_ASSERT(src >= 0 && src < size_);
  return enqueue([this, t = t.view({-1}), src] { run_broadcast(t, src); });
}

std::shared_future<void> ShmChannel::all_gather(
    at::Tensor out,
    at::Tensor in,
    std::vector<int64_t> sizes) {
  TORCH_INTERNAL_ASSERT(static_cast<int>(sizes.size()) == size_);
  return enqueue(
      [this,
       out = out.view({-1}),
       in = in.view({-1}),
       sizes = std::move(sizes)] { run_all_gather(out, in, sizes); });
}

std::shared_future<void> ShmChannel::barrier() {
  return enqueue([this] {
    signal();
    wait_all(phase_);
  });
}

std::shared_future<void> ShmChannel::run_in_order(std::function<void()> fn) {
  return enqueue(std::move(fn));
}

} // namespace detail
} // namespace distributed
} // namespace colossalai

#else // !__linux__: no memfd, no futex; every group stays on its backend.

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

// open() never makes a channel here, so nothing below is ever reached.
ShmChannel::~ShmChannel() = default;

bool ShmChannel::carries(const at::Tensor&, bool) {
  return false;
}

namespace {
std::shared_future<void> unreachable() {
  TORCH_INTERNAL_ASSERT(false, "no shared-memory channel exists here");
}
} // namespace

std::shared_future<void> ShmChannel::all_reduce(at::Tensor, ReduceOp) {
  return unreachable();
}
std::shared_future<void> ShmChannel::reduce_scatter(
    at::Tensor,
    at::Tensor,
    std::vector<int64_t>,
    ReduceOp) {
  return unreachable();
}
std::shared_future<void> ShmChannel::all_gather(
    at::Tensor,
    at::Tensor,
    std::vector<int64_t>) {
  return unreachable();
}
std::shared_future<void> ShmChannel::broadcast(at::Tensor, int) {
  return unreachable();
}
std::shared_future<void> ShmChannel::all_to_all(
    at::Tensor,
    at::Tensor,
    std::vector<int64_t>,
    std::vector<int64_t>) {
  return unreachable();
}
std::shared_future<void> ShmChannel::barrier() {
  return unreachable();
}
std::shared_future<void> ShmChannel::run_in_order(std::function<void()>) {
  return unreachable();
}

} // namespace detail
} // namespace distributed
} // namespace colossalai

#endif
