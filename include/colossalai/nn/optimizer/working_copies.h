#pragma once

#include <ATen/core/Tensor.h>

namespace colossalai {
namespace nn {
namespace optimizer {

/// An optimizer whose step can write each updated float32 parameter into a
/// lower-precision working copy in the same pass (FusedAdamW, HybridAdam):
/// the mixed-precision plugins register their bf16 / fp16 weights here
/// instead of casting the masters after the step.
///
/// Example:
/// \code
///   if (auto* w = dynamic_cast<WorkingCopies*>(&optimizer)) {
///     w->set_working_copy(master, bf16_weight);
///   }
/// \endcode
class WorkingCopies {
 public:
  virtual ~WorkingCopies() = default;
  /// After each step that updates `param`, `copy` (as many elements,
  /// contiguous, on its device) holds it rounded to copy's dtype.
  virtual void set_working_copy(const at::Tensor& param, at::Tensor copy) = 0;
};

} // namespace optimizer
} // namespace nn
} // namespace colossalai
