// config.json <-> OPTConfig, and OPT's checkpoint key names.

#include <colossalai/models/opt.h>

#include "models/pretrained_internal.h"

#include <nlohmann/json.hpp>

namespace colossalai {
namespace models {

using json = nlohmann::json;

namespace {

using detail::ends_with;
using detail::starts_with;

using detail::get_or;
using detail::require;

json base_json(const std::string& source) {
  return source.empty() ? json::object() : detail::parse_json(source);
}

} // namespace

OPTConfig opt_config_from_json(const std::string& text) {
  const auto j = detail::parse_json(text);
  const auto type = get_or<std::string>(j, "model_type", "opt");
  TORCH_CHECK(
      type == "opt",
      "OPTConfig: config.json's model_type is '",
      type,
      "', not opt");
  const auto act = get_or<std::string>(j, "activation_function", "relu");
  TORCH_CHECK(
      act == "relu" || act == "gelu",
      "OPT config.json: activation_function '",
      act,
      "' is not supported (relu, gelu)");
  // Checkpoints fine-tuned before transformers 4.20.1 without the final
  // LayerNorm.
  require(j, "_remove_final_layer_norm", false, "OPT");
  // Layers skipped at random in training: not implemented.
  require(j, "layerdrop", 0.0, "OPT");
  require(j, "tie_word_embeddings", true, "OPT");
  OPTConfig c;
  c.vocab_size(get_or<int64_t>(j, "vocab_size", c.vocab_size()))
      .hidden_size(get_or<int64_t>(j, "hidden_size", c.hidden_size()))
      .ffn_dim(get_or<int64_t>(j, "ffn_dim", c.ffn_dim()))
      .num_hidden_layers(
          get_or<int64_t>(j, "num_hidden_layers", c.num_hidden_layers()))
      .num_attention_heads(
          get_or<int64_t>(j, "num_attention_heads", c.num_attention_heads()))
      .max_position_embeddings(get_or<int64_t>(
          j, "max_position_embeddings", c.max_position_embeddings()));
  // null (transformers' None): hidden_size.
  c.word_embed_proj_dim(get_or<int64_t>(j, "word_embed_proj_dim", 0))
      .do_layer_norm_before(
          get_or<bool>(j, "do_layer_norm_before", c.do_layer_norm_before()))
      .enable_bias(get_or<bool>(j, "enable_bias", c.enable_bias()))
      .layer_norm_elementwise_affine(get_or<bool>(
          j,
          "layer_norm_elementwise_affine",
          c.layer_norm_elementwise_affine()))
      .dropout(get_or<double>(j, "dropout", c.dropout()))
      .attention_dropout(
          get_or<double>(j, "attention_dropout", c.attention_dropout()))
      .activation_function(act)
      .init_std(get_or<double>(j, "init_std", c.init_std()))
      // Absent: transformers' default (1); null: no padding index.
      .pad_token_id(
          j.contains("pad_token_id") && j["pad_token_id"].is_null()
              ? -1
              : get_or<int64_t>(j, "pad_token_id", c.pad_token_id()))
      .source_json(text);
  return c;
}

std::string config_to_json(const OPTConfig& c) {
  auto j = base_json(c.source_json());
  j["model_type"] = "opt";
  j["architectures"] = {"OPTForCausalLM"};
  j["vocab_size"] = c.vocab_size();
  j["hidden_size"] = c.hidden_size();
  j["ffn_dim"] = c.ffn_dim();
  j["num_hidden_layers"] = c.num_hidden_layers();
  j["num_attention_heads"] = c.num_attention_heads();
  j["max_position_embeddings"] = c.max_position_embeddings();
  j["word_embed_proj_dim"] = c.resolved_word_embed_proj_dim();
  j["do_layer_norm_before"] = c.do_layer_norm_before();
  j["_remove_final_layer_norm"] = false;
  j["enable_bias"] = c.enable_bias();
  j["layer_norm_elementwise_affine"] = c.layer_norm_elementwise_affine();
  j["dropout"] = c.dropout();
  j["attention_dropout"] = c.attention_dropout();
  j["activation_function"] = c.activation_function();
  j["init_std"] = c.init_std();
  j["pad_token_id"] =
      c.pad_token_id() >= 0 ? json(c.pad_token_id()) : json(nullptr);
  j["tie_word_embeddings"] = true;
  return j.dump(2) + "\n";
}

template <>
OPTForCausalLM from_pretrained<OPTForCausalLM>(
    const std::string& dir,
    const FromPretrainedOptions& options) {
  const auto text = detail::read_config_json(dir);
  return detail::load_pretrained_model<OPTForCausalLM>(
      dir,
      text,
      opt_config_from_json(text),
      options,
      [](const std::string& key) -> std::string {
        if (key == "lm_head.weight") {
          return ""; // the tied head: model.decoder.embed_tokens.weight
        }
        if (starts_with(key, "decoder.")) {
          return "model." + key; // a bare OPTModel's checkpoint
        }
        return key;
      });
}

void save_pretrained(
    OPTForCausalLM& model,
    const std::string& dir,
    const SavePretrainedOptions& options) {
  detail::save_pretrained_model(model, dir, options);
}

void save_pretrained_config(const OPTConfig& config, const std::string& dir) {
  detail::write_config_json(dir, config_to_json(config));
}

} // namespace models
} // namespace colossalai
