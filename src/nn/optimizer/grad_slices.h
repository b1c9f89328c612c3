#pragma once

// Gradients of another dtype than their parameters (bf16 gradients of
// float32 masters, NOTE [Gradient shards in bf16]) for kernels that read
// one dtype per call (ATen's fused Adam, the foreach ops): converted a
// slice of tensors at a time, so the float32 copies alive at once stay
// bounded instead of doubling every gradient's bytes for the whole step.
// Shared by FusedAdam / FusedAdamW and HybridAdam's device step, with the
// AdamW kernel's options taken from a group's.

#include <colossalai/kernels/adamw.h>
#include <colossalai/utils/compat.h>

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <vector>

namespace colossalai {
namespace nn {
namespace optimizer {
namespace detail {

/// Elements of converted gradients alive at once (256 MiB of float32);
/// a single larger tensor is converted alone.
constexpr int64_t kGradSliceElements = int64_t{1} << 26;

/// Calls `fn(lo, hi, grads)` over consecutive ranges [lo, hi) covering
/// `grads`, `grads` holding that range converted to `dtype`, at most
/// `max_elements` of them per call unless one tensor alone is larger: one
/// call with the tensors themselves when every one has `dtype` already.
template <class Fn>
void in_grad_slices(
    const std::vector<at::Tensor>& grads,
    at::ScalarType dtype,
    Fn&& fn,
    int64_t max_elements = kGradSliceElements) {
  bool converted = false;
  for (const auto& g : grads) {
    converted = converted || g.scalar_type() != dtype;
  }
  if (!converted) {
    fn(size_t{0}, grads.size(), grads);
    return;
  }
  size_t lo = 0;
  while (lo < grads.size()) {
    std::vector<at::Tensor> slice;
    int64_t elements = 0;
    size_t hi = lo;
    while (hi < grads.size() &&
           (hi == lo || elements + grads[hi].numel() <= max_elements)) {
      elements += grads[hi].numel();
      slice.push_back(grads[hi].to(dtype));
      ++hi;
    }
    fn(lo, hi, slice);
    lo = hi;
  }
}

/// Elements [lo, hi) of `v` (empty stays empty: an unused list).
inline std::vector<at::Tensor> sub(
    const std::vector<at::Tensor>& v,
    size_t lo,
    size_t hi) {
  if (v.empty()) {
    return {};
  }
  return std::vector<at::Tensor>(
      v.begin() + static_cast<std::ptrdiff_t>(lo),
      v.begin() + static_cast<std::ptrdiff_t>(hi));
}

/// compat::fused_adam_ over tensors whose gradients may be 16-bit
/// (float32 parameters): in slices of at most `max_elements` (see
/// in_grad_slices), each with its gradients converted. `Lr` is a double, or
/// a float32 device tensor (LibTorch 2.2+); `found_inf` as compat's.
template <class Lr>
void fused_adam_in_slices(
    const std::vector<at::Tensor>& params,
    const std::vector<at::Tensor>& grads,
    const std::vector<at::Tensor>& exp_avgs,
    const std::vector<at::Tensor>& exp_avg_sqs,
    const std::vector<at::Tensor>& max_exp_avg_sqs,
    const std::vector<at::Tensor>& state_steps,
    const Lr& lr,
    double beta1,
    double beta2,
    double weight_decay,
    double eps,
    bool amsgrad,
    bool decoupled,
    const at::Tensor& found_inf = at::Tensor(),
    int64_t max_elements = kGradSliceElements) {
  if (params.empty()) {
    return;
  }
  in_grad_slices(
      grads,
      params.front().scalar_type(),
      [&](size_t lo, size_t hi, const std::vector<at::Tensor>& converted) {
        compat::fused_adam_(
            sub(params, lo, hi),
            converted,
            sub(exp_avgs, lo, hi),
            sub(exp_avg_sqs, lo, hi),
            sub(max_exp_avg_sqs, lo, hi),
            sub(state_steps, lo, hi),
            lr,
            beta1,
            beta2,
            weight_decay,
            eps,
            amsgrad,
            decoupled,
            found_inf.defined() ? c10::optional<at::Tensor>(found_inf)
                                : c10::nullopt);
      },
      max_elements);
}

/// kernels::adamw_step_'s options from an optimizer group's (LibTorch's
/// AdamWOptions, HybridAdamOptions): lr, betas, eps, weight decay.
template <class Options>
kernels::AdamWStepOptions adamw_kernel_options(const Options& o) {
  return kernels::AdamWStepOptions()
      .lr(o.lr())
      .beta1(std::get<0>(o.betas()))
      .beta2(std::get<1>(o.betas()))
      .eps(o.eps())
      .weight_decay(o.weight_decay());
}

} // namespace detail
} // namespace optimizer
} // namespace nn
} // namespace colossalai
