#pragma once

/// LoRA adapters injected into a LibTorch model (PEFT's `LoraModel`, as
/// ColossalAI's `booster.enable_lora` uses it): each target layer gets
/// rank-r matrices A and B, the layer computes base(x) + s * B A x with
/// s = lora_alpha / r, and every other parameter is frozen (requires_grad
/// false), so only adapters get gradients and optimizer states.
///
/// NOTE [LoRA in C++]
/// PEFT replaces target modules; in C++ a parent calls its typed child
/// (`fc->forward(x)`), so a module cannot be swapped from outside. Adapters
/// therefore attach to the modules in place, under PEFT's names (A and B
/// are registered as `<module>.lora_A.weight` / `lora_B.weight`, or
/// `lora_embedding_A` / `lora_embedding_B` for an embedding), in one of two
/// ways:
///  - colossalai's layers (`shardformer::layer::Linear1D_Col / Row`, which
///    the models of colossalai::models use) take an output adapter: the adapter
///    path s * B (A dropout(x)) runs beside the frozen matmul, so the backward
///    computes no gradient of the frozen weight, and lora_dropout works;
///  - `torch::nn::Linear` and `torch::nn::Embedding` (whose forward reads
///    their `weight` member) are reparametrised: the member becomes
///    W + s * B A, recomputed before every forward of the boosted model
///    (`refresh()`), while the registered parameter W stays frozen. Outputs
///    are the same; the backward forms the full weight gradient once per
///    layer (then reduced to A and B), and lora_dropout must be 0.
///
/// Example:
/// \code
///   auto lora = std::make_shared<LoraModel>(
///       model.ptr(), LoraConfig().r(8).target_modules({"c_attn"}));
///   // ... train (only lora->trainable_parameters() change) ...
///   lora->save_pretrained("adapter", /*use_safetensors=*/true);
///   lora->merge(); // inference without the adapter path
/// \endcode

#include <colossalai/checkpoint_io/state_dict.h>
#include <colossalai/lora/lora_config.h>

#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <vector>

namespace colossalai {
namespace lora {

class LoraModel {
 public:
  /// Injects adapters into the modules `config` targets (an error names a
  /// target that matches nothing, or a module of a kind LoRA cannot adapt)
  /// and freezes every other parameter.
  LoraModel(std::shared_ptr<torch::nn::Module> model, LoraConfig config);
  ~LoraModel();
  LoraModel(const LoraModel&) = delete;
  LoraModel& operator=(const LoraModel&) = delete;

  /// Injects as the adapter directory `dir` says (adapter_config.json) and
  /// loads its weights (adapter_model.safetensors or adapter_model.bin), as
  /// PEFT's `PeftModel.from_pretrained(model, dir, is_trainable=True)`.
  /// Only regular files are read (a FIFO or a device is refused, never
  /// waited on), the config up to 16 MiB; the adapters' shapes from the
  /// config and the model are compared with the weights file's before they
  /// are allocated.
  static std::shared_ptr<LoraModel> from_pretrained(
      std::shared_ptr<torch::nn::Module> model,
      const std::string& dir);

  const LoraConfig& config() const {
    return config_;
  }
  const std::shared_ptr<torch::nn::Module>& model() const {
    return model_;
  }
  /// The adapted modules' dotted names, in model order.
  std::vector<std::string> adapted_modules() const;
  /// The parameters that train: adapters, trained biases, modules_to_save.
  std::vector<at::Tensor> trainable_parameters() const;

  /// Recomputes the reparametrised weights (NOTE [LoRA in C++]); the
  /// boosted model calls it before every forward. Call it yourself before
  /// using a model that was not boosted.
  void refresh();
  /// Adds s * B A into the frozen weights (the adapter path is then off),
  /// and takes it out again.
  void merge();
  void unmerge();
  bool merged() const {
    return merged_;
  }

  /// The adapter's tensors under PEFT's saved names
  /// (`base_model.model.<module>.lora_A.weight`, ...), as PEFT's
  /// `get_peft_model_state_dict`: adapters, biases by `bias`, and the
  /// modules_to_save.
  checkpoint_io::StateDict adapter_state_dict() const;
  /// Copies an adapter state (PEFT's names) in; `file` names it in errors.
  /// Every adapter tensor must be present, with its shape.
  void load_adapter_state_dict(
      const checkpoint_io::StateDict& state,
      const std::string& file);
  /// Writes `dir`/adapter_config.json and `dir`/adapter_model.safetensors
  /// (or adapter_model.bin), atomically, from this process.
  void save_pretrained(const std::string& dir, bool use_safetensors) const;

  struct Layer; // internal

 private:
  // The layers `config` adapts in `model`, checked (kinds, groups, dropout,
  // r against each layer's size), before anything is allocated.
  static std::vector<std::shared_ptr<Layer>> plan(
      torch::nn::Module& model,
      const LoraConfig& config);
  // Installs the adapter paths and recomputes reparametrised weights.
  void attach();

  std::shared_ptr<torch::nn::Module> model_;
  LoraConfig config_;
  std::vector<std::shared_ptr<Layer>> layers_;
  bool merged_ = false;
};

} // namespace lora
} // namespace colossalai
