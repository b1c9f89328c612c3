#pragma once

/// A whole training step (forward, backward, optimizer step) captured once
/// in a CUDA graph and replayed: one launch per step instead of one per
/// kernel, for shapes that do not change.
///
/// The first `warmup` calls run the step function eagerly, on the stream
/// the capture will use: they create the gradients and the optimizer's
/// state, and let cuBLAS and the caching allocator settle. The next call
/// captures the function (nothing runs while it is recorded) and replays
/// it; every later call copies its inputs into the captured ones and
/// replays. Before each replay the optimizer's host half runs outside the
/// graph (nn::optimizer::GraphCapturable): step counts advance, and the
/// learning rate a scheduler set is written where the captured kernels read
/// it, so a schedule works as in eager training.
///
/// What a captured step may not do, and is refused by name: read a value
/// back to the host (.item(), clip_grad_by_norm's norm, fp16's overflow
/// verdict over an optimizer that cannot skip on the device: over
/// FusedAdamW / FusedAdam the captured step skips there, and the host
/// reads each replay's verdict before the next replay, waiting for it;
/// clip_grad_by_norm_tensor and LowLevelZero's max_norm at one rank
/// clip on the device and are captured), step an optimizer whose scalars live
/// on the host (torch::optim::AdamW: use FusedAdamW), swap a random
/// generator's state (a Dropout with p > 0, activation checkpointing), run a
/// mixture of experts' expert loop (it reads the counts back; grouped expert
/// GEMMs, models::set_grouped_expert_gemm, do not), or communicate (one
/// process; a plugin's optimizer wrapper other than LowLevelZero's at one
/// rank is refused). The fused loss skips its check of the targets' range
/// inside a capture (an out-of-range target gives a NaN loss instead of an
/// error).
/// The step function must take the same path every call: the graph repeats
/// the kernels of the capture, not the function.
///
/// Example:
/// \code
///   auto opt = std::make_shared<nn::optimizer::FusedAdamW>(
///       model->parameters(), torch::optim::AdamWOptions(3e-4));
///   auto boosted = booster.boost(model, opt);
///   booster::GraphedStep step(boosted.optimizer,
///       [&](const std::vector<at::Tensor>& in) {
///         boosted.optimizer->zero_grad();
///         auto loss = boosted.model(in[0], in[1]);
///         booster.backward(loss, *boosted.optimizer);
///         boosted.optimizer->step();
///         return loss;
///       });
///   for (auto& batch : loader) {
///     auto loss = step({batch.x.cuda(), batch.y.cuda()});
///     scheduler.step();
///   }
/// \endcode

#include <colossalai/interface/optimizer.h>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace colossalai {
namespace booster {

struct GraphedStepOptions {
  /// Eager calls before the capture (at least 1).
  TORCH_ARG(int64_t, warmup) = 3;
};

class GraphedStep {
 public:
  /// The step: reads the inputs it is given (the captured copies), trains
  /// one step, returns the loss (or any tensor it wants back).
  using StepFn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

  /// Refuses an optimizer whose step cannot be captured
  /// (OptimizerWrapper::graph_capture_blocker) and a build without CUDA.
  GraphedStep(
      std::shared_ptr<interface::OptimizerWrapper> optimizer,
      StepFn step,
      GraphedStepOptions options = {});
  ~GraphedStep();
  GraphedStep(const GraphedStep&) = delete;
  GraphedStep& operator=(const GraphedStep&) = delete;

  /// One training step on `inputs` (CUDA tensors of one device, the same
  /// shapes and dtypes every call). Returns the step function's result:
  /// after the capture, the graph's own output tensor, which the next call
  /// overwrites (clone it to keep it). Ordered on the caller's stream.
  at::Tensor operator()(const std::vector<at::Tensor>& inputs);

  /// Whether the step has been captured (after warmup + 1 calls).
  bool captured() const;
  /// Calls so far.
  int64_t calls() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

} // namespace booster
} // namespace colossalai
