// The shared-memory segment's memory: an anonymous memory file, mapped, and
// its descriptor handed to the group's members over a Unix socket (NOTE
// [Segments that cannot outlive their job]).

#include "shm_channel.h"

#if defined(__linux__)

#include "shm_setup_internal.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>

namespace colossalai {
namespace distributed {
namespace detail {

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

namespace {

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

} // namespace

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

} // namespace detail
} // namespace distributed
} // namespace colossalai

#endif
