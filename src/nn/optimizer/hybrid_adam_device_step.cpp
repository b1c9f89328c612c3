// HybridAdam's device (GPU) step path: multi-tensor ATen ops over the
// parameters that are not on the CPU (CUDA builds only).

#include "hybrid_adam_internal.h"

#include <ATen/ATen.h>

namespace colossalai {
namespace nn {
namespace optimizer {

#ifdef COLOSSALAI_WITH_CUDA
namespace detail {

// GPU parameters: the same arithmetic as the CPU kernel as multi-tensor
// (_foreach) ATen ops, with per-parameter constants as scalar lists.
void device_update(std::vector<DeviceItem>& items) {
  if (items.empty()) {
    return;
  }
  std::vector<torch::Tensor> ps, gs, ms, vs;
  std::vector<at::Scalar> b1, omb1, b2, omb2, eps, sbc2, step, decay;
  for (auto& it : items) {
    if (it.scalars.l2 != 0.f) {
      it.grad = it.grad.add(it.param, it.scalars.l2);
    }
    ps.push_back(it.param);
    gs.push_back(it.grad);
    ms.push_back(it.state->exp_avg());
    vs.push_back(it.state->exp_avg_sq());
    b1.emplace_back(it.scalars.beta1);
    omb1.emplace_back(it.scalars.one_minus_beta1);
    b2.emplace_back(it.scalars.beta2);
    omb2.emplace_back(it.scalars.one_minus_beta2);
    eps.emplace_back(it.scalars.eps);
    sbc2.emplace_back(it.scalars.sqrt_bias_correction2);
    step.emplace_back(it.scalars.neg_step_size);
    decay.emplace_back(it.scalars.decay);
  }
  at::_foreach_mul_(ps, decay);
  at::_foreach_mul_(ms, b1);
  at::_foreach_add_(ms, at::_foreach_mul(gs, omb1));
  at::_foreach_mul_(vs, b2);
  at::_foreach_addcmul_(vs, gs, gs, omb2);
  auto denom = at::_foreach_sqrt(vs);
  at::_foreach_div_(denom, sbc2);
  at::_foreach_add_(denom, eps);
  at::_foreach_addcdiv_(ps, ms, denom, step);
  for (auto& it : items) {
    if (it.working.defined()) {
      it.working.view(-1).copy_(it.param.reshape(-1));
    }
  }
}

} // namespace detail
#endif

} // namespace optimizer
} // namespace nn
} // namespace colossalai
