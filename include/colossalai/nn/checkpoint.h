#pragma once

/// Activation checkpointing (`torch.utils.checkpoint`, reentrant): run a
/// function without keeping its intermediate activations; backward runs it
/// again, with the random streams, autocast state and FP8 linear scope
/// (quantization/fp8_linear.h) of the first run, and
/// back-propagates through the recomputation. Memory for a block's
/// activations is traded for one more forward of it.
///
/// Parameter gradients arrive through the recomputation's backward, inside
/// the outer one, so gradient hooks (DDP, ZeRO) fire as usual. When no
/// input requires grad (a frozen embedding's output under LoRA), the first
/// floating input is marked so that they still do (PyTorch's reentrant
/// variant leaves them without; transformers' enable_input_require_grads
/// does the same marking). Collectives inside `fn` run again in backward,
/// in the same order on every rank.
///
/// Example:
/// \code
///   auto y = colossalai::nn::checkpoint(
///       [&](const at::Tensor& h) { return block->forward(h); }, x,
///       block.ptr().get()); // block's own random streams replay too
/// \endcode

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace torch {
namespace nn {
class Module;
} // namespace nn
} // namespace torch

namespace colossalai {
namespace nn {

/// A module with random streams of its own (not only the device's default
/// generator), which a recomputation must replay: `snapshot_random_state`
/// returns a closure that puts them back where they are now.
class RandomStateOwner {
 public:
  virtual ~RandomStateOwner() = default;
  virtual std::function<void()> snapshot_random_state() = 0;
};

using CheckpointFunction =
    std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

/// `fn(inputs)` without saved activations (see the file comment). `owner`:
/// a module whose submodules (itself included) that are RandomStateOwners
/// replay their streams in the recomputation; may be null.
std::vector<at::Tensor> checkpoint(
    const CheckpointFunction& fn,
    const std::vector<at::Tensor>& inputs,
    torch::nn::Module* owner = nullptr);

/// One input, one output.
at::Tensor checkpoint(
    const std::function<at::Tensor(const at::Tensor&)>& fn,
    const at::Tensor& input,
    torch::nn::Module* owner = nullptr);

/// Whether this thread is running a checkpointed function again in
/// backward (its recomputation). A sharded model's units gather there as
/// for their backward: the first run's gathers were released.
bool in_checkpoint_recompute();

} // namespace nn
} // namespace colossalai
