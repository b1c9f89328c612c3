#pragma once

// NOTE [All-gathers overlap the next forward]
// With overlap_allgather, a ZeRO step leaves its parameter all-gathers (one
// per bucket) in flight and returns; the next forward waits for each bucket
// just before the first module that reads it, so the gathers of later
// layers travel while earlier layers compute (ColossalAI waits per operator
// through its parameter hooks; C++ modules have no such hooks, so here the
// unit is a module that opens a ForwardScope: a transformer block).
//
// Each parameter belongs to the nearest `nn::HookableModule` above it, or
// to the root when there is none (embeddings, the final norm, the head).
// A hookable module's pre-forward hook waits for the buckets of its
// parameters; the model wrapper's pre-forward waits for the root's before
// the forward begins. The steps issue the all-gathers in that order of
// first use (the root's, then module by module in registration order),
// the same on every rank, so the first ones needed arrive first.
//
// Anything else that reads the weights between a step and the next
// forward waits for all of them first: the next step, checkpoint saves and
// loads (ModelWrapper::synchronize_weights), the boosted model's
// parameters(). A parameter read outside the forward of the module that
// holds it (a parent reading a child block's weight directly) is not
// covered; such a model should leave overlap_allgather off.

#include <colossalai/zero/low_level_optimizer.h>

#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace colossalai {
namespace zero {
namespace detail {

class ForwardGatherWaits {
 public:
  /// Installs the waits on `module`'s hookable modules and orders
  /// `optimizer`'s all-gathers by first use. `who` names the plugin in
  /// errors (a module with forward hooks of its own is refused).
  ForwardGatherWaits(
      torch::nn::Module& module,
      const std::shared_ptr<LowLevelZeroOptimizer>& optimizer,
      const std::string& who);
  ~ForwardGatherWaits();
  ForwardGatherWaits(const ForwardGatherWaits&) = delete;
  ForwardGatherWaits& operator=(const ForwardGatherWaits&) = delete;

  /// Before the forward: the buckets of the parameters outside every
  /// hookable module.
  void before_forward();
  /// Every all-gather still in flight.
  void wait_all();

 private:
  std::weak_ptr<LowLevelZeroOptimizer> optimizer_;
  std::vector<size_t> root_;
  // The modules hooked, and the hooks set (removed only if still theirs).
  std::vector<std::pair<std::weak_ptr<torch::nn::Module>, const void*>> hooked_;
};

} // namespace detail
} // namespace zero
} // namespace colossalai
