#pragma once

// Host memory reuse across training steps, and the host tier of offloading
// (internal).

#include <ATen/core/Tensor.h>

#include <memory>

namespace colossalai {
namespace utils {

/// `t` copied to the host for an offload tier (optimizer states, master
/// shards, gradient shards): page-locked when `t` lives on a GPU, so its
/// transfers run at the bus's speed without a staging copy (as ColossalAI's
/// pin_memory); `t` itself when it is already on the host.
at::Tensor offload_to_host(const at::Tensor& t);
/// Uninitialised page-locked host memory of exactly `sizes` (tensors of 16
/// MiB and more are pinned one by one: the caching host allocator would
/// round them up to a power of two); plain host memory in a build without
/// CUDA.
at::Tensor pinned_empty(
    at::IntArrayRef sizes,
    const at::TensorOptions& options);
/// `t` (a host tensor of the offload tier) as a new tensor on `device` in
/// `dtype`. From page-locked memory the bus carries t's own bytes
/// asynchronously and the device converts; a blocking copy_ would convert
/// on the host and stage the result through pageable memory, at a fraction
/// of the bus's speed. `t` must not change until the copy has run: the
/// sharded optimizers write their host shards only in a step, after the
/// backward's copies were waited for, and synchronise the device after the
/// refresh that follows a step.
at::Tensor to_device(
    const at::Tensor& t,
    const at::Device& device,
    at::ScalarType dtype);
/// A host tensor of the step (a batch, indices, positions) on `device`
/// without the host waiting: a GPU gets it through a page-locked copy,
/// asynchronously (a copy from pageable memory blocks the host until the
/// device's queue has drained, and a CUDA graph's capture refuses it).
/// ATen's pinned allocator keeps the staging copy until the transfer has
/// run; `t` itself may change as soon as this returns. The result is
/// contiguous; `t` itself where it is already there.
at::Tensor upload_async(const at::Tensor& t, const at::Device& device);
/// Blocks until the work queued on `device`'s current stream (to_device's
/// copies among it) has run; nothing for the host.
void wait_for_device(const at::Device& device);
/// Zeros shaped like `t`, on its device, page-locked when `t` is (empty_like
/// does not keep pinning), in `dtype` (default: t's).
at::Tensor zeros_like_pinned(
    const at::Tensor& t,
    c10::optional<at::ScalarType> dtype = c10::nullopt);

/// A point in a device's work queue (a CUDA event on a stream), or no point
/// at all: for the host and in builds without CUDA, whose copies are done
/// when they return. Copyable; every copy names the same point.
class StreamPoint {
 public:
  StreamPoint() = default;
  /// The work queued so far on `device`'s current stream (of the calling
  /// thread).
  static StreamPoint now(const at::Device& device);
  /// Makes `device`'s current stream wait for the point, without the host
  /// waiting.
  void block_current(const at::Device& device) const;
  /// Blocks the host until the point has run.
  void synchronize() const;

 private:
  friend class HostCopies;
  friend StreamPoint upload_after(
      const StreamPoint&,
      const at::Tensor&,
      const at::Tensor&);
  struct Event;
  std::shared_ptr<Event> event_;
};

/// dst (a device tensor) = src (a host tensor of the offload tier, in any
/// dtype), from any thread, on a side stream of dst's device that first
/// waits for `after`: the copy overlaps whatever the device computes
/// meanwhile. Returns the point at which dst holds the values; src must not
/// change and dst must not be read before it (block_current). On the host a
/// plain copy_.
StreamPoint upload_after(
    const StreamPoint& after,
    const at::Tensor& dst,
    const at::Tensor& src);

/// NOTE [Offload copies overlap the backward]
/// A gradient shard whose state lives on the host reaches it while the
/// backward goes on: a copy into a page-locked host tensor runs on a side
/// stream, ordered after the work queued before it (the reduction that
/// produced its source), while the device computes what follows; the
/// source is marked in use by that stream, so the caching allocator does
/// not hand its memory out before the copy has read it. A blocking copy
/// here would drain the device's queue at every offloaded shard and leave
/// it idle while the host catches up. Readers of a destination call wait()
/// first (the sharded optimizers do when their backward finalizes).
/// Elsewhere (a host source, a pageable destination, a CPU-only build) a
/// copy is the plain blocking copy_.
class HostCopies {
 public:
  HostCopies();
  ~HostCopies();
  HostCopies(const HostCopies&) = delete;
  HostCopies& operator=(const HostCopies&) = delete;
  /// dst (host) = src, converted to dst's dtype on src's device (the bus
  /// carries dst's bytes).
  void copy(const at::Tensor& dst, const at::Tensor& src);
  /// Blocks until every copy started has landed.
  void wait();
  /// The point at which every copy started so far has landed (any thread
  /// may wait for it).
  StreamPoint landed() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

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
