#include <colossalai/utils/deferred_read.h>

#include <colossalai/utils/compat.h>

#include <ATen/ATen.h>

#ifdef COLOSSALAI_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace colossalai {
namespace utils {

DeferredRead::DeferredRead(const at::Tensor& value) {
  TORCH_CHECK(
      value.numel() == 1,
      "DeferredRead: needs a one-element tensor, got shape ",
      value.sizes());
  TORCH_CHECK(
      !compat::stream_capturing(value.device()),
      "DeferredRead: a CUDA graph is being captured on the value's device");
#ifdef COLOSSALAI_WITH_CUDA
  if (value.is_cuda()) {
    const c10::cuda::CUDAGuard guard(value.device());
    value_ = at::empty(
        {}, value.options().device(at::kCPU).pinned_memory(true));
    value_.copy_(value.reshape({}), /*non_blocking=*/true);
    auto done = std::make_shared<at::cuda::CUDAEvent>();
    done->record(c10::cuda::getCurrentCUDAStream());
    done_ = std::move(done);
    return;
  }
#endif
  // The CPU's value is there already (copied: the caller may reuse the
  // tensor); another device's is read now.
  value_ = value.is_cpu() ? value.reshape({}).clone() : value.reshape({}).cpu();
}

double DeferredRead::value() const {
  TORCH_CHECK(value_.defined(), "DeferredRead: no value");
#ifdef COLOSSALAI_WITH_CUDA
  if (done_ != nullptr) {
    static_cast<at::cuda::CUDAEvent*>(done_.get())->synchronize();
  }
#endif
  // Through the pointer, not item(): a host value, not an ATen read.
  const auto as_double = value_.to(at::kDouble);
  return *as_double.data_ptr<double>();
}

} // namespace utils
} // namespace colossalai
