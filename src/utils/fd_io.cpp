#include "fd_io.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace colossalai {
namespace utils {

int write_fully(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t r = ::write(fd, p, std::min<size_t>(n, size_t(1) << 30));
    if (r < 0 && errno == EINTR) {
      continue;
    }
    if (r <= 0) {
      return r < 0 ? errno : EIO;
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
  return 0;
}

} // namespace utils
} // namespace colossalai
