// FullyShardedModel's forward and backward hooks: the gradient hooks, the
// root's forward hooks and input cast, and no_sync.

#include "state.h"

#include <exception>

namespace colossalai {
namespace zero {

namespace detail {

void FsdpState::install_grad_hooks() {
  std::vector<at::Tensor> params;
  for (const auto& e : grad_params) {
    params.push_back(units[e.first].params[e.second]);
  }
  if (bucketer == nullptr) {
    // Units complete in reverse execution order, the same on every rank:
    // reduce each as it completes, at most two in flight (bounds memory).
    distributed::GradBucketerOptions bo;
    bo.ordered = false;
    bo.max_in_flight = 2;
    bo.complete_local_at_once = true; // one rank: each shard at once
    bucketer = std::make_shared<distributed::GradBucketer>(
        params.size(), std::move(buckets), this, bo);
  }
  size_t bad = 0;
  TORCH_CHECK(
      bucketer->attach_hooks(params, &bad),
      "FSDP: parameter '",
      units[grad_params[bad].first].param_names[grad_params[bad].second],
      "' is not a leaf");
}

} // namespace detail

at::Tensor FullyShardedModel::transform_input(const at::Tensor& x) {
  return x.defined() && x.is_floating_point() &&
          x.scalar_type() != state_->param_dtype
      ? x.to(state_->param_dtype)
      : x;
}

void FullyShardedModel::pre_forward() {
  state_->root_pre_forward();
}

void FullyShardedModel::post_forward() noexcept {
  try {
    state_->root_post_forward();
  } catch (const std::exception& e) {
    TORCH_WARN("FSDP: releasing parameters after forward failed: ", e.what());
  }
}

void FullyShardedModel::set_require_sync(bool require) {
  TORCH_CHECK(
      !state_->in_backward(), "FSDP: no_sync cannot change during backward");
  state_->set_require_sync(require);
}

} // namespace zero
} // namespace colossalai
