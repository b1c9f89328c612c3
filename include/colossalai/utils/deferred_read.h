#pragma once

#include <ATen/core/Tensor.h>

#include <memory>

namespace colossalai {
namespace utils {

/// A one-element tensor's value, read later without making the host wait
/// now. On a GPU the value is copied into pinned host memory behind an
/// event when the DeferredRead is made (nothing waits); value() waits for
/// that event only if the device has not passed it yet, which a step later
/// it normally has. On the CPU the tensor is kept and read directly. What
/// the fp16 loss scaler uses to learn, one step late, whether a step it
/// left to the device to skip was skipped.
///
/// Example:
/// \code
///   utils::DeferredRead late(found_inf);  // no wait
///   // ... queue the next step's work ...
///   bool skipped = late.value() != 0;     // waits only if still running
/// \endcode
class DeferredRead {
 public:
  DeferredRead() = default;
  /// `value`: a one-element tensor of any dtype. Not inside a CUDA graph's
  /// capture (its copy and event would belong to the graph).
  explicit DeferredRead(const at::Tensor& value);

  bool defined() const {
    return value_.defined();
  }
  /// The value as a double; waits for the device where needed.
  double value() const;

 private:
  at::Tensor value_; // host: pinned where copied from a GPU
  std::shared_ptr<void> done_; // the copy's CUDA event, where copied
};

} // namespace utils
} // namespace colossalai
