#pragma once

// What the shared-memory set-up's files share (src/distributed/shm_setup*.cpp;
// internal, Linux): descriptors, the segment's memory file and its hand-over
// to the members, this host's processes. See NOTE [Segments that cannot
// outlive their job] in shm_setup_memfd.cpp.

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <string>

namespace colossalai {
namespace distributed {
namespace detail {

/// A descriptor, closed with its owner.
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

/// "WHAT: " and errno's message.
std::string errno_text(const char* what);

/// The segment's memory file (into `fd`), its pages reserved (so a shortage
/// gives an error here, not a SIGBUS later), mapped.
void* make_segment(size_t bytes, Fd* fd);

/// Maps a received segment's `fd`, which must be `bytes` long.
void* map_received(int fd, size_t bytes);

/// The address of `name` in the abstract namespace (no file, gone with its
/// socket) into `addr`; returns its length.
socklen_t abstract_address(const std::string& name, sockaddr_un* addr);

/// Sends the descriptor `fd` over the connected socket `sock` (SCM_RIGHTS).
void send_fd(int sock, int fd);

/// Connects to `name` and receives the segment's descriptor (waits at most
/// `timeout` for it).
int receive_fd(const std::string& name, std::chrono::milliseconds timeout);

/// Equal on two processes when they share the host, its boot, and the IPC,
/// PID and network namespaces.
std::string identity();

/// Whether the process `pid` runs (exists and is not a zombie).
bool process_alive(int pid);

} // namespace detail
} // namespace distributed
} // namespace colossalai
