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

// The size `key` gives, else its other name `alias`, else `fallback`; `used`
// receives the field read, for messages.
int64_t aliased_size(
    const detail::ConfigFields& f,
    const char* key,
    const char* alias,
    int64_t fallback,
    const char** used) {
  *used = f.has(key) || !f.has(alias) ? key : alias;
  return f.size(*used, fallback);
}

} // namespace

BloomConfig bloom_config_from_json(const std::string& text) {
  const detail::ConfigFields f(text);
  f.one_of("model_type", "bloom", {"bloom"}, "BloomForCausalLM");
  // slow_but_exact sums the Megatron slices of dense and dense_4h_to_h
  // without their biases: another computation.
  const auto pretraining_tp = f.size("pretraining_tp", 1);
  if (f.boolean("slow_but_exact", false) && pretraining_tp > 1) {
    f.fail(
        "slow_but_exact",
        "= true with pretraining_tp = " + std::to_string(pretraining_tp) +
            " is not supported by Bloom (only slow_but_exact = false or "
            "pretraining_tp = 1)");
  }
  f.require("tie_word_embeddings", true, "Bloom");
  BloomConfig c;
  // transformers' BloomConfig: n_embed, when given, overrides hidden_size;
  // num_hidden_layers and num_attention_heads are n_layer's and n_head's
  // other names.
  const char* width = nullptr;
  const char* layers = nullptr;
  const char* heads = nullptr;
  c.vocab_size(f.size("vocab_size", c.vocab_size()))
      .hidden_size(
          aliased_size(f, "n_embed", "hidden_size", c.hidden_size(), &width))
      .n_layer(
          aliased_size(f, "n_layer", "num_hidden_layers", c.n_layer(), &layers))
      .n_head(
          aliased_size(f, "n_head", "num_attention_heads", c.n_head(), &heads))
      .layer_norm_epsilon(
          f.positive("layer_norm_epsilon", c.layer_norm_epsilon()))
      .hidden_dropout(f.probability("hidden_dropout", c.hidden_dropout()))
      .attention_dropout(
          f.probability("attention_dropout", c.attention_dropout()))
      .initializer_range(
          f.non_negative("initializer_range", c.initializer_range()))
      .apply_residual_connection_post_layernorm(f.boolean(
          "apply_residual_connection_post_layernorm",
          c.apply_residual_connection_post_layernorm()))
      .pad_token_id(
          detail::token_id_or_none(f, "pad_token_id", -1, c.vocab_size()))
      .source_json(text);
  detail::check_divisible(f, width, c.hidden_size(), heads, c.n_head());
  return c;
}

std::string config_to_json(const BloomConfig& c) {
  auto j = detail::source_fields(c.source_json());
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
  const auto config =
      detail::read_pretrained_config(dir, bloom_config_from_json);
  return detail::load_pretrained_model<BloomForCausalLM>(
      dir,
      config,
      {config.n_layer(), "n_layer"},
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
