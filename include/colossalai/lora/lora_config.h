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
  /// The adapters' rank: at most each adapted layer's min(in, out), since
  /// B A has no higher rank (checked before anything is allocated).
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
  /// string form: Python's re.fullmatch); used when not empty. Python's
  /// `re` syntax without backreferences, atomic groups, possessive
  /// quantifiers, conditionals or verbose mode, at most 4096 characters and
  /// 64 nested groups; matched in time linear in the name, whatever the
  /// pattern (NOTE [Module regexes] in src/lora/module_regex.h).
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
  /// Reads adapter_config.json's text; errors name `file` and the field (a
  /// value of the wrong type, out of range, JSON nested over 128 levels).
  static LoraConfig from_json(const std::string& text, const std::string& file);
  /// Checks every field (r > 0, lora_alpha finite, lora_dropout in [0, 1),
  /// the names, the regex compiles); errors name the field.
  void validate() const;
};

} // namespace lora
} // namespace colossalai
