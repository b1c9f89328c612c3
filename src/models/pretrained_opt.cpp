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

} // namespace

OPTConfig opt_config_from_json(const std::string& text) {
  const detail::ConfigFields f(text);
  f.one_of("model_type", "opt", {"opt"}, "OPTForCausalLM");
  const auto act =
      f.one_of("activation_function", "relu", {"relu", "gelu"}, "OPT");
  // Checkpoints fine-tuned before transformers 4.20.1 without the final
  // LayerNorm.
  f.require("_remove_final_layer_norm", false, "OPT");
  // Layers skipped at random in training: not implemented.
  f.require("layerdrop", 0.0, "OPT");
  f.require("tie_word_embeddings", true, "OPT");
  OPTConfig c;
  c.vocab_size(f.size("vocab_size", c.vocab_size()))
      .hidden_size(f.size("hidden_size", c.hidden_size()))
      .ffn_dim(f.size("ffn_dim", c.ffn_dim()))
      .num_hidden_layers(f.size("num_hidden_layers", c.num_hidden_layers()))
      .num_attention_heads(
          f.size("num_attention_heads", c.num_attention_heads()))
      .max_position_embeddings(
          f.size("max_position_embeddings", c.max_position_embeddings()));
  // null (transformers' None): hidden_size.
  c.word_embed_proj_dim(f.size("word_embed_proj_dim", 0))
      .do_layer_norm_before(
          f.boolean("do_layer_norm_before", c.do_layer_norm_before()))
      .enable_bias(f.boolean("enable_bias", c.enable_bias()))
      .layer_norm_elementwise_affine(f.boolean(
          "layer_norm_elementwise_affine", c.layer_norm_elementwise_affine()))
      .dropout(f.probability("dropout", c.dropout()))
      .attention_dropout(
          f.probability("attention_dropout", c.attention_dropout()))
      .activation_function(act)
      .init_std(f.non_negative("init_std", c.init_std()))
      // Absent: transformers' default (1); null: no padding index.
      .pad_token_id(detail::token_id_or_none(
          f, "pad_token_id", c.pad_token_id(), c.vocab_size()))
      .source_json(text);
  detail::check_divisible(
      f,
      "hidden_size",
      c.hidden_size(),
      "num_attention_heads",
      c.num_attention_heads());
  return c;
}

std::string config_to_json(const OPTConfig& c) {
  auto j = detail::source_fields(c.source_json());
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
  const auto config = detail::read_pretrained_config(dir, opt_config_from_json);
  return detail::load_pretrained_model<OPTForCausalLM>(
      dir,
      config,
      {config.num_hidden_layers(), "num_hidden_layers"},
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
