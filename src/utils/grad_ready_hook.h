#pragma once

// Runs a callback right after autograd accumulated a leaf parameter's
// gradient into .grad (internal; used by DDP and ZeRO gradient reduction).

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

namespace colossalai {
namespace utils {

/// Owning pointer to an autograd node: std::shared_ptr up to some 2.x
/// releases, c10::intrusive_ptr after; whatever this LibTorch returns.
using GradAccumulatorPtr = decltype(torch::autograd::impl::grad_accumulator(
    std::declval<const at::Tensor&>()));

/// Installs `fn` as a post-hook of `param`'s gradient accumulator and
/// returns the accumulator, which the caller must keep alive (the parameter
/// holds it only weakly). Returns null when `param` is not a leaf that
/// requires grad. An accumulator that already carries a hook of `owner`
/// (an id unique to the caller) gets no second one: something else (a
/// live autograd graph, the tasks a backward that raised left queued) may
/// keep an accumulator alive across a re-installation, which would then
/// report twice. (The accumulator's post-hook, not 2.x's
/// register_post_accumulate_grad_hook: the same place, on every version.)
GradAccumulatorPtr on_grad_accumulated(
    const at::Tensor& param,
    uint64_t owner,
    std::function<void()> fn);

} // namespace utils
} // namespace colossalai
