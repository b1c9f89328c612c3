// config.json <-> BloomConfig, and BLOOM's checkpoint key names.

#include "models/pretrained_internal.h"

#include <colossalai/models/bloom.h>

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

// `j[key]`, else `j[alias]`, else `fallback`.
int64_t get_aliased(
    const json& j,
    const char* key,
    const char* alias,
    int64_t fallback) {
  return get_or<int64_t>(j, key, get_or<int64_t>(j, alias, fallback));
}

} // namespace

BloomConfig bloom_config_from_json(const std::string& text) {
  const auto j = detail::parse_json(text);
  const auto type = get_or<std::string>(j, "model_type", "bloom");
  TORCH_CHECK(
      type == "bloom",
      "BloomConfig: config.json's model_type is '",
      type,
      "', not bloom");
  // slow_but_exact sums the Megatron slices of dense and dense_4h_to_h
  // without their biases: another computation.
  const auto pretraining_tp = get_or<int64_t>(j, "pretraining_tp", 1);
  TORCH_CHECK(
      pretraining_tp <= 1 || !get_or<bool>(j, "slow_but_exact", false),
      "Bloom config.json: slow_but_exact = true with pretraining_tp = ",
      pretraining_tp,
      " is not supported (only slow_but_exact = false or pretraining_tp = "
      "1)");
  require(j, "tie_word_embeddings", true, "Bloom");
  BloomConfig c;
  // transformers' BloomConfig: n_embed, when given, overrides hidden_size;
  // num_hidden_layers and num_attention_heads are n_layer's and n_head's
  // other names.
  c.vocab_size(get_or<int64_t>(j, "vocab_size", c.vocab_size()))
      .hidden_size(get_or<int64_t>(
          j, "n_embed", get_or<int64_t>(j, "hidden_size", c.hidden_size())))
      .n_layer(get_aliased(j, "n_layer", "num_hidden_layers", c.n_layer()))
      .n_head(get_aliased(j, "n_head", "num_attention_heads", c.n_head()))
      .layer_norm_epsilon(
          get_or<double>(j, "layer_norm_epsilon", c.layer_norm_epsilon()))
      .hidden_dropout(get_or<double>(j, "hidden_dropout", c.hidden_dropout()))
      .attention_dropout(
          get_or<double>(j, "attention_dropout", c.attention_dropout()))
      .initializer_range(
          get_or<double>(j, "initializer_range", c.initializer_range()))
      .apply_residual_connection_post_layernorm(get_or<bool>(
          j,
          "apply_residual_connection_post_layernorm",
          c.apply_residual_connection_post_layernorm()))
      .pad_token_id(get_or<int64_t>(j, "pad_token_id", -1))
      .source_json(text);
  return c;
}

std::string config_to_json(const BloomConfig& c) {
  auto j = base_json(c.source_json());
  // The aliases would shadow (n_embed) or contradict the fields written.
  for (const char* alias :
       {"n_embed", "num_hidden_layers", "num_attention_heads"}) {
    j.erase(alias);
  }
  j["model_type"] = "bloom";
  j["architectures"] = {"BloomForCausalLM"};
  j["vocab_size"] = c.vocab_size();
  j["hidden_size"] = c.hidden_size();
  j["n_layer"] = c.n_layer();
  j["n_head"] = c.n_head();
  j["layer_norm_epsilon"] = c.layer_norm_epsilon();
  j["hidden_dropout"] = c.hidden_dropout();
  j["attention_dropout"] = c.attention_dropout();
  j["initializer_range"] = c.initializer_range();
  j["apply_residual_connection_post_layernorm"] =
      c.apply_residual_connection_post_layernorm();
  j["tie_word_embeddings"] = true;
  j["pad_token_id"] =
      c.pad_token_id() >= 0 ? json(c.pad_token_id()) : json(nullptr);
  return j.dump(2) + "\n";
}

template <>
BloomForCausalLM from_pretrained<BloomForCausalLM>(
    const std::string& dir,
    const FromPretrainedOptions& options) {
  const auto text = detail::read_config_json(dir);
  return detail::load_pretrained_model<BloomForCausalLM>(
      dir,
      text,
      bloom_config_from_json(text),
      options,
      [](const std::string& key) -> std::string {
        if (key == "lm_head.weight") {
          return ""; // the tied head
        }
        if (starts_with(key, "transformer.") || starts_with(key, "lm_head.")) {
          return key;
        }
        return "transformer." + key; // a bare BloomModel's checkpoint
      });
}

void save_pretrained(
    BloomForCausalLM& model,
    const std::string& dir,
    const SavePretrainedOptions& options) {
  detail::save_pretrained_model(model, dir, options);
}

void save_pretrained_config(const BloomConfig& config, const std::string& dir) {
  detail::write_config_json(dir, config_to_json(config));
}

} // namespace models
} // namespace colossalai
