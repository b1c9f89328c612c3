#pragma once

#include <torch/optim/optimizer.h>

#include <memory>
#include <string>
#include <vector>

namespace colossalai {
namespace distributed {
class ProcessGroup;
} // namespace distributed
namespace interface {

/// The boosted optimizer: works with every `torch::optim` optimizer (SGD,
/// Adam, AdamW, RMSprop, Adagrad, or your own). Plugins and mixed precision
/// derive from it to add loss scaling, sharding or gradient reduction.
///
/// Example:
/// \code
///   booster.backward(loss, *boosted.optimizer);
///   boosted.optimizer->clip_grad_by_norm(1.0);
///   boosted.optimizer->step();
///   boosted.optimizer->zero_grad();
/// \endcode
class OptimizerWrapper {
 public:
  explicit OptimizerWrapper(std::shared_ptr<torch::optim::Optimizer> optim);
  virtual ~OptimizerWrapper() = default;

  virtual void step();
  /// set_to_none=true (PyTorch 2's default) drops the gradients; false zeros
  /// them in place.
  virtual void zero_grad(bool set_to_none = true);
  virtual void backward(const at::Tensor& loss, bool retain_graph = false);
  /// What `backward` differentiates: the loss times the loss scale (fp16),
  /// else the loss (pipelines run backward themselves).
  virtual at::Tensor scale_loss(const at::Tensor& loss) {
    return loss;
  }
  /// Scales gradients so their global `norm_type`-norm is at most `max_norm`;
  /// returns the norm before clipping (inf for norm_type = inf).
  virtual double clip_grad_by_norm(double max_norm, double norm_type = 2.0);
  /// clip_grad_by_norm with nothing read back to the host, as Python's
  /// clip_grad_norm_ returns it: the norm as a float32 scalar on the
  /// gradients' device, the coefficient max_norm / (norm + 1e-6) formed in
  /// float32 there, clamped to 1 and always applied. A step captured in a
  /// CUDA graph (booster::GraphedStep) may clip so. Where the norm needs a
  /// host-side reduction (several ranks' shards, a mesh, fp16's unscale)
  /// the wrapper refuses by name.
  virtual at::Tensor clip_grad_by_norm_tensor(
      double max_norm,
      double norm_type = 2.0);
  virtual void clip_grad_by_value(double clip_value);
  /// Completes what the host's state owes to the last step, where that
  /// step's verdict stayed on the device (fp16 mixed precision with a
  /// fused Adam: an overflowing step skipped there takes its step counts
  /// back here). Waits only for a device that has not passed that step.
  /// The booster calls it before the optimizer's state is saved or loaded;
  /// the next step() calls it first.
  virtual void synchronize_step() {}

  /// CUDA graphs (booster::GraphedStep; NOTE [Captured optimizer steps]).
  /// Why this optimizer's step cannot be captured, or empty where it can:
  /// the booster's own wrapper (no plugin; fp32 or bf16) over an
  /// nn::optimizer::GraphCapturable optimizer (FusedAdamW, FusedAdam) can,
  /// and LowLevelZeroPlugin's at one rank; every other wrapper says why not.
  virtual std::string graph_capture_blocker() const;
  /// Graph mode of the optimizer (GraphCapturable::set_graph_mode).
  virtual void set_graph_mode(bool on);
  /// The host's half of the next replayed step
  /// (GraphCapturable::prepare_graph_step).
  virtual void prepare_graph_step();
  /// Called on the capture's stream before the first warm-up step: what
  /// the wrapper made on another stream and the captured step runs
  /// through is made again on this one (LowLevelZero's gradient hooks,
  /// whose accumulator nodes run on the stream they were made on).
  virtual void prepare_graph_stream() {}
  /// Called on the step's stream after each replay: what the host learns
  /// from a replay later (fp16's overflow verdict) is queued here.
  virtual void after_graph_replay() {}
  /// Makes graph_capture_blocker() say `why` (a plugin that leaves this
  /// wrapper as it is but communicates in the model's backward).
  void refuse_graph_capture(std::string why) {
    graph_refusal_ = std::move(why);
  }

  std::vector<torch::optim::OptimizerParamGroup>& param_groups() {
    return optim_->param_groups();
  }
  /// Every parameter of every group.
  std::vector<at::Tensor> parameters() const;
  /// The user's optimizer.
  torch::optim::Optimizer& unwrap() {
    return *optim_;
  }
  const std::shared_ptr<torch::optim::Optimizer>& optimizer_ptr() const {
    return optim_;
  }

 protected:
  /// The user's optimizer's own blocker (GraphCapturable), or why it has
  /// none.
  std::string optimizer_graph_blocker() const;
  /// What refuse_graph_capture set (empty: nothing).
  const std::string& graph_refusal() const {
    return graph_refusal_;
  }

  std::shared_ptr<torch::optim::Optimizer> optim_;

 private:
  std::string graph_refusal_;
};

/// The one global-gradient-norm rule of every optimizer wrapper: each
/// tensor's `norm_type`-norm in fp32, then combined. Without `group`, the
/// tensors are the whole model's gradients and the result is
/// torch.nn.utils.clip_grad_norm_'s (norm of the norms, in fp32). With a
/// `group`, the tensors are this rank's disjoint shards: the partials
/// (sum of norm^p in double, or the max) are all-reduced over the group on
/// the tensors' device. Undefined and empty tensors are skipped.
double total_norm(
    const std::vector<at::Tensor>& tensors,
    double norm_type,
    const distributed::ProcessGroup* group = nullptr);
/// The same over several groups in turn (e.g. the data-parallel shards,
/// then the tensor-parallel group): partials combined over each.
double total_norm(
    const std::vector<at::Tensor>& tensors,
    double norm_type,
    const std::vector<const distributed::ProcessGroup*>& groups);
/// total_norm over `groups` without reading it back: a float64 scalar on
/// the device of the last reduction (the tensors' where none ran), for
/// scale_by_clip_coef. The sharded optimizers clip by it inside their
/// step, so that step makes a GPU's host wait for nothing.
at::Tensor total_norm_on_device(
    const std::vector<at::Tensor>& tensors,
    double norm_type,
    const std::vector<const distributed::ProcessGroup*>& groups);
/// total_norm of the whole model's `tensors` without reading it back: a
/// float32 scalar on the first tensor's device (0 for none), so a step
/// captured in a CUDA graph may clip by it.
at::Tensor total_norm_tensor(
    const std::vector<at::Tensor>& tensors,
    double norm_type);
/// Scales `grads` in place so their total norm is at most `max_norm`, with
/// torch.nn.utils.clip_grad_norm_'s arithmetic on the device (the float32
/// coefficient clamped to 1, always applied; one copy of it per device);
/// returns total_norm_tensor(grads). Nothing is read back.
at::Tensor clip_grads_on_device(
    const std::vector<at::Tensor>& grads,
    double max_norm,
    double norm_type);
/// Scales `grads` in place by torch.nn.utils.clip_grad_norm_'s coefficient
/// for the scalar tensor `norm`: max_norm / (norm + 1e-6) in norm's dtype,
/// clamped to 1, in float32 (on a GPU in the gradients' one dtype), copied
/// once per device of `grads`. On a GPU it is always applied (a product by
/// 1 is exact); host gradients are read through only below 1. A NaN norm
/// makes the gradients NaN, as torch's does.
void scale_by_clip_coef(
    const std::vector<at::Tensor>& grads,
    const at::Tensor& norm,
    double max_norm);
/// total_norm of the parameters' gradients.
double grad_norm(const std::vector<at::Tensor>& params, double norm_type);
void scale_grads(const std::vector<at::Tensor>& params, double factor);

} // namespace interface
} // namespace colossalai
