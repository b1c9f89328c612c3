// HybridAdam's device (GPU) step path over the parameters that are not on
// the CPU (CUDA builds only): AdamW with bias correction by our kernel
// (kernels::adamw_step_, where built), else LibTorch's fused Adam / AdamW
// kernel, else multi-tensor ATen ops.

#include "hybrid_adam_internal.h"

#include <colossalai/kernels/adamw.h>
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

// AdamW with bias correction (HybridAdam's default) by kernels::adamw_step_:
// one pass per element that reads the gradient in its dtype (a 16-bit
// gradient of a float32 master is not converted first, NOTE [Gradient
// shards in bf16]) and writes the working copy (no copy pass after). One
// call per group, device, gradient dtype and working dtype; the items it
// takes are marked `done`. Needs the CUDA kernels; without them it takes
// nothing.
void kernel_update(
    std::vector<DeviceItem>& items,
    const torch::Tensor& found_inf) {
  using Key = std::tuple<const HybridAdamOptions*, std::string, int, int>;
  std::map<Key, std::vector<DeviceItem*>> calls;
  for (auto& it : items) {
    const auto& m = it.state->exp_avg();
    const auto& v = it.state->exp_avg_sq();
    if (it.options == nullptr || !it.options->adamw_mode() ||
        !it.options->bias_correction() || !it.param.is_contiguous() ||
        !it.grad.is_contiguous() || !m.is_contiguous() || !v.is_contiguous() ||
        (it.working.defined() && !it.working.is_contiguous()) ||
        !kernels::adamw_step_fused_applies(
            {it.param}, {it.grad}, {it.working})) {
      continue;
    }
    const int working = it.working.defined()
        ? static_cast<int>(it.working.scalar_type())
        : -1;
    calls[{it.options,
           it.param.device().str(),
           static_cast<int>(it.grad.scalar_type()),
           working}]
        .push_back(&it);
  }
  for (auto& [key, call] : calls) {
    const auto& o = *std::get<0>(key);
    std::vector<at::Tensor> ps, gs, ms, vs, ws;
    std::vector<int64_t> steps;
    for (auto* it : call) {
      ps.push_back(it->param);
      gs.push_back(it->grad);
      ms.push_back(it->state->exp_avg());
      vs.push_back(it->state->exp_avg_sq());
      ws.push_back(it->working);
      steps.push_back(it->state->step());
      it->done = true;
    }
    kernels::adamw_step_(
        ps,
        gs,
        ms,
        vs,
        ws,
        steps,
        adamw_kernel_options(o),
        found_inf);
  }
}

// The fused kernel (one pass per tensor, as ColossalAI's own multi-tensor
// Adam) for parameters of one group, device and step count: it applies one
// lr, one weight decay and one bias correction to the whole call. Returns
// the items it left for the multi-tensor path.
std::vector<DeviceItem> fused_update(
    std::vector<DeviceItem>& items,
    const torch::Tensor& found_inf) {
  using Key = std::tuple<const HybridAdamOptions*, std::string, int64_t>;
  std::map<Key, std::vector<DeviceItem*>> calls;
  std::vector<DeviceItem> rest;
  for (auto& it : items) {
    if (it.done) {
      continue;
    }
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
        /*decoupled=*/o.adamw_mode(),
        found_inf);
  }
  return rest;
}

} // namespace

void device_update(
    std::vector<DeviceItem>& all,
    const torch::Tensor& found_inf) {
  kernel_update(all, found_inf);
  auto items = fused_update(all, found_inf);
  // The multi-tensor ops take no verdict: read it (skips_step_on_device
  // said no where such items come).
  if (!items.empty() && found_inf.defined() &&
      found_inf.item<float>() != 0.0f) {
    items.clear();
  }
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
    if (it.working.defined() && !it.done) {
      it.working.view(-1).copy_(it.param.reshape(-1));
    }
  }
}

} // namespace detail
#endif

} // namespace optimizer
} // namespace nn
} // namespace colossalai
