#include "naive_optimizer.h"

#include <colossalai/placement/gradients.h>

namespace colossalai {
namespace booster {
namespace plugin {
namespace detail {

namespace {

std::vector<at::Tensor> grads_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> grads;
  grads.reserve(params.size());
  for (const auto& p : params) {
    grads.push_back(p.grad());
  }
  return grads;
}

} // namespace

HybridParallelNaiveOptimizer::HybridParallelNaiveOptimizer(
    std::shared_ptr<torch::optim::Optimizer> optim,
    std::shared_ptr<const placement::PlacementTable> table,
    double max_norm)
    : interface::OptimizerWrapper(std::move(optim)),
      table_(std::move(table)),
      max_norm_(max_norm) {
  TORCH_INTERNAL_ASSERT(table_ != nullptr);
}

void HybridParallelNaiveOptimizer::step() {
  sum_partial_grads();
  if (max_norm_ > 0) {
    clip_grad_by_norm(max_norm_, 2.0);
  }
  optim_->step();
  summed_ = false;
}

void HybridParallelNaiveOptimizer::zero_grad(bool set_to_none) {
  summed_ = false;
  interface::OptimizerWrapper::zero_grad(set_to_none);
}

double HybridParallelNaiveOptimizer::clip_grad_by_norm(
    double max_norm,
    double norm_type) {
  TORCH_CHECK(max_norm > 0, "clip_grad_by_norm: max_norm must be positive");
  TORCH_CHECK(norm_type > 0, "clip_grad_by_norm: norm_type must be positive");
  sum_partial_grads();
  const auto params = parameters();
  const auto grads = grads_of(params);
  const double norm =
      placement::global_grad_norm(*table_, params, grads, norm_type);
  // Same rule and epsilon as torch.nn.utils.clip_grad_norm_.
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    interface::scale_grads(params, coef);
  }
  return norm;
}

void HybridParallelNaiveOptimizer::sum_partial_grads() {
  if (!table_->has_partial() || summed_) {
    return;
  }
  summed_ = true; // once per step, whoever asks first
  const auto params = parameters();
  const auto grads = grads_of(params);
  placement::sum_partial_grads(*table_, params, grads);
}

} // namespace detail
} // namespace plugin
} // namespace booster
} // namespace colossalai
