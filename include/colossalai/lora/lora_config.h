#pragma once

/// LoRA's configuration, field for field PEFT's `LoraConfig` (the fields
/// ColossalAI's `booster.enable_lora` uses), so an `adapter_config.json`
/// written here loads in PEFT and one written by PEFT loads here.
///
/// Example:
/// \code
///   auto config = colossalai::lora::LoraConfig()
///                     .r(8)
///                     .lora_alpha(16)
///                     .target_modules({"c_attn", "c_proj"});
/// \endcode

#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <vector>

namespace colossalai {
namespace lora {

struct LoraConfig {
  /// The adapters' rank.
  TORCH_ARG(int64_t, r) = 8;
  /// The adapter's output is scaled by lora_alpha / r (lora_alpha / sqrt(r)
  /// with use_rslora).
  TORCH_ARG(double, lora_alpha) = 8;
  /// Dropout on the adapter path's input (training only).
  TORCH_ARG(double, lora_dropout) = 0.0;
  /// Modules to adapt, by name: a module matches when its dotted name is
  /// an entry or ends with "." + an entry (PEFT's list form).
  TORCH_ARG(std::vector<std::string>, target_modules);
  /// Or a regular expression the whole dotted name must match (PEFT's
  /// string form); used when not empty.
  TORCH_ARG(std::string, target_modules_regex);
  /// Which biases train: "none", "all" or "lora_only" (those of adapted
  /// modules); they are saved with the adapter.
  TORCH_ARG(std::string, bias) = "none";
  /// Scale by lora_alpha / sqrt(r) (rank-stabilised LoRA).
  TORCH_ARG(bool, use_rslora) = false;
  /// Modules trained in full and saved with the adapter (a task head).
  TORCH_ARG(std::vector<std::string>, modules_to_save);
  /// "default" (PEFT's true: A Kaiming-uniform, B zero; for embeddings A
  /// zero, B normal), "gaussian" (A ~ N(0, 1/r), B zero) or "none" (PEFT's
  /// false: both random, so the adapter changes the output from the start).
  TORCH_ARG(std::string, init_lora_weights) = "default";
  /// The adapted weights are stored [in, out] (Hugging Face GPT-2's
  /// Conv1D). Set when saving if any adapted layer stores them so.
  TORCH_ARG(bool, fan_in_fan_out) = false;
  /// PEFT's task type ("CAUSAL_LM", "SEQ_CLS", ...; empty: none), which
  /// picks the PeftModel class PEFT's from_pretrained builds.
  TORCH_ARG(std::string, task_type) = "";

 public:
  /// adapter_config.json's text (PEFT's fields).
  std::string to_json() const;
  /// Reads adapter_config.json's text; `file` names it in errors.
  static LoraConfig from_json(const std::string& text, const std::string& file);
  /// Checks every field; errors name the field.
  void validate() const;
};

} // namespace lora
} // namespace colossalai
