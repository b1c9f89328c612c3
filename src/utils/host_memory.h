#pragma once

// Host memory reuse across training steps (internal).

namespace colossalai {
namespace utils {

/// Makes glibc keep freed memory in the process instead of handing it back
/// to the kernel: NOTE [Freed host memory stays in the process]. Returns
/// false where the C library has no such settings or refused them.
bool retain_freed_host_memory();

/// Hands the free pages inside the heap back to the kernel (glibc's
/// malloc_trim). For one-off peaks such as materializing a model shard by
/// shard: each whole tensor dropped for its shard leaves a hole the next,
/// differently sized one may not fit, and the holes stay resident.
void release_freed_host_memory();

} // namespace utils
} // namespace colossalai
