#include <colossalai/interface/optimizer.h>

#include <cmath>
#include <limits>

namespace colossalai {
namespace interface {

OptimizerWrapper::OptimizerWrapper(
    std::shared_ptr<torch::optim::Optimizer> optim)
    : optim_(std::move(optim)) {
  TORCH_CHECK(optim_ != nullptr, "OptimizerWrapper: the optimizer is null");
}

void OptimizerWrapper::step() {
  optim_->step();
}

void OptimizerWrapper::zero_grad(bool set_to_none) {
  // Implemented here rather than through Optimizer::zero_grad, whose default
  // differs between LibTorch 1.13 (zeros) and 2.x (drops).
  for (auto& group : optim_->param_groups()) {
    for (auto& p : group.params()) {
      if (!p.mutable_grad().defined()) {
        continue;
      }
      if (set_to_none) {
        p.mutable_grad() = at::Tensor();
      } else {
        p.mutable_grad().detach_();
        p.mutable_grad().zero_();
      }
    }
  }
}

void OptimizerWrapper::backward(const at::Tensor& loss, bool retain_graph) {
  TORCH_CHECK(
      loss.numel() == 1,
      "backward: the loss must be a scalar, got shape ",
      loss.sizes());
  loss.backward({}, retain_graph);
}

std::vector<at::Tensor> OptimizerWrapper::parameters() const {
  std::vector<at::Tensor> out;
  for (auto& group : optim_->param_groups()) {
    for (auto& p : group.params()) {
      out.push_back(p);
    }
  }
  return out;
}

double grad_norm(const std::vector<at::Tensor>& params, double norm_type) {
  // Norm of the per-tensor norms, in fp32, as torch.nn.utils does: one host
  // sync for the whole model.
  const bool inf = std::isinf(norm_type);
  std::vector<at::Tensor> norms;
  for (auto& p : params) {
    const auto& g = p.grad();
    if (g.defined()) {
      norms.push_back(
          inf ? g.abs().max().to(at::kFloat)
              : g.to(at::kFloat).norm(norm_type));
    }
  }
  if (norms.empty()) {
    return 0.0;
  }
  auto all = at::stack(norms);
  return (inf ? all.max() : all.norm(norm_type)).item<double>();
}

void scale_grads(const std::vector<at::Tensor>& params, double factor) {
  for (auto& p : params) {
    if (p.grad().defined()) {
      p.mutable_grad().mul_(factor);
    }
  }
}

double OptimizerWrapper::clip_grad_by_norm(double max_norm, double norm_type) {
  TORCH_CHECK(max_norm > 0, "clip_grad_by_norm: max_norm must be positive");
  TORCH_CHECK(norm_type > 0, "clip_grad_by_norm: norm_type must be positive");
  auto params = parameters();
  double norm = grad_norm(params, norm_type);
  // Same rule and epsilon as torch.nn.utils.clip_grad_norm_.
  double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    scale_grads(params, coef);
  }
  return norm;
}

void OptimizerWrapper::clip_grad_by_value(double clip_value) {
  TORCH_CHECK(clip_value >= 0, "clip_grad_by_value: clip_value must be >= 0");
  for (auto& p : parameters()) {
    if (p.grad().defined()) {
      p.mutable_grad().clamp_(-clip_value, clip_value);
    }
  }
}

} // namespace interface
} // namespace colossalai
