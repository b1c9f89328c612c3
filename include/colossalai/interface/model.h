#pragma once

#include <torch/nn/module.h>

#include <memory>
#include <utility>

namespace colossalai {
namespace interface {

/// What plugins and mixed precision see of a boosted model: the user's module
/// (type-erased) plus the work they do around each forward. Wrappers nest: a
/// mixed-precision wrapper may hold a plugin's wrapper, which holds the module.
///
/// Users call the model through `booster::BoostedModel<M>`, which keeps the
/// module's own forward signature and calls `pre_forward`/`post_forward`.
class ModelWrapper {
 public:
  explicit ModelWrapper(std::shared_ptr<torch::nn::Module> module);
  explicit ModelWrapper(std::shared_ptr<ModelWrapper> inner);
  virtual ~ModelWrapper() = default;

  /// The user's module, with every wrapper removed.
  const std::shared_ptr<torch::nn::Module>& unwrap() const {
    return module_;
  }
  /// The wrapper this one wraps, or null.
  const std::shared_ptr<ModelWrapper>& inner() const {
    return inner_;
  }

  /// Run before/after every forward, outermost first for pre and innermost
  /// first for post. `post_forward` also runs when forward throws.
  void enter_forward();
  void exit_forward() noexcept;

  /// Completes the weight updates the last step left in flight in this
  /// wrapper or one it wraps (ZeRO's overlap_allgather): the module's
  /// parameters then hold the last step's values. A forward through the
  /// boosted model waits for what it uses by itself, and the booster calls
  /// this before it saves or loads the model; call it before reading the
  /// weights any other way between a step and the next forward.
  void synchronize_weights();

  /// Applied to every tensor argument of forward, innermost wrapper first
  /// (e.g. a cast of floating inputs to the training dtype).
  at::Tensor prepare_input(const at::Tensor& input) {
    return transform_input(inner_ ? inner_->prepare_input(input) : input);
  }
  /// Applied to every tensor forward returns (alone, or in a tuple, pair or
  /// vector), innermost wrapper first (e.g. GeminiPlugin's
  /// force_outputs_fp32).
  at::Tensor finish_output(const at::Tensor& output) {
    return transform_output(inner_ ? inner_->finish_output(output) : output);
  }

 protected:
  virtual at::Tensor transform_input(const at::Tensor& input) {
    return input;
  }
  virtual at::Tensor transform_output(const at::Tensor& output) {
    return output;
  }
  virtual void pre_forward() {}
  virtual void post_forward() noexcept {}
  /// This wrapper's part of synchronize_weights.
  virtual void finish_weight_updates() {}

 private:
  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<ModelWrapper> inner_;
};

/// Finds the wrapper of type W in the chain starting at `model`, or null.
template <class W>
W* find_wrapper(ModelWrapper& model) {
  for (ModelWrapper* m = &model; m != nullptr; m = m->inner().get()) {
    if (auto* w = dynamic_cast<W*>(m)) {
      return w;
    }
  }
  return nullptr;
}

} // namespace interface
} // namespace colossalai
