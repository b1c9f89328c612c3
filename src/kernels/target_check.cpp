#include "target_check.h"

#include <colossalai/kernels/fused_linear_cross_entropy.h>
#include <colossalai/utils/compat.h>

#include <ATen/ATen.h>

#ifdef COLOSSALAI_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <deque>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>

namespace colossalai {
namespace kernels {

// NOTE [Deferred target check]
// A target outside the vocabulary would make the loss kernel's row NaN
// (and index out of bounds in ATen's gather), so the fused loss refuses it
// by name. Reading the answer from a GPU would stop the host until the
// device has run the whole forward so far: every training step would drain
// the queue once, and a CUDA graph could not capture the step. So on a GPU
// the check is computed on the device and copied into pinned host memory
// behind an event, and the next call (or synchronize_target_checks) reads
// it and raises, naming the call it came from. The next call waits for
// that event if the device has not passed it yet: by then the device is
// normally a whole step further, so nothing waits, and the error comes at
// the same call on every rank (ranks with the same targets, as tensor
// parallel ones, stay in step). The failed call's loss and gradients are
// not valid (the kernel makes the row NaN), and an optimizer step may have
// applied them already. Targets on the host are checked at once, as the
// CPU's are: nothing waits.

namespace {

struct Pending {
  const char* op = nullptr; // a literal
  uint64_t call = 0; // the call's number among this process's checks
  int64_t vocab = 0;
  int64_t ignore_index = 0;
  at::Tensor flag; // host bool: whether a target is out of range
#ifdef COLOSSALAI_WITH_CUDA
  std::shared_ptr<at::cuda::CUDAEvent> done; // after the flag's copy
#endif
};

// Process-wide (any thread's next call reports an earlier check), and
// never destroyed: at exit the last checks are still pending, and freeing
// their pinned flags and events after CUDA has shut down can abort.
std::mutex& mu() {
  static auto* m = new std::mutex;
  return *m;
}
std::deque<Pending>& pending() { // guarded by mu()
  static auto* q = new std::deque<Pending>;
  return *q;
}
uint64_t calls = 0; // guarded by mu()

// `when`: empty, or where the target was, ending in a space.
std::string out_of_range(const Pending& p, const std::string& when) {
  std::ostringstream os;
  os << p.op << ": " << when << "a target is outside [0, " << p.vocab
     << ") and is not ignore_index (" << p.ignore_index << ")";
  return os.str();
}

// Takes the earlier calls' checks off the list, waiting for those the
// device has not passed yet, and raises for the first that failed. The
// waits happen outside the lock.
void report() {
  std::deque<Pending> mine;
  uint64_t now = 0;
  {
    std::lock_guard<std::mutex> lock(mu());
    mine.swap(pending());
    now = calls;
  }
  std::string error;
  {
#ifdef COLOSSALAI_WITH_CUDA
    // A wait on this thread must not end another thread's capture.
    c10::optional<c10::cuda::CUDAStreamCaptureModeGuard> relaxed;
    if (!mine.empty()) {
      relaxed.emplace(cudaStreamCaptureModeRelaxed);
    }
#endif
    for (auto& p : mine) {
#ifdef COLOSSALAI_WITH_CUDA
      p.done->synchronize();
#endif
      if (*p.flag.data_ptr<bool>() && error.empty()) {
        std::ostringstream when;
        when << "in call " << p.call << " of the " << now
             << " checked so far (its loss and gradients are not valid) ";
        error = out_of_range(p, when.str());
      }
    }
    mine.clear();
  }
  TORCH_CHECK(
      error.empty(),
      error,
      ". On a GPU the targets are checked without waiting for the device, "
      "so the error comes at the next call");
}

} // namespace

void synchronize_target_checks() {
#ifdef COLOSSALAI_WITH_CUDA
  if (at::globalContext().hasCUDA()) {
    const at::Device here(at::kCUDA, c10::cuda::current_device());
    TORCH_CHECK(
        !compat::stream_capturing(here),
        "synchronize_target_checks: a CUDA graph is being captured on this "
        "thread's stream, which cannot wait for the device");
  }
#endif
  report();
}

namespace detail {

void check_targets(
    const char* op,
    const at::Tensor& target,
    const at::Device& device,
    int64_t vocab,
    int64_t ignore_index) {
  // A capture can neither read back nor wait: a device target is not
  // checked then, and no earlier check is reported.
  const bool capturing = compat::stream_capturing(device) ||
      compat::stream_capturing(target.device());
  if (capturing && !target.is_cpu()) {
    return;
  }
  if (!capturing) {
    report();
  }
  uint64_t call = 0;
  {
    std::lock_guard<std::mutex> lock(mu());
    call = ++calls;
  }
  const auto bad = (target.lt(0) | target.ge(vocab))
                       .logical_and_(target.ne(ignore_index))
                       .any();
  Pending p;
  p.op = op;
  p.call = call;
  p.vocab = vocab;
  p.ignore_index = ignore_index;
  p.flag = bad;
  if (target.is_cpu()) {
    TORCH_CHECK(!*bad.data_ptr<bool>(), out_of_range(p, ""));
    return;
  }
#ifdef COLOSSALAI_WITH_CUDA
  if (target.is_cuda()) {
    const c10::cuda::CUDAGuard guard(target.device());
    p.flag = at::empty({}, bad.options().device(at::kCPU).pinned_memory(true));
    p.flag.copy_(bad, /*non_blocking=*/true);
    p.done = std::make_shared<at::cuda::CUDAEvent>();
    p.done->record(c10::cuda::getCurrentCUDAStream());
    std::lock_guard<std::mutex> lock(mu());
    pending().push_back(std::move(p));
    return;
  }
#endif
  // Another device: read the answer back.
  TORCH_CHECK(!bad.item<bool>(), out_of_range(p, ""));
}

} // namespace detail
} // namespace kernels
} // namespace colossalai
