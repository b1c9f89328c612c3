#pragma once

// Runs a callback right after autograd accumulated a leaf parameter's
// gradient into .grad (internal; used by DDP and ZeRO gradient reduction).

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>

#include <functional>
#include <memory>

namespace colossalai {
namespace utils {

/// Installs `fn` as a post-hook of `param`'s gradient accumulator and
/// returns the accumulator, which the caller must keep alive (the parameter
/// holds it only weakly). Returns null when `param` is not a leaf that
/// requires grad.
std::shared_ptr<torch::autograd::Node> on_grad_accumulated(
    const at::Tensor& param,
    std::function<void()> fn);

} // namespace utils
} // namespace colossalai
