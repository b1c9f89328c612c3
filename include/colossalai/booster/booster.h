#pragma once

/// The Booster: one call turns a single-process LibTorch training setup into
/// the parallel strategy a plugin implements (`colossalai.booster.Booster`).
///
/// Example:
/// \code
///   colossalai::launch_from_env();
///   namespace cb = colossalai::booster;
///   auto plugin = std::make_shared<cb::plugin::TorchDDPPlugin>();
///   cb::Booster booster(cb::BoosterOptions().plugin(plugin)
///                           .mixed_precision("bf16"));
///   Net model;
///   auto optimizer = std::make_shared<torch::optim::AdamW>(
///       model->parameters(), torch::optim::AdamWOptions(1e-3));
///   auto boosted = booster.boost(model, optimizer, criterion);
///   auto loss = boosted.criterion(boosted.model(x), y);
///   booster.backward(loss, *boosted.optimizer);
///   boosted.optimizer->step();
///   boosted.optimizer->zero_grad();
/// \endcode

#include <colossalai/booster/mixed_precision/mixed_precision_base.h>
#include <colossalai/booster/plugin/plugin_base.h>
#include <colossalai/booster/training_checkpoint.h>
#include <colossalai/checkpoint_io/checkpoint_io_base.h>
#include <colossalai/interface/model.h>
#include <colossalai/interface/optimizer.h>
#include <colossalai/lora/lora_config.h>
#include <colossalai/quantization/bnb.h>

#include <torch/arg.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace colossalai {
namespace data {
template <class Dataset>
class DistributedDataLoader;
} // namespace data
namespace lora {
class LoraModel;
} // namespace lora
} // namespace colossalai

namespace colossalai {
namespace booster {

using Criterion =
    std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>;

// Named outside BoosterOptions, whose mixed_precision() hides the namespace.
using MixedPrecisionPtr = std::shared_ptr<mixed_precision::MixedPrecision>;

struct BoosterOptions {
  /// "cpu", "cuda" or "" (the launched rank's device).
  TORCH_ARG(std::string, device) = "";
  /// "fp16", "bf16", "fp32" or "" (none). Applied by the Booster unless the
  /// plugin controls precision.
  TORCH_ARG(std::string, mixed_precision) = "";

 public:
  /// A configured policy (`FP16TorchMixedPrecision` with its scaler options,
  /// `BF16MixedPrecision`), as the specification's Booster also takes; sets
  /// `mixed_precision()` to its name. A plugin that applies its own
  /// precision refuses it (its options carry the scaler's).
  BoosterOptions& mixed_precision(MixedPrecisionPtr policy) {
    mixed_precision_ = policy ? policy->name() : "";
    mixed_precision_policy_ = std::move(policy);
    return *this;
  }
  /// The policy given to `mixed_precision`, while its name is still the
  /// chosen precision.
  MixedPrecisionPtr mixed_precision_policy() const {
    return mixed_precision_policy_ &&
            mixed_precision_policy_->name() == mixed_precision_
        ? mixed_precision_policy_
        : nullptr;
  }
  /// The parallel strategy; null trains in this process alone.
  TORCH_ARG(std::shared_ptr<plugin::Plugin>, plugin) = nullptr;
  /// From the end of `boost` on, freed host memory stays in the process
  /// (glibc's heap serves every block, large ones too, and keeps up to
  /// 1 GiB of free top): each step's tensors reuse the last step's pages
  /// instead of faulting in fresh ones (NOTE [Freed host memory stays in
  /// the process]). Like a caching allocator, the heap then keeps its
  /// peak. Applied after the model is built and sharded, to the whole
  /// process. False leaves malloc's settings alone.
  TORCH_ARG(bool, retain_freed_memory) = true;

 private:
  MixedPrecisionPtr mixed_precision_policy_;
};

namespace detail {
template <class T>
std::shared_ptr<torch::nn::Module> as_module(
    const torch::nn::ModuleHolder<T>& m) {
  return m.ptr();
}
template <class T>
std::shared_ptr<torch::nn::Module> as_module(const std::shared_ptr<T>& m) {
  return m;
}

// Whether a type forward returns may hold tensors for the wrappers' output
// transform: a tensor, or a tuple, pair or vector of such types.
template <class T>
struct holds_tensors : std::is_same<T, at::Tensor> {};
template <class... T>
struct holds_tensors<std::tuple<T...>> : std::disjunction<holds_tensors<T>...> {
};
template <class A, class B>
struct holds_tensors<std::pair<A, B>>
    : std::disjunction<holds_tensors<A>, holds_tensors<B>> {};
template <class T, class A>
struct holds_tensors<std::vector<T, A>> : holds_tensors<T> {};

/// Collectives this process has issued, on every group.
uint64_t collectives_issued();
/// In the catch block of a forward or backward (`pass`) that raised, with
/// collectives_issued() from before it: where it had issued any, every
/// rank must have raised after the same ones, or the run cannot go on and
/// a DistributedError replaces the error (NOTE [A backward that raised on
/// some ranks] in src/distributed/raised_backward.h); a backward's
/// leftovers are then dropped.
void after_raised_pass(const char* pass, uint64_t issued);
} // namespace detail

/// A boosted model, called with the user module's own forward signature: the
/// call goes straight to `M::forward`, with the plugin's and mixed
/// precision's work around it. `M` is a module holder (`TORCH_MODULE`) or a
/// `std::shared_ptr` to a module.
template <class M>
class BoostedModel {
 public:
  // Empty (a null holder): a default-constructed module holder would build a
  // whole default-configured model, which may be huge.
  BoostedModel() : module_(nullptr) {}
  BoostedModel(M module, std::shared_ptr<interface::ModelWrapper> wrapper)
      : module_(std::move(module)), wrapper_(std::move(wrapper)) {}

  template <class... Args>
  auto operator()(Args&&... args) {
    // Before the wrappers' pre-forward work, which may gather parameters.
    const uint64_t issued = detail::collectives_issued();
    Scope scope(*wrapper_);
    try {
      using R =
          decltype(module_->forward(prepare(std::forward<Args>(args))...));
      if constexpr (std::is_void_v<R>) {
        module_->forward(prepare(std::forward<Args>(args))...);
      } else {
        return finish<std::decay_t<R>>(
            module_->forward(prepare(std::forward<Args>(args))...));
      }
    } catch (...) {
      detail::after_raised_pass("forward", issued);
      throw;
    }
  }

  /// `M::forward_loss` (the causal families' loss without the logits,
  /// NOTE [Fused causal-LM loss] in models/transformer.h) with the same
  /// work around it as a call: `boosted.model.forward_loss(ids, targets)`.
  template <class... Args>
  auto forward_loss(Args&&... args) {
    // Before the wrappers' pre-forward work, which may gather parameters.
    const uint64_t issued = detail::collectives_issued();
    Scope scope(*wrapper_);
    try {
      return finish<std::decay_t<decltype(module_->forward_loss(
          prepare(std::forward<Args>(args))...))>>(
          module_->forward_loss(prepare(std::forward<Args>(args))...));
    } catch (...) {
      detail::after_raised_pass("forward", issued);
      throw;
    }
  }

  /// The user's module (parameters, train()/eval(), children), with its
  /// weights complete (ModelWrapper::synchronize_weights).
  M& unwrap() {
    wrapper_->synchronize_weights();
    return module_;
  }
  const std::shared_ptr<interface::ModelWrapper>& wrapper() const {
    return wrapper_;
  }
  void train(bool on = true) {
    module_->train(on);
  }
  void eval() {
    module_->eval();
  }
  std::vector<at::Tensor> parameters() const {
    wrapper_->synchronize_weights();
    return module_->parameters();
  }

 private:
  // Tensor arguments pass through the wrappers' input transform; the rest
  // are forwarded untouched.
  template <class T>
  decltype(auto) prepare(T&& arg) {
    if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
      return wrapper_->prepare_input(arg);
    } else {
      return std::forward<T>(arg);
    }
  }

  // Tensors forward returns pass through the wrappers' output transform,
  // also inside tuples, pairs and vectors; anything else is returned as is.
  template <class R>
  R finish(R result) {
    finish_in_place(result);
    return result;
  }
  template <class T>
  void finish_in_place(T& value) {
    if constexpr (std::is_same_v<T, at::Tensor>) {
      value = wrapper_->finish_output(value);
    } else if constexpr (detail::holds_tensors<T>::value) {
      finish_elements(value);
    }
  }
  template <class... E>
  void finish_elements(std::tuple<E...>& t) {
    finish_tuple(t, std::index_sequence_for<E...>{});
  }
  template <class Tuple, size_t... I>
  void finish_tuple(Tuple& t, std::index_sequence<I...>) {
    (finish_element<std::tuple_element_t<I, Tuple>>(std::get<I>(t)), ...);
  }
  template <class A, class B>
  void finish_elements(std::pair<A, B>& p) {
    finish_element<A>(p.first);
    finish_element<B>(p.second);
  }
  template <class T, class A>
  void finish_elements(std::vector<T, A>& v) {
    for (auto& e : v) {
      finish_in_place(e);
    }
  }
  // A const or reference member (another object's tensor) is left alone.
  template <class Declared, class T>
  void finish_element(T& e) {
    if constexpr (
        !std::is_reference_v<Declared> && !std::is_const_v<Declared> &&
        detail::holds_tensors<Declared>::value) {
      finish_in_place(e);
    }
  }

  struct Scope {
    explicit Scope(interface::ModelWrapper& w) : w_(w) {
      w_.enter_forward();
    }
    ~Scope() {
      w_.exit_forward();
    }
    interface::ModelWrapper& w_;
  };

  M module_;
  std::shared_ptr<interface::ModelWrapper> wrapper_;
};

/// What `boost` returns; works with structured bindings.
template <class M, class D, class S>
struct Boosted {
  BoostedModel<M> model;
  std::shared_ptr<interface::OptimizerWrapper> optimizer;
  Criterion criterion;
  D dataloader;
  S lr_scheduler;
};

class Booster {
 public:
  explicit Booster(BoosterOptions options = BoosterOptions());

  /// Wraps the training objects for the plugin's strategy. Optimizer,
  /// criterion, data loader and scheduler may be absent (null); the data
  /// loader and scheduler are passed through (create the loader with the
  /// plugin's `prepare_dataloader` to shard data). Tensor arguments of the
  /// boosted model, and the criterion's target, move to the device the
  /// model runs on (as torch's DDP moves its inputs).
  template <class M, class D = std::nullptr_t, class S = std::nullptr_t>
  Boosted<M, D, S> boost(
      M model,
      std::shared_ptr<torch::optim::Optimizer> optimizer = nullptr,
      Criterion criterion = nullptr,
      D dataloader = nullptr,
      S lr_scheduler = nullptr) {
    auto parts = boost_parts(detail::as_module(model), std::move(optimizer));
    if (criterion) {
      // The target follows the output to its device, as the model's inputs
      // do (a CPU data loader feeds a GPU model).
      criterion = [c = std::move(criterion)](
                      const at::Tensor& out, const at::Tensor& target) {
        return c(
            out,
            target.defined() && target.device() != out.device()
                ? target.to(out.device())
                : target);
      };
    }
    return Boosted<M, D, S>{
        BoostedModel<M>(std::move(model), std::move(parts.first)),
        std::move(parts.second),
        std::move(criterion),
        std::move(dataloader),
        std::move(lr_scheduler)};
  }

  /// Injects LoRA adapters into `model` (ColossalAI's `booster.
  /// enable_lora`): from `lora_config`, or, with `pretrained_dir`, as the
  /// PEFT adapter saved there says (then pass no config), trainable. Call
  /// it before `boost`, which then refreshes the adapters before every
  /// forward and leaves the frozen parameters out of the optimizer (build
  /// it from `model->parameters()` or only the trainable ones). The plugin
  /// must support LoRA (none, TorchDDP, LowLevelZero, HybridParallel at
  /// tp_size 1 and pp_size 1). See NOTE [LoRA in C++].
  ///
  /// QLoRA: with `quantize`, the frozen base's linear layers are then
  /// quantized in place as `bnb_quantization_config` says (none: NF4 with
  /// double quantization, computed in bf16, ColossalAI's default); the
  /// model must be built from colossalai's Linear1D layers (the models of
  /// colossalai::models are). The base cannot be saved afterwards: save the
  /// adapters, and load the full-precision checkpoint into a quantized
  /// model, which quantizes it. See NOTE [QLoRA in C++].
  /// \code
  ///   auto lora = booster.enable_lora(
  ///       model, "", lora::LoraConfig().r(8).target_modules({"c_attn"}));
  ///   auto boosted = booster.boost(model, optimizer);
  ///   // ... train ...
  ///   booster.save_lora_as_pretrained(boosted.model, "adapter");
  ///   // QLoRA: the same, with a 4-bit base
  ///   booster.enable_lora(model, "", lora_config,
  ///       quantization::BnbQuantizationConfig().load_in_4bit(true)
  ///           .bnb_4bit_quant_type("nf4"), /*quantize=*/true);
  /// \endcode
  template <class M>
  std::shared_ptr<lora::LoraModel> enable_lora(
      M& model,
      const std::string& pretrained_dir = "",
      const std::optional<lora::LoraConfig>& lora_config = std::nullopt,
      const std::optional<quantization::BnbQuantizationConfig>&
          bnb_quantization_config = std::nullopt,
      bool quantize = false) {
    return enable_lora_module(
        detail::as_module(model),
        pretrained_dir,
        lora_config,
        bnb_quantization_config,
        quantize);
  }
  /// Writes the adapter as PEFT's `save_pretrained` does
  /// (adapter_config.json and adapter_model.safetensors or .bin) from
  /// rank 0; every rank calls it.
  template <class M>
  void save_lora_as_pretrained(
      BoostedModel<M>& model,
      const std::string& checkpoint,
      bool use_safetensors = false) {
    save_lora_as_pretrained(*model.wrapper(), checkpoint, use_safetensors);
  }
  void save_lora_as_pretrained(
      interface::ModelWrapper& model,
      const std::string& checkpoint,
      bool use_safetensors = false);

  /// loss.backward() through the optimizer (loss scaling, plugin hooks).
  void backward(const at::Tensor& loss, interface::OptimizerWrapper& optimizer);

  /// Gradient synchronization is off while the guard lives (gradient
  /// accumulation). Fails if the plugin does not support it.
  template <class M>
  plugin::NoSyncGuard no_sync(
      BoostedModel<M>& model,
      interface::OptimizerWrapper* optimizer = nullptr) {
    return no_sync(*model.wrapper(), optimizer);
  }
  plugin::NoSyncGuard no_sync(
      interface::ModelWrapper& model,
      interface::OptimizerWrapper* optimizer = nullptr);

  /// One training step of a pipelined model (`colossalai.booster.Booster.
  /// execute_pipeline`): every rank calls it; `data_iter` gives the step's
  /// batch, which is cut into micro-batches along dim 0; the loss (averaged
  /// over the micro-batches) comes back on the rank holding the last stage.
  /// Then `optimizer->step()` as usual.
  ///
  /// \code
  ///   auto out = booster.execute_pipeline(
  ///       [&] { return pipeline::Batch{ids, targets}; }, boosted.model,
  ///       [&](const at::Tensor& logits, const pipeline::Batch& mb) {
  ///         return model->loss(logits, mb[1]);
  ///       },
  ///       boosted.optimizer.get());
  ///   boosted.optimizer->step();
  /// \endcode
  template <class M>
  pipeline::PipelineOutput execute_pipeline(
      const pipeline::DataIterator& data_iter,
      BoostedModel<M>& model,
      const pipeline::PipelineCriterion& criterion,
      interface::OptimizerWrapper* optimizer = nullptr,
      bool return_loss = true,
      bool return_outputs = false) {
    return execute_pipeline(
        data_iter,
        *model.wrapper(),
        criterion,
        optimizer,
        return_loss,
        return_outputs);
  }
  pipeline::PipelineOutput execute_pipeline(
      const pipeline::DataIterator& data_iter,
      interface::ModelWrapper& model,
      const pipeline::PipelineCriterion& criterion,
      interface::OptimizerWrapper* optimizer = nullptr,
      bool return_loss = true,
      bool return_outputs = false);
  /// Saves the model's weights: one file (safetensors or PyTorch .bin), or
  /// with `shard` a directory of shards plus a Hugging Face index; for a
  /// colossalai::models model also its config.json (and
  /// generation_config.json), as ColossalAI writes them, so transformers'
  /// from_pretrained reads the directory.
  template <class M>
  void save_model(
      BoostedModel<M>& model,
      const std::string& checkpoint,
      const checkpoint_io::SaveModelOptions& options = {}) {
    checkpoint_io_->save_model(*model.wrapper(), checkpoint, options);
  }
  /// Loads weights saved by save_model (or by Python / Hugging Face tools):
  /// a file, a sharded directory or its index file. With `strict`, missing
  /// and unexpected keys are errors, except LoRA adapters' tensors: a base
  /// model's checkpoint loads strictly after `enable_lora`, the adapters
  /// keeping their values. A refused load (those keys, a shape or dtype
  /// that does not fit, a tied weight trained untied) is refused before
  /// anything is copied: the model keeps its values.
  template <class M>
  void load_model(
      BoostedModel<M>& model,
      const std::string& checkpoint,
      bool strict = true) {
    checkpoint_io_->load_model(*model.wrapper(), checkpoint, strict);
  }
  void save_optimizer(
      interface::OptimizerWrapper& optimizer,
      const std::string& checkpoint,
      const checkpoint_io::SaveOptimizerOptions& options = {});
  void load_optimizer(
      interface::OptimizerWrapper& optimizer,
      const std::string& checkpoint);
  void save_lr_scheduler(
      const nn::lr_scheduler::LRScheduler& scheduler,
      const std::string& checkpoint);
  void load_lr_scheduler(
      nn::lr_scheduler::LRScheduler& scheduler,
      const std::string& checkpoint);
  /// Saves a training checkpoint `DIR/checkpoint-<state.step>`: the model
  /// (a LoRA model's adapters), the optimizer, the scheduler when given and
  /// `state`, committed together or not at all, keeping the newest
  /// `keep_last` (NOTE [Training checkpoints]). Every rank calls it.
  template <class M>
  void save_checkpoint(
      const std::string& dir,
      const TrainingState& state,
      BoostedModel<M>& model,
      interface::OptimizerWrapper* optimizer,
      nn::lr_scheduler::LRScheduler* scheduler = nullptr,
      const TrainingCheckpointOptions& options = {}) {
    save_checkpoint(dir, state, *model.wrapper(), optimizer, scheduler, options);
  }
  void save_checkpoint(
      const std::string& dir,
      const TrainingState& state,
      interface::ModelWrapper& model,
      interface::OptimizerWrapper* optimizer,
      nn::lr_scheduler::LRScheduler* scheduler = nullptr,
      const TrainingCheckpointOptions& options = {});
  /// Loads the newest complete checkpoint of `dir` that matches its
  /// manifest (naming on stderr any newer one it skipped, and why) and
  /// returns its state; with none (or no `dir`), returns the state of a
  /// fresh start (step 0) and loads nothing. Every rank calls it; they load
  /// the same set, at any world size and under any plugin.
  template <class M>
  TrainingState resume_or_start(
      const std::string& dir,
      BoostedModel<M>& model,
      interface::OptimizerWrapper* optimizer,
      nn::lr_scheduler::LRScheduler* scheduler = nullptr) {
    return resume_or_start(dir, *model.wrapper(), optimizer, scheduler);
  }
  TrainingState resume_or_start(
      const std::string& dir,
      interface::ModelWrapper& model,
      interface::OptimizerWrapper* optimizer,
      nn::lr_scheduler::LRScheduler* scheduler = nullptr);
  /// As above, and puts `loader` where the checkpoint's training stood: its
  /// epoch, and the rest of that epoch (set_samples_seen of the state's
  /// `samples_in_epoch`), split over the ranks now present. Save with
  /// `TrainingState().epoch(e).samples_in_epoch(loader->samples_seen(b))`.
  template <class M, class Dataset>
  TrainingState resume_or_start(
      const std::string& dir,
      BoostedModel<M>& model,
      interface::OptimizerWrapper* optimizer,
      nn::lr_scheduler::LRScheduler* scheduler,
      data::DistributedDataLoader<Dataset>& loader) {
    TrainingState state =
        resume_or_start(dir, *model.wrapper(), optimizer, scheduler);
    loader.set_epoch(state.epoch());
    loader.set_samples_seen(static_cast<size_t>(state.samples_in_epoch()));
    return state;
  }
  /// The checkpoint IO in use (the plugin's, or the general one).
  checkpoint_io::CheckpointIO& checkpoint_io() {
    return *checkpoint_io_;
  }

  const std::shared_ptr<plugin::Plugin>& plugin() const {
    return plugin_;
  }
  const at::Device& device() const {
    return device_;
  }
  const BoosterOptions& options() const {
    return options_;
  }

 private:
  std::pair<
      std::shared_ptr<interface::ModelWrapper>,
      std::shared_ptr<interface::OptimizerWrapper>>
  boost_parts(
      std::shared_ptr<torch::nn::Module> model,
      std::shared_ptr<torch::optim::Optimizer> optimizer);

  std::shared_ptr<lora::LoraModel> enable_lora_module(
      std::shared_ptr<torch::nn::Module> model,
      const std::string& pretrained_dir,
      const std::optional<lora::LoraConfig>& lora_config,
      const std::optional<quantization::BnbQuantizationConfig>& bnb_config,
      bool quantize);

  BoosterOptions options_;
  // Models given LoRA adapters, and models boosted, by identity.
  std::map<const torch::nn::Module*, std::shared_ptr<lora::LoraModel>> lora_;
  std::set<const torch::nn::Module*> boosted_;
  std::shared_ptr<plugin::Plugin> plugin_;
  std::shared_ptr<mixed_precision::MixedPrecision> mixed_precision_;
  std::shared_ptr<checkpoint_io::CheckpointIO> checkpoint_io_;
  at::Device device_{at::kCPU};
};

} // namespace booster
} // namespace colossalai
