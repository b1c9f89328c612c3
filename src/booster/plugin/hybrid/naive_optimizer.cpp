#include "naive_optimizer.h"
#include "../../../distributed/raised_backward.h"

#include <colossalai/placement/gradients.h>

#include <unordered_set>

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
  distributed::detail::guard_step([this] {
    sum_partial_grads();
    if (max_norm_ > 0) {
      clip_on_device(max_norm_, 2.0);
    }
    optim_->step();
    summed_ = false;
  });
}

void HybridParallelNaiveOptimizer::zero_grad(bool set_to_none) {
  summed_ = false;
  interface::OptimizerWrapper::zero_grad(set_to_none);
}

at::Tensor HybridParallelNaiveOptimizer::clip_grad_by_norm_tensor(
    double /*max_norm*/,
    double /*norm_type*/) {
  TORCH_CHECK(
      false,
      "clip_grad_by_norm_tensor: HybridParallelPlugin's global norm over the "
      "mesh is reduced on the host; use clip_grad_by_norm, or the plugin's "
      "max_norm");
  return at::Tensor();
}

double HybridParallelNaiveOptimizer::clip_grad_by_norm(
    double max_norm,
    double norm_type) {
  TORCH_CHECK(max_norm > 0, "clip_grad_by_norm: max_norm must be positive");
  TORCH_CHECK(norm_type > 0, "clip_grad_by_norm: norm_type must be positive");
  return clip_on_device(max_norm, norm_type).item<double>();
}

at::Tensor HybridParallelNaiveOptimizer::clip_on_device(
    double max_norm,
    double norm_type) {
  sum_partial_grads();
  const auto params = parameters();
  const auto grads = grads_of(params);
  at::Tensor norm;
  if (ep_ == nullptr) {
    norm = placement::global_grad_norm_on_device(
        *table_, params, grads, norm_type);
  } else {
    // Experts differ per expert-parallel rank, the rest is the same on
    // each: that is counted on ep rank 0 only, then the ep group sums.
    std::unordered_set<const void*> expert;
    for (const auto& p : experts_) {
      expert.insert(p.unsafeGetTensorImpl());
    }
    std::vector<at::Tensor> counted;
    for (size_t i = 0; i < params.size(); ++i) {
      if (table_->counts_once(params[i]) &&
          (ep_->rank() == 0 || expert.count(params[i].unsafeGetTensorImpl()))) {
        counted.push_back(grads[i]);
      }
    }
    std::vector<const distributed::ProcessGroup*> groups{ep_.get()};
    for (const auto* g : table_->reduction_groups()) {
      groups.push_back(g);
    }
    norm = interface::total_norm_on_device(counted, norm_type, groups);
  }
  // torch.nn.utils.clip_grad_norm_'s rule and epsilon.
  interface::scale_by_clip_coef(grads, norm, max_norm);
  return norm;
}

void HybridParallelNaiveOptimizer::set_experts(
    std::vector<at::Tensor> params,
    distributed::ProcessGroupPtr moe_dp,
    distributed::ProcessGroupPtr ep) {
  experts_ = std::move(params);
  moe_dp_ = std::move(moe_dp);
  ep_ = std::move(ep);
}

void HybridParallelNaiveOptimizer::sum_partial_grads() {
  if (summed_) {
    return;
  }
  summed_ = true; // once per step, whoever asks first
  if (moe_dp_ != nullptr && moe_dp_->size() > 1) {
    // Every expert has a gradient (each runs, on no rows too): one
    // all-reduce of them all, then the mean.
    std::vector<at::Tensor> grads;
    for (auto& p : experts_) {
      if (!p.grad().defined()) {
        p.mutable_grad() = at::zeros_like(p);
      }
      grads.push_back(p.mutable_grad());
    }
    placement::sum_flat(grads, *moe_dp_);
    for (auto& g : grads) {
      g.div_(moe_dp_->size());
    }
  }
  if (!table_->has_partial()) {
    return;
  }
  const auto params = parameters();
  const auto grads = grads_of(params);
  placement::sum_partial_grads(*table_, params, grads);
}

} // namespace detail
} // namespace plugin
} // namespace booster
} // namespace colossalai
