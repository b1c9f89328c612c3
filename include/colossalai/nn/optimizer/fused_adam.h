#pragma once

#include <colossalai/nn/optimizer/skips_step_on_device.h>
#include <colossalai/nn/optimizer/working_copies.h>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace colossalai {
namespace nn {
namespace optimizer {

namespace detail {
struct FusedGraph;

/// A fused optimizer's part in a step skipped on the device
/// (SkipsStepOnDevice): the next step's found_inf, and the parameters
/// whose step counts the last such step advanced.
struct DeviceSkip {
  at::Tensor found_inf;
  std::vector<at::Tensor> stepped;
};
} // namespace detail

/// An optimizer whose step a CUDA graph can capture
/// (booster::GraphedStep). A replayed graph repeats the device work it
/// recorded with the arguments it had, so a step splits in two: the host's
/// half (step counts, learning rate, bias corrections: written into device
/// buffers) runs before every replay, outside the graph; the device's half
/// (the update kernels, reading those buffers) is what the capture records.
class GraphCapturable {
 public:
  virtual ~GraphCapturable() = default;
  /// Why this optimizer's steps cannot be captured, or empty where they can.
  virtual std::string graph_capture_blocker() const = 0;
  /// On: plans the captured step over the parameters that have state (at
  /// least one ordinary step first) and makes its device buffers, outside
  /// any capture. From then on step() launches only the device's half; the
  /// first such step takes the gradients (every planned parameter must
  /// have one, no other may) and, outside a capture, is an ordinary step.
  /// Off: ordinary steps again.
  virtual void set_graph_mode(bool on) = 0;
  /// The host's half of the next replayed step: each step count advanced,
  /// the groups' learning rates (a scheduler's) and the bias corrections
  /// written for the device's half. Once per replay, after the capture.
  virtual void prepare_graph_step() = 0;
};

/// `torch::optim::AdamW` whose step runs LibTorch's fused multi-tensor kernel
/// (`at::_fused_adamw_`, what Python's `AdamW(fused=True)` calls): one pass
/// over parameter, gradient and both moments per step instead of the dozen
/// per-tensor passes of LibTorch's loop. ColossalAI's `FusedAdam` with
/// `adamw_mode=True` is this optimizer.
///
/// Options, state and checkpoints are AdamW's: a `FusedAdamW` saves and
/// loads wherever a `torch::optim::AdamW` does (and Python's AdamW reads it).
/// Parameters are stepped in one fused call per group, device and dtype.
/// When any parameter cannot take the kernel (a device LibTorch has none for:
/// the CPU before 2.4, any device on 1.13; a sparse, strided or other-dtype
/// gradient), the whole step is AdamW's own. The fused kernel computes the
/// bias corrections in fp32 where AdamW uses double, so the two agree within
/// fp32 rounding, not bitwise.
///
/// Example:
/// \code
///   auto opt = std::make_shared<colossalai::nn::optimizer::FusedAdamW>(
///       model->parameters(), torch::optim::AdamWOptions(3e-4).weight_decay(0.1));
///   auto boosted = booster.boost(model, opt);
/// \endcode
class FusedAdamW : public torch::optim::AdamW,
                   public GraphCapturable,
                   public WorkingCopies,
                   public SkipsStepOnDevice {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;

  std::string graph_capture_blocker() const override;
  void set_graph_mode(bool on) override;
  void prepare_graph_step() override;

  /// After each step that updates `param` (a float32 parameter of this
  /// optimizer, e.g. a master weight), `copy` (as many elements,
  /// contiguous, on its device) holds it rounded to copy's dtype. On a GPU
  /// the step's own pass writes it (kernels::adamw_step_: the masters are
  /// not read twice); elsewhere a copy_ follows the step. The mixed
  /// precision optimizers register their bf16 / fp16 weights here.
  void set_working_copy(const at::Tensor& param, at::Tensor copy) override;

  /// Where every parameter with a gradient takes a fused kernel (ATen's,
  /// or kernels::adamw_step_ with working copies on a GPU); in graph mode
  /// too (the captured launch reads the verdict's tensor each replay, and
  /// undo_step_counts takes back what prepare_graph_step advanced).
  bool skips_step_on_device() const override;
  void skip_step_if(at::Tensor found_inf) override;
  void undo_step_counts() override;

 private:
  // param's TensorImpl -> (param, copy)
  std::unordered_map<const void*, std::pair<at::Tensor, at::Tensor>> copies_;
  std::shared_ptr<detail::FusedGraph> graph_;
  detail::DeviceSkip skip_;
};

/// `torch::optim::Adam` (L2 weight decay added to the gradient) stepped by
/// `at::_fused_adam_`; otherwise as `FusedAdamW` (ColossalAI's `FusedAdam`
/// with `adamw_mode=False`).
class FusedAdam : public torch::optim::Adam,
                  public GraphCapturable,
                  public SkipsStepOnDevice {
 public:
  using torch::optim::Adam::Adam;
  torch::Tensor step(LossClosure closure = nullptr) override;

  std::string graph_capture_blocker() const override;
  void set_graph_mode(bool on) override;
  void prepare_graph_step() override;

  bool skips_step_on_device() const override;
  void skip_step_if(at::Tensor found_inf) override;
  void undo_step_counts() override;

 private:
  std::shared_ptr<detail::FusedGraph> graph_;
  detail::DeviceSkip skip_;
};

} // namespace optimizer
} // namespace nn
} // namespace colossalai
