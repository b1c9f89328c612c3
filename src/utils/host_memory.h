#pragma once

// Host memory reuse across training steps (internal).

namespace colossalai {
namespace utils {

/// Makes glibc keep freed memory in the process instead of handing it back
/// to the kernel: NOTE [Freed host memory stays in the process]. Returns
/// false where the C library has no such settings or refused them.
bool retain_freed_host_memory();

} // namespace utils
} // namespace colossalai
