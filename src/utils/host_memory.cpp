#include "host_memory.h"

#include <ATen/ATen.h>

#ifdef COLOSSALAI_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <cuda_runtime_api.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <c10/util/Optional.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace colossalai {
namespace utils {

// NOTE [Freed host memory stays in the process]
// A training step allocates and frees the same activations and gradients
// every step. glibc serves a block at or above its mmap threshold with a
// fresh mmap and unmaps it on free; the threshold adapts (128 KiB up to
// 32 MiB) to the largest block freed so far, so a block of that very size
// is mapped afresh every time. And glibc trims the heap's free top above
// twice the threshold, which hands a step's freed activations back to the
// kernel. So every step faults its large tensors in again, a page at a
// time. On the virtual machines we measured, a fault costs 3-6 us per
// 4 KiB page and much more at times: gpt-small-cpu's forward + backward
// took 6,700 faults a step, and its median step was 1.6x its fastest.
// Fixing the mmap threshold at glibc's own maximum (32 MiB) and the trim
// threshold at 1 GiB keeps freed blocks in the heap, where the next step
// reuses them: about 100 faults a step, and the median step equals the
// fastest. Blocks of 32 MiB and more (glibc refuses a higher threshold)
// would still be mapped and unmapped each time, and at a larger model's
// widths they are most of a step's bytes: a gathered Gemini chunk, a flat
// gradient, every full weight gradient autograd hands over. So mmap is
// turned off altogether (M_MMAP_MAX 0) and they come from the heap too.
// At one LLaMA-2-7B-width layer on the CPU that took Gemini's step from
// 2,272 to 1,166 ms and ZeRO-2 offload's from 1,511 to 1,076 ms, for a
// resident peak 13% and 7% higher: freed large blocks stay in the heap,
// where differently sized requests do not always fit
// (bench/results/2026-11-29-large-blocks-cpu). glibc still maps a block
// when the heap cannot grow, and a thread's own arena still maps what it
// cannot hold, so nothing fails for it. The price is the one a caching
// allocator pays: the heap does not shrink after a peak (up to 1 GiB of
// free top is kept; release_freed_host_memory hands free pages back). The
// Booster sets this when boost returns, after the model is built and
// sharded, so one-off construction buffers do not leave heap holes that
// raise a lazily built model's peak (with the mmap threshold at 1 GiB from
// the start, FSDP's peak rose by 190 MB).
bool retain_freed_host_memory() {
#if defined(__GLIBC__)
  // Setting either threshold turns glibc's adaptation off, so both are set:
  // the trim threshold alone would pin the mmap threshold at 128 KiB and
  // fault far more often.
  return mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 &&
      mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1 && mallopt(M_MMAP_MAX, 0) == 1;
#else
  return false;
#endif
}

void release_freed_host_memory() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

struct StreamPoint::Event {
#ifdef COLOSSALAI_WITH_CUDA
  at::cuda::CUDAEvent event;
#endif
};

StreamPoint StreamPoint::now(const at::Device& device) {
  StreamPoint p;
#ifdef COLOSSALAI_WITH_CUDA
  if (device.is_cuda()) {
    p.event_ = std::make_shared<Event>();
    p.event_->event.record(c10::cuda::getCurrentCUDAStream(device.index()));
  }
#else
  (void)device;
#endif
  return p;
}

void StreamPoint::block_current(const at::Device& device) const {
#ifdef COLOSSALAI_WITH_CUDA
  if (event_ && device.is_cuda()) {
    event_->event.block(c10::cuda::getCurrentCUDAStream(device.index()));
  }
#else
  (void)device;
#endif
}

void StreamPoint::synchronize() const {
#ifdef COLOSSALAI_WITH_CUDA
  if (event_) {
    event_->event.synchronize();
  }
#endif
}

StreamPoint upload_after(
    const StreamPoint& after,
    const at::Tensor& dst,
    const at::Tensor& src) {
#ifdef COLOSSALAI_WITH_CUDA
  if (dst.is_cuda()) {
    const c10::cuda::CUDAGuard guard(dst.device());
    const auto side = c10::cuda::getStreamFromPool(
        /*isHighPriority=*/false, dst.device().index());
    const c10::cuda::CUDAStreamGuard on_side(side);
    if (after.event_) {
      after.event_->event.block(side);
    }
    // Temporaries come from and return to the side stream's pool; dst's
    // memory is not handed out again before this stream has written it.
    dst.copy_(to_device(src, dst.device(), dst.scalar_type()));
    dst.record_stream(side);
    return StreamPoint::now(dst.device());
  }
#endif
  (void)after;
  dst.copy_(src);
  return StreamPoint();
}

// NOTE [Offload copies overlap the backward]
struct HostCopies::Impl {
#ifdef COLOSSALAI_WITH_CUDA
  c10::optional<c10::cuda::CUDAStream> side;
  StreamPoint last; // the side stream's latest copy
#endif
};

HostCopies::HostCopies() : impl_(std::make_unique<Impl>()) {}

HostCopies::~HostCopies() {
  try {
    wait();
  } catch (...) { // a destructor must not throw; the copies are lost anyway
  }
}

void HostCopies::copy(const at::Tensor& dst, const at::Tensor& src) {
#ifdef COLOSSALAI_WITH_CUDA
  if (src.is_cuda() && dst.is_cpu() && dst.is_pinned()) {
    const auto index = src.device().index();
    const c10::cuda::CUDAGuard guard(src.device());
    const auto s = src.to(dst.scalar_type()); // on the device
    if (!impl_->side || impl_->side->device_index() != index) {
      wait();
      impl_->side =
          c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index);
    }
    at::cuda::CUDAEvent queued;
    queued.record(c10::cuda::getCurrentCUDAStream(index));
    queued.block(*impl_->side);
    {
      const c10::cuda::CUDAStreamGuard on_side(*impl_->side);
      dst.copy_(s, /*non_blocking=*/true);
      impl_->last = StreamPoint::now(src.device()); // on the side stream
    }
    s.record_stream(*impl_->side);
    return;
  }
#endif
  dst.copy_(src);
}

void HostCopies::wait() {
#ifdef COLOSSALAI_WITH_CUDA
  impl_->last.synchronize();
  impl_->last = StreamPoint();
#endif
}

StreamPoint HostCopies::landed() const {
#ifdef COLOSSALAI_WITH_CUDA
  return impl_->last;
#else
  return StreamPoint();
#endif
}

// Page-locked host memory of exactly `bytes`: the caching host allocator
// rounds a request up to a power of two (a 48 MiB shard takes 64 MiB), which
// an offloaded 7B model's masters, gradients and states cannot afford. Large
// tensors (they live as long as the model) are pinned one by one instead;
// small ones stay with the caching allocator.
at::Tensor pinned_empty(
    at::IntArrayRef sizes,
    const at::TensorOptions& options) {
  const auto host = options.device(at::kCPU);
#ifdef COLOSSALAI_WITH_CUDA
  int64_t numel = 1;
  for (auto s : sizes) {
    numel *= s;
  }
  const size_t bytes = static_cast<size_t>(numel) *
      c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  if (bytes >= (size_t{16} << 20)) {
    void* data = nullptr;
    const auto e = cudaHostAlloc(&data, bytes, cudaHostAllocDefault);
    TORCH_CHECK(
        e == cudaSuccess,
        "offload: page-locking ",
        bytes >> 20,
        " MiB of host memory failed: ",
        cudaGetErrorString(e));
    return at::from_blob(data, sizes, [](void* p) { cudaFreeHost(p); }, host);
  }
  return at::empty(sizes, host.pinned_memory(true));
#else
  return at::empty(sizes, host); // nothing to page-lock for
#endif
}

at::Tensor to_device(
    const at::Tensor& t,
    const at::Device& device,
    at::ScalarType dtype) {
  if (t.is_cpu() && device.is_cuda() && t.is_pinned()) {
    auto moved = t.to(device, /*non_blocking=*/true);
    return moved.scalar_type() == dtype ? moved : moved.to(dtype);
  }
  return t.to(device, dtype, /*non_blocking=*/false, /*copy=*/true);
}

at::Tensor upload_async(const at::Tensor& t, const at::Device& device) {
  if (t.device() == device) {
    return t;
  }
  if (t.is_cpu() && device.is_cuda() && t.layout() == at::kStrided) {
    // A copy also of a pinned `t`, which the caller may write again.
    auto staged = at::empty(t.sizes(), t.options().pinned_memory(true));
    staged.copy_(t);
    return staged.to(device, /*non_blocking=*/true);
  }
  return t.to(device);
}

void wait_for_device(const at::Device& device) {
#ifdef COLOSSALAI_WITH_CUDA
  if (device.is_cuda()) {
    c10::cuda::getCurrentCUDAStream(device.index()).synchronize();
  }
#else
  (void)device;
#endif
}

at::Tensor offload_to_host(const at::Tensor& t) {
  if (!t.is_cuda()) {
    return t.to(at::kCPU);
  }
  auto host = pinned_empty(t.sizes(), t.options());
  host.copy_(t);
  return host;
}

at::Tensor zeros_like_pinned(
    const at::Tensor& t,
    c10::optional<at::ScalarType> dtype) {
  const bool pinned = t.device().is_cpu() && t.is_pinned();
  const auto options = t.options().dtype(dtype.value_or(t.scalar_type()));
  return (pinned ? pinned_empty(t.sizes(), options)
                 : at::empty(t.sizes(), options))
      .zero_();
}

} // namespace utils
} // namespace colossalai
