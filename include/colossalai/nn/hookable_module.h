#pragma once

/// Forward hooks for LibTorch modules.
///
/// C++ modules have no forward hooks: `forward` is an ordinary, non-virtual
/// member function. Strategies that must act around a sub-module's forward
/// (FSDP gathers a unit's parameters before it and frees them after) need the
/// module to open a scope in its own forward. A module opts in by deriving
/// from `HookableModule` as well as `torch::nn::Module`; without hooks set,
/// the scope costs a null check.
///
/// Example:
/// \code
///   struct BlockImpl : torch::nn::Module, colossalai::nn::HookableModule {
///     at::Tensor forward(const at::Tensor& x) {
///       auto scope = forward_scope(); // hooks run here ...
///       auto y = x + mlp(ln(x));
///       return scope.exit(y);         // ... and here
///     }
///   };
/// \endcode

#include <ATen/core/Tensor.h>

#include <memory>

namespace colossalai {
namespace nn {

/// What a strategy does around a module's forward.
class ForwardHooks {
 public:
  virtual ~ForwardHooks() = default;
  /// Before the module's computation.
  virtual void pre_forward() = 0;
  /// After it, given the output; returns what forward returns.
  virtual at::Tensor post_forward(const at::Tensor& output) = 0;
  /// Instead of post_forward when forward threw.
  virtual void abort_forward() noexcept {}
};

class HookableModule;

/// Open for the duration of a module's forward; `exit` hands the output to
/// the hooks. Leaving the scope without `exit` (an exception) aborts.
class ForwardScope {
 public:
  explicit ForwardScope(ForwardHooks* hooks);
  ForwardScope(ForwardScope&& other) noexcept;
  ForwardScope(const ForwardScope&) = delete;
  ForwardScope& operator=(const ForwardScope&) = delete;
  ForwardScope& operator=(ForwardScope&&) = delete;
  ~ForwardScope();

  /// Runs the post-forward hook on `output` and returns its result.
  at::Tensor exit(const at::Tensor& output);

 private:
  ForwardHooks* hooks_;
};

/// Mixin for modules whose forward opens a `ForwardScope`.
class HookableModule {
 public:
  virtual ~HookableModule() = default;

  /// Installs hooks (replacing any); null removes them.
  void set_forward_hooks(std::shared_ptr<ForwardHooks> hooks) {
    hooks_ = std::move(hooks);
  }
  const std::shared_ptr<ForwardHooks>& forward_hooks() const {
    return hooks_;
  }

 protected:
  /// Call first thing in forward and keep the result until the output is
  /// ready.
  ForwardScope forward_scope() {
    return ForwardScope(hooks_.get());
  }

 private:
  std::shared_ptr<ForwardHooks> hooks_;
};

} // namespace nn
} // namespace colossalai
