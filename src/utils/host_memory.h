#pragma once

// Host memory reuse across training steps, and the host tier of offloading
// (internal).

#include <ATen/core/Tensor.h>

namespace colossalai {
namespace utils {

/// `t` copied to the host for an offload tier (optimizer states, master
/// shards, gradient shards): page-locked when `t` lives on a GPU, so its
/// transfers run at the bus's speed without a staging copy (as ColossalAI's
/// pin_memory); `t` itself when it is already on the host.
at::Tensor offload_to_host(const at::Tensor& t);
/// Zeros shaped like `t`, on its device, page-locked when `t` is (empty_like
/// does not keep pinning).
at::Tensor zeros_like_pinned(const at::Tensor& t);

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
