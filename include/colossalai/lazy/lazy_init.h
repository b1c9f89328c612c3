#pragma once

/// Lazy initialization (ColossalAI's `LazyInitContext`): modules built
/// inside the scope allocate no parameter memory, and `materialize` later
/// computes their values exactly as eager construction would have.
///
/// NOTE [Lazy initialization]
/// While a context is open, every tensor its thread creates is a meta
/// tensor (shape and dtype, no memory), and every operation run on this
/// thread is recorded in order with its arguments: factories, the
/// initialisers (uniform_, normal_, zero_, fill_, ...), and whatever else a
/// constructor computes (a position table, a tied copy). This rides on
/// LibTorch's dispatcher (the DeferredInit dispatch key, with a fallback
/// that records the call and runs it on meta). `materialize` replays the
/// recording on real tensors from the random generator's state at the
/// context's entry, so every value equals eager construction under the same
/// seed; tensors the module does not keep are freed right after their last
/// use, and an initialiser whose result a later one overwrites (a layer's
/// own init, redrawn by the model) draws its random numbers into a scratch
/// tensor, so the peak is what is kept plus about one tensor in flight. A
/// kept tensor is installed in place (the same TensorImpl, so modules'
/// members, optimizers and hooks that hold it see the real data), or, through
/// `keep`, a smaller tensor instead (a rank's shard).
/// Checkpoint loads (`load_model`, before boost) install the file's tensors
/// into a lazy model directly: no random draw for a weight the file holds.
/// Limits: a constructor that reads values (`item()`, a branch on data)
/// fails in the context; the default CPU generator is the one replayed, and
/// it is not advanced by a lazy construction (later random draws differ
/// from an eager program's). At boost, TorchFSDPPlugin and GeminiPlugin
/// materialise with a `keep` that writes each parameter's piece into this
/// rank's shard of its unit, and HybridParallelPlugin's tensor-parallel
/// layers register their cut (`transform_lazy`) while sharding and each
/// pipeline stage keeps its own layers only, so no rank holds the whole
/// model; the other plugins materialise it whole.
///
/// Example:
/// \code
///   torch::manual_seed(0);
///   namespace cm = colossalai::models;
///   cm::GPT2LMHeadModel model{nullptr};
///   {
///     colossalai::lazy::LazyInitContext ctx;
///     model = cm::GPT2LMHeadModel(cm::GPT2Config()); // no weights yet
///   }
///   colossalai::lazy::materialize(*model); // == eager under seed 0
///   // or: booster.boost(model, optimizer) materialises it
/// \endcode

#include <ATen/core/Tensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <functional>
#include <memory>
#include <string>

namespace torch {
namespace nn {
class Module;
} // namespace nn
} // namespace torch

namespace colossalai {
namespace lazy {

class Recording;

/// RAII scope of lazy construction on the calling thread. Contexts do not
/// nest.
class LazyInitContext {
 public:
  LazyInitContext();
  ~LazyInitContext();
  LazyInitContext(const LazyInitContext&) = delete;
  LazyInitContext& operator=(const LazyInitContext&) = delete;

  /// Forgets what this context recorded: its tensors stay meta tensors
  /// (shapes and dtypes) but are no longer lazy, and the recording's memory
  /// is freed with them. For a module built only to read its shapes.
  void discard();

 private:
  std::shared_ptr<Recording> recording_;
};

/// RAII: operations in its scope run eagerly even inside a LazyInitContext
/// (neither recorded nor on meta tensors). For what a constructor derives
/// from its config and keeps outside its parameters and buffers (LLaMA's
/// rotary frequencies): materialize would not fill it.
class EagerGuard {
 public:
  EagerGuard() : guard_(c10::DispatchKey::DeferredInit) {}

 private:
  c10::impl::ExcludeDispatchKeyGuard guard_;
};

/// Whether `t` was created in a LazyInitContext and not materialised yet.
bool is_lazy(const at::Tensor& t);
/// Whether any parameter or buffer of `module` is lazy.
bool is_lazy(const torch::nn::Module& module);

/// Given a tensor's dotted name and its full value, what to install in its
/// place (the full tensor, or this rank's shard of it).
using KeepFn =
    std::function<at::Tensor(const std::string& name, const at::Tensor& full)>;

/// Computes every lazy parameter and buffer of `module` (see NOTE [Lazy
/// initialization]) and installs it in place, or what `keep` returns for
/// it. Tensors of other modules recorded in the same context stay lazy.
void materialize(torch::nn::Module& module, const KeepFn& keep = nullptr);

/// Defers a change of the lazy tensor `t` to its materialisation:
/// `transform` maps its full value to what is installed (before `keep`);
/// false when `t` is not lazy. Tensor-parallel layers shard a lazy
/// parameter this way, so it is never whole.
bool transform_lazy(
    const at::Tensor& t,
    std::function<at::Tensor(const at::Tensor&)> transform);

/// Installs a copy of `value` (in `t`'s dtype) in place of the lazy tensor
/// `t`; false when `t` is not lazy. Checkpoint loads go through it, so a
/// lazy model's weights come from the file and are never drawn at random
/// first; what the file lacks stays lazy for `materialize`.
bool assign_lazy(const at::Tensor& t, const at::Tensor& value);

/// Installs `value` itself (no copy; its dtype, which may differ from
/// `t`'s) in place of the lazy tensor `t`; false when `t` is not lazy.
/// from_pretrained fills tensors of the dtype it loads in this way, so a
/// model is never whole in float32 first.
bool install_lazy(const at::Tensor& t, const at::Tensor& value);

} // namespace lazy
} // namespace colossalai
