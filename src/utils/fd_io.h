#pragma once

// Writing a whole buffer through a file descriptor (internal).

#include <cstddef>

namespace colossalai {
namespace utils {

/// Writes all `n` bytes of `data` to `fd`, retrying interrupted and partial
/// writes, at most 1 GiB a call (Linux caps one write just under 2 GiB).
/// Returns 0, or the errno of the failed write (EIO when a write made no
/// progress); callers name the file in their own error.
int write_fully(int fd, const void* data, size_t n);

} // namespace utils
} // namespace colossalai
