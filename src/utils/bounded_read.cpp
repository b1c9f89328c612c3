#include "bounded_read.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace colossalai {
namespace utils {
namespace {

std::string human_bytes(uint64_t n) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  if (u == 0) {
    return std::to_string(n) + " bytes";
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  return buf;
}

// Why a file of mode `mode` is not read ("" for a regular file).
std::string kind_error(mode_t mode) {
  if (S_ISREG(mode)) {
    return "";
  }
  const char* kind = S_ISDIR(mode) ? "a directory"
      : S_ISFIFO(mode)             ? "a FIFO"
      : S_ISSOCK(mode)             ? "a socket"
      : S_ISCHR(mode)              ? "a character device"
      : S_ISBLK(mode)              ? "a block device"
                                   : "not a plain file";
  return std::string("is ") + kind + ", not a regular file";
}

// Opens `path` for reading without blocking (O_NONBLOCK: a FIFO with no
// writer would block open() itself) and checks it is a regular file; -1 and
// `why` otherwise.
int open_regular(const std::string& path, struct stat& st, std::string& why) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    why = std::string("cannot be opened: ") + std::strerror(errno);
    return -1;
  }
  if (::fstat(fd, &st) != 0) {
    why = std::string("cannot be read: ") + std::strerror(errno);
    ::close(fd);
    return -1;
  }
  why = kind_error(st.st_mode);
  if (!why.empty()) {
    ::close(fd);
    return -1;
  }
  return fd;
}

} // namespace

std::string regular_file_error(const std::string& path) {
  struct stat st {};
  std::string why;
  const int fd = open_regular(path, st, why);
  if (fd >= 0) {
    ::close(fd);
  }
  return why;
}

std::string read_regular_file(
    const std::string& path,
    uint64_t max_bytes,
    std::string& out) {
  out.clear();
  struct stat st {};
  std::string why;
  const int fd = open_regular(path, st, why);
  if (fd < 0) {
    return why;
  }
  const auto too_big = [&](uint64_t size) {
    return "is " + human_bytes(size) + ", more than the " +
        human_bytes(max_bytes) + " such a file may have";
  };
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > max_bytes) {
    ::close(fd);
    return too_big(size);
  }
  out.resize(static_cast<size_t>(size));
  size_t at = 0;
  // Up to the bound and one byte more: a file growing while read is caught.
  for (;;) {
    if (at == out.size()) {
      if (out.size() > max_bytes) {
        ::close(fd);
        out.clear();
        return too_big(out.size());
      }
      out.resize(at + 1 + (at < 4096 ? 4096 : at / 2));
    }
    const ssize_t r = ::read(fd, &out[at], out.size() - at);
    if (r < 0 && errno == EINTR) {
      continue;
    }
    if (r < 0) {
      why = std::string("cannot be read: ") + std::strerror(errno);
      ::close(fd);
      out.clear();
      return why;
    }
    if (r == 0) {
      break;
    }
    at += static_cast<size_t>(r);
  }
  ::close(fd);
  if (at > max_bytes) {
    out.clear();
    return too_big(at);
  }
  out.resize(at);
  return "";
}

std::string json_depth_error(const std::string& text, size_t max_depth) {
  size_t depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) {
        return "nests arrays / objects more than " +
            std::to_string(max_depth) + " levels deep (at byte " +
            std::to_string(i) + ")";
      }
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return "";
}

std::string excerpt(const std::string& text, size_t max_chars) {
  if (text.size() <= max_chars) {
    return text;
  }
  size_t cut = max_chars;
  // Not inside a UTF-8 sequence: back to its first byte.
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) {
    --cut;
  }
  return text.substr(0, cut) + "...";
}

} // namespace utils
} // namespace colossalai
