#pragma once

/// Reading tensors out of memory-mapped checkpoint files fast. For what
/// builds on checkpoint IO (plugins' checkpoint IO); not part of the Booster
/// API.

#include <ATen/ATen.h>

#include <cstddef>

namespace colossalai {
namespace checkpoint_io {
namespace detail {

/// Maps in the pages under a CPU tensor (a view into a memory-mapped
/// checkpoint) in one call, before it is read: faulting them in one 4 KiB
/// page at a time costs 3-6 us a page on the VMs here, an 8x slower load.
/// Best effort (a no-op where the kernel lacks MADV_POPULATE_READ).
void populate(const at::Tensor& t);

/// Mapped checkpoint files register their mapping and hand over its open
/// descriptor (closed by unregister_mapping), so that loads can read a
/// mapped tensor with pread (NOTE [Loads read into the parameters]).
void register_mapping(const void* base, size_t size, int fd);
void unregister_mapping(const void* base);
/// Copies `src`, a view into a registered mapping, into `dst` (same dtype
/// and numel, both contiguous on the CPU) with pread; false (nothing to
/// rely on in `dst`) when it does not apply, and the caller copies.
bool read_mapped_into(at::Tensor& dst, const at::Tensor& src);

/// Drops this process's pages of a registered mapping that lie wholly under
/// `src`, once what was wanted of them is copied: they are file pages, so a
/// later read faults them in again from the page cache, but until then a
/// load does not hold the file in its resident set beside the copy (a model
/// loaded from a mapped file would otherwise peak at twice its size). A
/// no-op for a tensor outside the registered mappings. Only for views the
/// caller alone holds: the mappings are private, so a page written through
/// another view would lose the write.
void release_mapped(const at::Tensor& src);

/// Copies `src` (a CPU tensor, a view into a mapped checkpoint or not) into
/// `dst` of the same shape, converting its dtype: with pread where
/// read_mapped_into applies, else through the mapping, whose pages are
/// released after (release_mapped: views the caller alone holds).
void read_into(at::Tensor& dst, const at::Tensor& src);

} // namespace detail
} // namespace checkpoint_io
} // namespace colossalai
