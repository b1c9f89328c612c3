#pragma once

/// Hugging Face model directories: `from_pretrained` reads what
/// transformers' `save_pretrained` writes (`config.json` plus
/// `model.safetensors`, a sharded `model.safetensors.index.json`, or
/// `pytorch_model.bin` / its index) into a model of this library, and
/// `save_pretrained` writes a directory transformers' `from_pretrained`
/// reads. Parameter names are Hugging Face's: a GPT-2 checkpoint of a bare
/// `GPT2Model` (no `transformer.` prefix) loads as well, a tied head's
/// `lm_head.weight` is accepted and not written, and old checkpoints'
/// buffers (GPT-2's `attn.bias`, LLaMA's `rotary_emb.inv_freq`) are skipped.
///
/// Families: `GPT2LMHeadModel` (model_type gpt2), `LlamaForCausalLM`
/// (llama, mistral, qwen2, qwen3, and the mixtures of experts mixtral,
/// qwen2_moe, qwen3_moe: per-expert tensors as transformers saves them), `OPTForCausalLM` (opt),
/// `BloomForCausalLM` (bloom) and `BertForMaskedLM` (bert); each family's
/// header declares its functions (GPT-2's and LLaMA's are here). A config this
/// library cannot compute exactly (another activation, rope type or attention
/// variant) is refused naming the field, rather than loaded into a model that
/// would give other logits.
///
/// Directories from elsewhere are read defensively: config.json's fields are
/// checked for type and range before use (an error names the file and the
/// field: `config.json: field 'n_head' must be a positive integer, got 0`),
/// JSON files are read only when they are regular files of at most 64 MiB
/// nested at most 64 levels, and every tensor's shape is compared with the
/// weight files' headers before the model is allocated (its shapes come from
/// a lazy build), so a config far larger than its weights is refused
/// without allocating it. A sharded checkpoint's tensor is taken from the
/// shard its index names.
///
/// A model built whole loads and saves here; a boosted model is loaded by
/// building it from the directory's config, boosting, and
/// `booster.load_model(model, dir)` (each rank reads only what it holds),
/// and saved as a Hugging Face directory with
/// `booster.save_model(model, dir, SaveModelOptions().shard(true)
/// .use_safetensors(true))` plus `save_pretrained_config(config, dir)`.
///
/// Example:
/// \code
///   namespace models = colossalai::models;
///   auto model = models::from_pretrained<models::LlamaForCausalLM>("llama");
///   auto logits = model->forward(ids, attention_mask);
///   models::save_pretrained(model, "llama-tuned");
/// \endcode

#include <colossalai/models/bert.h>
#include <colossalai/models/bloom.h>
#include <colossalai/models/gpt2.h>
#include <colossalai/models/llama.h>
#include <colossalai/models/opt.h>
#include <colossalai/models/pretrained_io.h>

#include <string>

namespace colossalai {
namespace models {

/// A family's config from the text of a config.json (Hugging Face's field
/// names); the text is kept in `source_json`, so save_pretrained writes the
/// fields the struct does not model (token ids, ...) back unchanged.
GPT2Config gpt2_config_from_json(const std::string& json);
LlamaConfig llama_config_from_json(const std::string& json);
/// config.json's text for a config: `source_json` with the modelled fields
/// written over it.
std::string config_to_json(const GPT2Config& config);
std::string config_to_json(const LlamaConfig& config);

template <>
GPT2LMHeadModel from_pretrained<GPT2LMHeadModel>(
    const std::string& dir,
    const FromPretrainedOptions& options);
template <>
LlamaForCausalLM from_pretrained<LlamaForCausalLM>(
    const std::string& dir,
    const FromPretrainedOptions& options);

/// Writes config.json and the weights of a model held whole by this process
/// (unboosted, or under a plugin that keeps it whole such as TorchDDP).
void save_pretrained(
    GPT2LMHeadModel& model,
    const std::string& dir,
    const SavePretrainedOptions& options = SavePretrainedOptions());
void save_pretrained(
    LlamaForCausalLM& model,
    const std::string& dir,
    const SavePretrainedOptions& options = SavePretrainedOptions());

/// Writes only `dir`/config.json (beside weights a booster saved).
void save_pretrained_config(const GPT2Config& config, const std::string& dir);
void save_pretrained_config(const LlamaConfig& config, const std::string& dir);

} // namespace models
} // namespace colossalai
