// HybridAdam's device (GPU) step path: LibTorch's fused Adam / AdamW kernel,
// else multi-tensor ATen ops, over the parameters that are not on the CPU
// (CUDA builds only).

#include "hybrid_adam_internal.h"

#include <colossalai/utils/compat.h>

#include "grad_slices.h"

#include <ATen/ATen.h>

#include <map>
#include <tuple>

namespace colossalai {
namespace nn {
namespace optimizer {

#ifdef COLOSSALAI_WITH_CUDA
namespace detail {
namespace {

// The fused kernel (one pass per tensor, as ColossalAI's own multi-tensor
// Adam) for parameters of one group, device and step count: it applies one
// lr, one weight decay and one bias correction to the whole call. Returns
// the items it left for the multi-tensor path.
std::vector<DeviceItem> fused_update(std::vector<DeviceItem>& items) {
  using Key = std::tuple<const HybridAdamOptions*, std::string, int64_t>;
  std::map<Key, std::vector<DeviceItem*>> calls;
  std::vector<DeviceItem> rest;
  for (auto& it : items) {
    // The kernel walks dense storage: strided tensors take the other path.
    if (it.options == nullptr || !it.options->bias_correction() ||
        !compat::has_fused_adam(it.param.device()) ||
        !it.param.is_contiguous() || !it.grad.is_contiguous() ||
        !it.state->exp_avg().is_contiguous() ||
        !it.state->exp_avg_sq().is_contiguous()) {
      rest.push_back(it);
      continue;
    }
    calls[{it.options, it.param.device().str(), it.state->step()}].push_back(&it);
  }
  for (auto& [key, call] : calls) {
    const auto& o = *std::get<0>(key);
    std::vector<at::Tensor> ps, gs, ms, vs;
    for (auto* it : call) {
      ps.push_back(it->param);
      gs.push_back(it->grad);
      ms.push_back(it->state->exp_avg());
      vs.push_back(it->state->exp_avg_sq());
    }
    // 16-bit gradients of the float32 masters (NOTE [Gradient shards in
    // bf16]) a slice at a time.
    fused_adam_in_slices(
        ps,
        gs,
        ms,
        vs,
        {},
        at::full(
            {static_cast<int64_t>(call.size())},
            static_cast<double>(std::get<2>(key)),
            ps.front().options().dtype(at::kFloat))
            .unbind(0),
        o.lr(),
        std::get<0>(o.betas()),
        std::get<1>(o.betas()),
        o.weight_decay(),
        o.eps(),
        /*amsgrad=*/false,
        /*decoupled=*/o.adamw_mode());
  }
  return rest;
}

} // namespace

void device_update(std::vector<DeviceItem>& all) {
  auto items = fused_update(all);
  if (!items.empty()) {
    std::vector<torch::Tensor> ps, gs, ms, vs;
    std::vector<at::Scalar> b1, omb1, b2, omb2, eps, sbc2, step, decay;
    for (auto& it : items) {
      it.grad = it.grad.to(at::kFloat); // the foreach ops: one dtype
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
  }
  for (auto& it : all) {
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
