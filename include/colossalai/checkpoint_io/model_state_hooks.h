#pragma once

/// NOTE [Model state hooks]
/// Checkpoint IO knows formats (safetensors, .bin, indexes) and strategies
/// (who gathers, who writes) only. A feature above it whose tensors do not
/// load or save as plain copies hands in hooks, registered once when the
/// feature is first used:
/// - QLoRA (the first quantized layer): a full-precision weight is quantized
///   into its layer as it loads; a model with quantized layers is refused by
///   save_model.
/// - LoRA (a LoraModel): adapters are absent from a base model's checkpoint,
///   which still loads strictly.
/// - Lazy initialization (a LazyInitContext): a tensor with no data yet takes
///   the checkpoint's value without being initialised first.
/// - colossalai::models' families (a model built): a tied head is one
///   tensor under two names in Python's state_dict() (GPT-2's lm_head.weight
///   is transformer.wte.weight); loads accept the second name when it holds
///   the same values, and .bin saves write it, as torch.save does; a sharded
///   save writes the model's config.json (and generation_config.json).
/// Every model load and save asks each registered feature; a feature not in
/// use has nothing to say about a model (no quantized layer, no adapter key,
/// no lazy tensor), so registration is process-wide.
///
/// Example (a feature's first use):
/// \code
///   namespace ck = colossalai::checkpoint_io;
///   ck::ModelStateHooks hooks;
///   hooks.optional_key = [](const std::string& key) {
///     return key.find(".my_adapter.") != std::string::npos;
///   };
///   ck::register_model_state_hooks("my_adapter", std::move(hooks));
/// \endcode

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace colossalai {
namespace checkpoint_io {

/// One feature's part in model loads and saves; each hook may be empty.
struct ModelStateHooks {
  using Loader = std::function<void(const at::Tensor& value)>;
  /// Loaders, by the model's dotted key, of tensors the model takes in its
  /// own way (QLoRA: quantizes a full-precision weight into its layer). A
  /// key found here is loaded by its loader and by nothing else.
  std::function<std::map<std::string, Loader>(torch::nn::Module& model)>
      loaders;
  /// Keys of the model a strict load may find missing from a checkpoint
  /// (LoRA: adapters are not in the base model's files).
  std::function<bool(const std::string& key)> optional_key;
  /// Puts `value` into `target` when `target` is one of the feature's
  /// tensors that hold no data yet (lazy initialization); true when done,
  /// false to copy into it as usual.
  std::function<bool(const at::Tensor& target, const at::Tensor& value)>
      assign;
  /// Why `model` cannot be saved as a checkpoint, or empty when it can.
  std::function<std::string(torch::nn::Module& model)> save_refusal;
  /// Checkpoint keys under which Python holds a tensor `model` holds under
  /// another key (tied weights), as alias -> the model's key.
  std::function<std::map<std::string, std::string>(torch::nn::Module& model)>
      tied_keys;
  /// Files a sharded save writes beside its shards, name -> contents (the
  /// families: config.json and generation_config.json, as ColossalAI and
  /// transformers write them, so the directory is a model directory).
  std::function<std::map<std::string, std::string>(torch::nn::Module& model)>
      config_files;
};

/// Registers the hooks of feature `name`, replacing any registered under
/// that name before. Thread-safe; registering again is cheap.
void register_model_state_hooks(const std::string& name, ModelStateHooks hooks);

namespace detail {
/// The registered hooks, in registration order (a copy: loads run while a
/// feature may register).
std::vector<ModelStateHooks> model_state_hooks();
/// Every registered feature's tied keys of `model` (alias -> model key).
std::map<std::string, std::string> tied_keys(torch::nn::Module& model);
/// Every registered feature's config files of `model` (name -> contents).
std::map<std::string, std::string> config_files(torch::nn::Module& model);
} // namespace detail

} // namespace checkpoint_io
} // namespace colossalai
