#pragma once

#include <colossalai/utils/deferred_read.h>

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace torch {
namespace optim {
class Optimizer;
} // namespace optim
} // namespace torch

namespace colossalai {
namespace nn {
namespace optimizer {

/// An optimizer whose next step can take the loss scaler's overflow
/// verdict on the device, as PyTorch's fused optimizers take GradScaler's
/// found_inf: fp16 training then reads nothing back per step
/// (mixed_precision::TorchAMPOptimizer and the sharded optimizers ask for
/// it). FusedAdamW, FusedAdam and HybridAdam are such optimizers.
///
/// Example:
/// \code
///   if (auto* s = dynamic_cast<SkipsStepOnDevice*>(&opt);
///       s != nullptr && s->skips_step_on_device()) {
///     s->skip_step_if(found_inf);  // 1: this step changes nothing
///     opt.step();
///     verdict.record(found_inf);  // a DeviceVerdict: nothing waits
///     // ... at the next step:
///     verdict.settle(opt);  // takes a skipped step's counts back
///   }
/// \endcode
class SkipsStepOnDevice {
 public:
  virtual ~SkipsStepOnDevice() = default;
  /// Whether the next step() can skip without reading found_inf on the
  /// host: every parameter with a gradient takes a kernel that reads it on
  /// the device (or all of them are on the CPU, where reading it is free).
  virtual bool skips_step_on_device() const = 0;
  /// The next step() only: where `found_inf` (a float32 one-element tensor
  /// on the parameters' device) is 1 it changes no parameter, moment or
  /// working copy. It may advance the step counts as a taken step does;
  /// undo_step_counts() takes back what that step advanced, for the caller
  /// that has read the verdict since.
  virtual void skip_step_if(at::Tensor found_inf) = 0;
  virtual void undo_step_counts() = 0;
};

/// What a wrapper keeps of the verdicts its optimizer was given
/// (TorchAMPOptimizer, the sharded optimizers): the last eager step's, to
/// read at the next step, or the one a CUDA graph's capture recorded, which
/// each replay writes again and after_replay queues for reading.
class DeviceVerdict {
 public:
  /// After a step given `found_inf`: read at the next settle; inside a
  /// capture on its device, after each replay instead.
  void record(const at::Tensor& found_inf);
  /// Queues the verdict a replay wrote (after_graph_replay).
  void after_replay();
  /// Forgets a capture's verdict (graph mode changes).
  void reset_capture() {
    captured_ = at::Tensor();
  }
  /// Reads the pending verdict (waiting only for a device that has not
  /// passed it), clears it, and where the step was skipped has `optimizer`
  /// (a SkipsStepOnDevice) take its step counts back. Whether that step
  /// was skipped; nullopt where none was pending.
  c10::optional<bool> settle(torch::optim::Optimizer& optimizer);

 private:
  utils::DeferredRead pending_;
  at::Tensor captured_;
};

} // namespace optimizer
} // namespace nn
} // namespace colossalai
