#include "shm_channel.h"

// Setting up a group's shared-memory segment (ShmChannel::open): the
// members agree through the store, rank 0 makes the segment and hands it
// over (shm_setup_memfd.cpp), each member maps it, within the per-process
// budget (NOTE [Shared-memory budget]). See NOTE [Segments that cannot
// outlive their job] in shm_setup_memfd.cpp.

#if defined(__linux__)

#include "../utils/fault_point.h"
#include "shm_segment.h"
#include "shm_setup_internal.h"

#include <colossalai/distributed/error.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <random>
#include <sstream>
#include <thread>

namespace colossalai {
namespace distributed {
namespace detail {

namespace {

std::vector<uint8_t> bytes_of(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

std::string string_of(const std::vector<uint8_t>& v) {
  return std::string(v.begin(), v.end());
}

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
